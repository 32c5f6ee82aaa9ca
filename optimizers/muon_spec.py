"""Muon (:class:`~.muon.Muon`): EMA momentum orthogonalised by Newton–Schulz.

Conventions, as in Emerging-Optimizers and megatron-core (whose ``muon_*`` fields these follow):
``M ← βM + (1 − β)G`` (β = ``muon_momentum`` weighs the old momentum), Nesterov as
``G + β(M − G)``, decoupled weight decay, update ``scale·NS(M)`` with ``scale = √max(m, n)``
(``spectral``), ``√max(1, m/n)`` (``shape``) or ``√(m/n)`` (``unit_rms``) times
``muon_extra_scale_factor``. The spectral scale gives the update RMS 1 (a full-rank m×n
orthogonal factor has RMS 1/√max(m, n)), so ``optimizer.match_update_rms`` multiplies it by
``optimizer.update_rms`` (0.2: AdamW's update RMS) and one LR serves Muon and the AdamW part.
With ``muon_rms_match=beta`` the factor is √((1 − β)/(1 + β)) from ``muon_momentum`` instead
(paper: Sec. 5.2, "a correction factor that depends on the EMA damping factor of momentum",
≈ 0.2; 0.160 at β = 0.95): the optimizer applies it (option ``rms_match``), and
``optimizer.update_rms`` is not used for Muon.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from .ns_schedule import newton_schulz_flops
from .options import (
    CoefficientSet,
    FP32MatmulPrecision,
    NSMethod,
    NSPrecision,
    RMSMatch,
    ScaleMode,
)
from .spec import MegatronNames, OptimizerSpec, option

#: Megatron-LM / Emerging-Optimizers spelling -> megatron-ext's (absent: no counterpart)
MUON_SCALE_MODES = {"spectral": "spectral", "shape_scaling": "shape", "unit_rms_norm": "unit_rms"}
MUON_COEFFICIENTS = {
    "simple": "quintic",  # Keller Jordan's one triple
    "quintic": "quintic_schedule",  # modded-nanogpt's five triples, cycled (Megatron's default)
    "polar_express": "polar_express",
}
#: megatron-core's Muon fields shared by MOP (megatron-core has one set of muon_* fields)
MOMENTUM_FIELDS = ("momentum", "nesterov", "extra_scale_factor")


def momentum_megatron_fields(prefix: str) -> dict[str, str]:
    """megatron-core's ``muon_*`` momentum fields, TP mode and QKV split -> ``<prefix>_*``."""
    return {
        **{f"muon_{k}": f"{prefix}_{k}" for k in MOMENTUM_FIELDS},
        "muon_scale_mode": f"{prefix}_scale_mode",
        "muon_tp_mode": "tp_mode",
        "muon_split_qkv": "split_qkv",
    }


def _ns_precision(fp32_matmul_prec: str) -> str:
    """megatron-core's Muon (Emerging-Optimizers) runs Newton–Schulz in bf16 under "medium"."""
    return "bf16" if fp32_matmul_prec == "medium" else "fp32"


def momentum_rms_factor(beta: float) -> float:
    """√((1 − β)/(1 + β)): the RMS of an EMA ``M ← βM + (1 − β)G`` of i.i.d. unit-RMS G in
    its steady state, the update-RMS correction factor of the paper (Sec. 5.2) for momentum β."""
    return math.sqrt((1.0 - beta) / (1.0 + beta))


@dataclass(kw_only=True)
class MomentumOptions:
    """Momentum, Nesterov, scale mode, extra scale and RMS match: shared by Muon and MOP (each
    its own recipe fields: ``muon_momentum``, ``mop_momentum``)."""

    momentum: float = option(
        0.95,
        ge=0.0,
        lt=1.0,
        help="β of the EMA momentum M ← βM + (1 − β)G (weight of the old M)",
        formerly=("momentum",),
    )
    nesterov: bool = option(False, help="orthogonalise G + β(M − G)")
    scale_mode: ScaleMode = option(
        "spectral",
        help="spectral = √max(m,n) (update RMS 1), shape = √max(1,m/n), unit_rms = √(m/n)",
    )
    extra_scale_factor: float = option(
        1.0,
        gt=0.0,
        help="multiplies the update scale; with optimizer.match_update_rms the update RMS is "
        "optimizer.update_rms (or rms_match=beta's factor) × this",
        formerly=("extra_scale_factor",),
    )
    rms_match: RMSMatch = option(
        "constant",
        help="update-RMS factor under optimizer.match_update_rms: constant = "
        "optimizer.update_rms; beta = √((1 − β)/(1 + β)) from the momentum β "
        "(paper Sec. 5.2; 0.16 at β = 0.95)",
    )


