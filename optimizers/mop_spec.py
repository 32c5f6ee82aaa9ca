"""MOP (:class:`~.mop.MOP`): Muon with the exact polar factor (SVD).

Same momentum, Nesterov, scale and RMS-matching conventions as Muon (:mod:`.muon_spec`), under
``optimizer.mop_*``. Emerging-Optimizers' MOP scales by the momentum's nuclear norm by default;
this one by Muon's spectral scale, so that one LR serves MOP and the AdamW part.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .muon_spec import (
    MUON_SCALE_MODES,
    MomentumOptions,
    check_rms_matchable,
    momentum_megatron_fields,
    own_rms_factor,
)
from .options import PolarPrecision
from .spec import MegatronNames, OptimizerSpec, option


@dataclass(kw_only=True)
class MOPOptions(MomentumOptions):
    """MOP's recipe options (``optimizer.mop_<field>``)."""

    precision: PolarPrecision = option("fp32", help="precision of the SVD")


def mop_flops(rows: int, cols: int, kwargs: Mapping[str, Any]) -> float:
    """A thin SVD, 4·m²·n + 22·m³ (Golub & Van Loan; m ≤ n), plus the momentum update."""
    m, n = min(rows, cols), max(rows, cols)
    return 4 * m * m * n + 22 * m**3 + 4 * m * n


SPEC = OptimizerSpec(
    name="mop",
    target="megatron_ext.optimizers.mop:MOP",
    summary="MOP (exact polar factor of the momentum) on the hidden matrices, AdamW on the rest",
    couples_matrix_entries=True,
    tp_modes=("blockwise", "duplicated"),
    uses=("lr", "weight_decay", "tp_mode"),
    options=MOPOptions,
    update_rms_kwarg="extra_scale_factor",
    own_update_rms=lambda section: own_rms_factor(section, "mop"),
    check=lambda section: check_rms_matchable(section, "mop"),
    flops=mop_flops,
    state_bytes=lambda rows, cols: 4 * rows * cols,  # momentum
    label="MOP",
    # megatron-core has no MOP: the drop-in reads its muon_* fields for it
    megatron=MegatronNames(
        fields=momentum_megatron_fields("mop"),
        choices={"muon_scale_mode": MUON_SCALE_MODES},
        ignored={"muon_fp32_matmul_prec": "MOP's polar factor is an SVD at mop_polar_precision"},
    ),
)
