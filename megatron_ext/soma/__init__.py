"""SOMA: independent byte-level experts, each trained on one tf-idf cluster of the corpus.

- :mod:`megatron_ext.soma.data`: byte windows, the held-out split, per-expert shards, batches.
- :mod:`megatron_ext.soma.router`: the tf-idf + SVD + balanced spherical k-means router.
- :mod:`megatron_ext.soma.layout`: the expert's shape, its tensors' order in one flat body
  vector, their initialisation.
- :mod:`megatron_ext.soma.model`: the batched forward of many bodies (perturbed copies or
  experts side by side), and the seed run's exact head gradient.
- :mod:`megatron_ext.soma.variance`: SPSA gradient variance against the exact gradient and the
  small-ε theory (CSV + PNG report).

The public API, what a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below, loaded on first use (:func:`megatron_ext.exports.load_export`): importing
the package costs nothing; its modules are internals.
"""

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "batched_loss": "model",
    "BodyLayout": "layout",
    "build_windows": "data",
    "estimator_samples": "variance",
    "exact_gradient": "variance",
    "expert_shards": "data",
    "ExpertShape": "layout",
    "ExpertShard": "data",
    "ExpertState": "state",
    "fit_router": "router",
    "fma_peak_gflops": "native",
    "forward_kind": "forward",
    "fused_available": "scan",
    "head_update": "update",
    "init_body": "layout",
    "init_embedding": "layout",
    "naive_loss_loop": "model",
    "native_available": "native",
    "NORM_EPS": "model",
    "predicted_variance": "variance",
    "routed_eval": "evaluate",
    "routed_throughput": "evaluate",
    "RouterConfig": "router",
    "sample_batch": "data",
    "SomaConfig": "recipe",
    "split_documents": "data",
    "spsa_update": "update",
    "summed_vs_independent": "variance",
    "train": "trainer",
    "UpdateContext": "update",
    "window_texts": "data",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
