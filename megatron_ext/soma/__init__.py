"""SOMA: independent byte-level experts, each trained on one tf-idf cluster of the corpus.

- :mod:`megatron_ext.soma.data`: byte windows, the held-out split, per-expert shards, batches.
- :mod:`megatron_ext.soma.router`: the tf-idf + SVD + balanced spherical k-means router.
- :mod:`megatron_ext.soma.layout`: the expert's shape, its tensors' order in one flat body
  vector, their initialisation.
- :mod:`megatron_ext.soma.model`: the batched forward of many bodies (perturbed copies or
  experts side by side), and the seed run's exact head gradient.
- :mod:`megatron_ext.soma.variance`: SPSA gradient variance against the exact gradient and the
  small-ε theory (CSV + PNG report).

Nothing is imported here, so ``import megatron_ext.soma.router`` does not pay for torch.
"""
