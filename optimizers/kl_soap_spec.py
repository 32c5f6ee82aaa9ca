"""KL-SOAP (:class:`~.kl_soap.KLSoap`): SOAP with KL-Shampoo factors and a per-step eigenbasis
refresh that includes the current gradient (the algorithm: :mod:`.kl_soap_math`).

Recipe fields ``optimizer.kl_soap_*``; Adam's β1, β2 and ε in the eigenbasis are the shared
``optimizer.adam_beta1``, ``adam_beta2``, ``adam_eps``. Conventions, checked against
Emerging-Optimizers' ``SOAP(use_kl_shampoo=True)`` (tests/test_optim_parity.py):
``kl_soap_shampoo_beta`` weighs the *old* factor (``L ← β·L + (1 − β)·new``, SOAP's
``shampoo_beta``), bias-corrected by default; ``kl_soap_factor_eps`` is absolute, in the units
of the factors' eigenvalues. Its update is Adam's, rotated: it already has AdamW's update RMS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from .adamw_spec import ELEMENTWISE_FLOPS
from .options import InverseRoot, RefreshMode
from .spec import Hyperparameter, OptimizerSpec


def root_index(exponent: float) -> int | None:
    """r with ``exponent = 1/r`` for an integer r ≥ 1, else None."""
    r = round(1.0 / exponent)
    return r if r >= 1 and math.isclose(1.0 / r, exponent, rel_tol=1e-12) else None


def kl_soap_flops(m: int, n: int) -> float:
    """FLOPs (2 per multiply-add) of one step with a refresh by ``qr``, one ``m×n`` matrix.

    ``Q_Lᵀ G``, ``G Q_R`` and ``G'`` for the factor updates, the two low-rank updates, per side a
    triangular product (``k³``), ``geqrf`` and forming Q (``4/3·k³`` each), and the three
    two-sided products of Adam in the eigenbasis.
    """
    two_sided = 2 * m * n * (m + n)
    updates = two_sided + 2 * m * n * min(m, n) + two_sided
    per_side = (1 + 4 / 3 + 4 / 3) * (m**3 + n**3)
    return updates + per_side + 3 * two_sided


def _step_flops(rows: int, cols: int, kwargs: Mapping[str, Any]) -> float:
    return kl_soap_flops(rows, cols) + ELEMENTWISE_FLOPS * rows * cols


def _state_bytes(rows: int, cols: int) -> int:
    # L·Q_L, R·Q_R, Q_L, Q_R and the two Adam moments
    return 4 * (2 * rows * rows + 2 * cols * cols + 2 * rows * cols)


def _refresh_every(kwargs: dict[str, Any]) -> dict[str, Any]:
    if kwargs["refresh_every"] == 0:  # the recipe's "default": 1, or 10 with stale_refresh
        kwargs["refresh_every"] = None
    return kwargs


def _check(section: Any) -> None:
    if section.kl_soap_inverse_root == "newton_schulz" and (
        root_index(section.kl_soap_factor_exponent) is None
    ):
        raise ValueError(
            "optimizer.kl_soap_inverse_root=newton_schulz needs optimizer.kl_soap_factor_exponent "
            f"= 1/r for an integer r (1, 0.5, 0.25, ...), got {section.kl_soap_factor_exponent}"
        )


SPEC = OptimizerSpec(
    name="kl_soap",
    target="megatron_ext.optimizers.kl_soap:KLSoap",
    summary="KL-SOAP (Adam in the KL-Shampoo eigenbasis) on the hidden matrices, AdamW on the rest",
    couples_matrix_entries=True,
    tp_modes=("blockwise", "duplicated"),
    full_state_tp_modes=("duplicated",),
    uses=("lr", "weight_decay", "adam", "tp_mode"),
    hyperparameters=(
        Hyperparameter(
            key="shampoo_beta",
            default=0.95,
            ge=0.0,
            lt=1.0,
            help="weight of the OLD factor in the EMA of L and R (SOAP's convention)",
        ),
        Hyperparameter(
            key="correct_shampoo_beta_bias",
            default=True,
            help="bias-correct the factor EMA: β_t = 1 − (1 − β)/(1 − βᵗ)",
        ),
        Hyperparameter(
            key="factor_eps",
            default=1e-8,
            ge=0.0,
            help="absolute ε in (λ + ε)^(−p), units of the factors' eigenvalues",
        ),
        Hyperparameter(
            key="factor_exponent", default=1.0, gt=0.0, help="p of S^(−p) (1 for KL-Shampoo)"
        ),
        Hyperparameter(
            key="refresh_every",
            default=0,
            ge=0,
            help="eigenbasis refresh period in steps; 0 = 1 (10 with kl_soap_stale_refresh)",
        ),
        Hyperparameter(
            key="refresh_mode",
            default="qr",
            choices=RefreshMode,
            help="qr (one power-iteration step), eigh, or cholesky_qr2 (GPU-friendly)",
        ),
        Hyperparameter(
            key="inverse_root",
            default="eigenbasis",
            choices=InverseRoot,
            help="S^(−p) from the eigenbasis diagonal, or by coupled Newton–Schulz on the factor",
        ),
        Hyperparameter(
            key="root_iters",
            default=25,
            ge=1,
            help="Newton–Schulz iterations of kl_soap_inverse_root=newton_schulz",
        ),
        Hyperparameter(
            key="root_damping",
            default=1e-4,
            ge=0.0,
            help="damping of the Newton–Schulz roots relative to ‖factor‖_F (added to factor_eps)",
        ),
        Hyperparameter(
            key="stale_refresh",
            default=False,
            help="ablation: reference SOAP's refresh from factors without the current gradient",
        ),
    ),
    pack=_refresh_every,
    check=_check,
    flops=_step_flops,
    state_bytes=_state_bytes,
)
