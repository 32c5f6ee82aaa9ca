"""The zero-order core shared by SOMA and DiPaCo.

- :mod:`megatron_ext.zo.step`: the whole SPSA step of one or more bodies (perturb -> batched
  losses -> differences -> estimate), what a trainer calls;
- :mod:`megatron_ext.zo.probes`: counter-based sparse Rademacher probes, regenerated from
  ``(seed, expert, update, batch, direction)`` with bit-identical results on every device;
- :mod:`megatron_ext.zo.spsa`: the primitives of the step (perturb, differences, the
  central-difference estimate), Adam with coupled weight decay, and the plateau rule that halves
  lr and ε together;
- :mod:`megatron_ext.zo.directions`: splitting one estimate's directions over ranks.

The public API, what a trainer or a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below; its modules are internals.
"""

from megatron_ext.zo.directions import DirectionSplit
from megatron_ext.zo.probes import probe_matrix, probe_rows, second_moments
from megatron_ext.zo.spsa import PlateauHalving, ZOAdam, loss_differences, perturb, spsa_estimate
from megatron_ext.zo.step import SPSABody, SPSAResult, spsa_step

__all__ = [
    "DirectionSplit",
    "PlateauHalving",
    "SPSABody",
    "SPSAResult",
    "ZOAdam",
    "loss_differences",
    "perturb",
    "probe_matrix",
    "probe_rows",
    "second_moments",
    "spsa_estimate",
    "spsa_step",
]