@dataclass(kw_only=True)
class MuonOptions(MomentumOptions):
    """Muon's recipe options (``optimizer.muon_<field>``, megatron-core's ``muon_*`` names)."""

    coefficient_type: CoefficientSet = option(
        "polar_express",
        kwarg="coefficients",
        help="Newton–Schulz polynomial per step (quintic_cubic: best with num_ns_steps 4)",
        formerly=("ns_coefficients",),
    )
    num_ns_steps: int = option(
        5, kwarg="num_steps", ge=1, help="Newton–Schulz iterations", formerly=("ns_steps",)
    )
    ns_method: NSMethod = option(
        "auto", help="plain NS, Gram NS on the small side, or auto (fewer flops)"
    )
    ns_precision: NSPrecision = option(
        "fp32", kwarg="precision", help="precision of the Newton–Schulz products"
    )
    fp32_matmul_prec: FP32MatmulPrecision = option(
        "highest",
        help="torch.set_float32_matmul_precision while Newton–Schulz runs (GPUs: high/medium "
        "allow TF32/bf16 passes; megatron-core's default is medium)",
    )


def own_rms_factor(section: Any, prefix: str) -> float | None:
    """With ``<prefix>_rms_match=beta``, the factor the optimizer applies itself (from its
    momentum); None where the spec multiplies by ``optimizer.update_rms``."""
    own: MomentumOptions = section.options[prefix]
    if own.rms_match != "beta":
        return None
    return momentum_rms_factor(own.momentum)


def check_rms_matchable(section: Any, prefix: str) -> None:
    """RMS matching assumes the spectral scale (update RMS 1 before the factor); the β-derived
    factor is a way of matching, so it needs matching on."""
    own: MomentumOptions = section.options[prefix]
    if own.rms_match == "beta" and not section.match_update_rms:
        raise ValueError(
            f"optimizer.{prefix}_rms_match=beta scales the update to √((1 − β)/(1 + β)) of "
            f"optimizer.{prefix}_momentum, but optimizer.match_update_rms=false asks for the "
            f"unscaled update: set optimizer.match_update_rms=true, or "
            f"optimizer.{prefix}_rms_match=constant"
        )
    mode = own.scale_mode
    if section.match_update_rms and mode != "spectral":
        raise ValueError(
            f"optimizer.{prefix}_scale_mode={mode} sets its own update scale, but "
            f"optimizer.match_update_rms=true scales the spectral one to AdamW's update RMS: "
            f"use {prefix}_scale_mode=spectral, or set optimizer.match_update_rms=false"
        )


def muon_flops(rows: int, cols: int, kwargs: Mapping[str, Any]) -> float:
    """Newton–Schulz (the method Muon picks) plus the momentum update."""
    steps = kwargs.get("num_steps", 5)
    coefficients = kwargs.get("coefficients", "polar_express")
    precision = kwargs.get("precision", "fp32")
    method = kwargs.get("ns_method", "auto")
    methods: tuple[Literal["plain", "gram"], ...] = (
        ("plain", "gram") if method == "auto" else (method,)
    )
    ns = min(
        newton_schulz_flops(rows, cols, steps, m, precision=precision, coefficients=coefficients)
        for m in methods
    )
    return ns + 4 * rows * cols


SPEC = OptimizerSpec(
    name="muon",
    target="megatron_ext.optimizers.muon:Muon",
    summary="Muon (Newton–Schulz orthogonalised momentum) on hidden matrices, AdamW on the rest",
    couples_matrix_entries=True,
    tp_modes=("blockwise", "duplicated", "distributed"),
    uses=("lr", "weight_decay", "tp_mode"),
    options=MuonOptions,
    update_rms_kwarg="extra_scale_factor",
    own_update_rms=lambda section: own_rms_factor(section, "muon"),
    check=lambda section: check_rms_matchable(section, "muon"),
    flops=muon_flops,
    state_bytes=lambda rows, cols: 4 * rows * cols,  # momentum
    label="Muon",
    megatron=MegatronNames(
        optimizers=("muon",),
        fields={
            **momentum_megatron_fields("muon"),
            "muon_num_ns_steps": "muon_num_ns_steps",
            "muon_fp32_matmul_prec": "muon_fp32_matmul_prec",
            "muon_coefficient_type": "muon_coefficient_type",
        },
        choices={"muon_scale_mode": MUON_SCALE_MODES, "muon_coefficient_type": MUON_COEFFICIENTS},
        derived={"muon_ns_precision": ("muon_fp32_matmul_prec", _ns_precision)},
        core_defaults={"muon_ns_method": "plain"},  # megatron-core has no Gram Newton–Schulz
        flags={
            "muon-momentum": "muon_momentum",
            "muon-nesterov": "muon_nesterov",
            "muon-num-ns-steps": "muon_num_ns_steps",
            "muon-extra-scale-factor": "muon_extra_scale_factor",
            "muon-tp-mode": "tp_mode",
            "muon-scale-mode": "muon_scale_mode",
            "muon-coefficient-type": "muon_coefficient_type",
        },
        # Megatron-LM's argparse defaults (its --muon-momentum 0.9; OptimizerConfig says 0.95)
        flag_defaults={
            "muon_momentum": 0.9,
            "muon_coefficient_type": "quintic_schedule",  # its "quintic"
            "tp_mode": "blockwise",
        },
    ),
)
