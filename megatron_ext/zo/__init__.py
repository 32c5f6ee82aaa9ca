"""The zero-order core shared by SOMA and DiPaCo.

- :mod:`megatron_ext.zo.probes`: counter-based sparse Rademacher probes, regenerated from
  ``(seed, expert, update, batch, direction)`` with bit-identical results on every device.
- :mod:`megatron_ext.zo.spsa`: the central-difference SPSA estimate, Adam with coupled weight
  decay, and the plateau rule that halves lr and ε together.
- :mod:`megatron_ext.zo.directions`: splitting one estimate's directions over ranks.
"""

from megatron_ext.zo.probes import (
    probe_matrix,
    probe_rows,
    random_bits,
    second_moments,
    sparse_rademacher,
)
from megatron_ext.zo.spsa import (
    PlateauHalving,
    ZOAdam,
    loss_differences,
    perturb,
    spsa_estimate,
)

__all__ = [
    "PlateauHalving",
    "ZOAdam",
    "loss_differences",
    "perturb",
    "probe_matrix",
    "probe_rows",
    "random_bits",
    "second_moments",
    "sparse_rademacher",
    "spsa_estimate",
]
