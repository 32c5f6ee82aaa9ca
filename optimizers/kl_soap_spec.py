"""KL-SOAP (:class:`~.kl_soap.KLSoap`): SOAP with KL-Shampoo factors and a per-step eigenbasis
refresh that includes the current gradient (the algorithm: :mod:`.kl_soap_math`).

Recipe fields ``optimizer.kl_soap_*``; Adam's β1, β2 and ε in the eigenbasis are the shared
``optimizer.adam_beta1``, ``adam_beta2``, ``adam_eps``. Conventions, checked against
Emerging-Optimizers' ``SOAP(use_kl_shampoo=True)`` and, for ``kl_soap_factor_update=shampoo``,
``SOAP(use_kl_shampoo=False)`` (tests/test_optim_parity.py): ``kl_soap_shampoo_beta`` weighs the
*old* factor (``L ← β·L + (1 − β)·new``, SOAP's ``shampoo_beta``), bias-corrected by default;
``kl_soap_factor_eps`` is absolute, in the units of the factors' eigenvalues. Its update is
Adam's, rotated: it already has AdamW's update RMS.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .adamw_spec import ELEMENTWISE_FLOPS
from .options import FactorUpdate, InverseRoot, RefreshMode
from .spec import MegatronNames, OptimizerSpec, option

#: The options only KL-Shampoo factors read, at their defaults. Shampoo's ``G Gᵀ`` takes no
#: inverse root, so ``factor_update="shampoo"`` refuses any other value (it would be ignored).
KL_ONLY_DEFAULTS: dict[str, float | str] = {
    "factor_eps": 1e-8,
    "factor_exponent": 1.0,
    "inverse_root": "eigenbasis",
}


@dataclass(kw_only=True)
class KLSoapOptions:
    """KL-SOAP's recipe options (``optimizer.kl_soap_<field>``)."""

    factor_update: FactorUpdate = option(
        "kl",
        help="kl: KL-Shampoo L ← βL + (1 − β)/n·G S_R^(−p) Gᵀ (and R); shampoo: SOAP's plain "
        "L ← βL + (1 − β)·G Gᵀ, R ← βR + (1 − β)·GᵀG (no factor_eps/exponent/inverse root)",
    )
    shampoo_beta: float = option(
        0.95,
        ge=0.0,
        lt=1.0,
        help="weight of the OLD factor in the EMA of L and R (SOAP's convention)",
    )
    correct_shampoo_beta_bias: bool = option(
        True, help="bias-correct the factor EMA: β_t = 1 − (1 − β)/(1 − βᵗ)"
    )
    factor_eps: float = option(
        1e-8,
        ge=0.0,
        help="absolute ε in (λ + ε)^(−p), units of the factors' eigenvalues (kl factors)",
    )
    factor_exponent: float = option(
        1.0, gt=0.0, help="p of S^(−p) (1 for KL-Shampoo; kl factors only)"
    )
    refresh_every: int = option(
        0,
        ge=0,
        help="eigenbasis refresh period in steps; 0 = 1 (10 with kl_soap_stale_refresh)",
    )
    refresh_mode: RefreshMode = option(
        "qr", help="qr (one power-iteration step), eigh, or cholesky_qr2 (GPU-friendly)"
    )
    inverse_root: InverseRoot = option(
        "eigenbasis",
        help="S^(−p) from the eigenbasis diagonal, or by coupled Newton–Schulz on the factor "
        "(kl factors only)",
    )
    root_iters: int = option(
        25,
        ge=1,
        help="most Newton–Schulz iterations of kl_soap_inverse_root=newton_schulz (p = 1 stops "
        "once converged; other roots run all)",
    )
    root_damping: float = option(
        1e-4,
        ge=0.0,
        help="damping of the Newton–Schulz roots relative to ‖factor‖_F (added to factor_eps)",
    )
    stale_refresh: bool = option(
        False,
        help="ablation: reference SOAP's refresh from factors without the current gradient",
    )


def root_index(exponent: float) -> int | None:
    """r with ``exponent = 1/r`` for an integer r ≥ 1, else None."""
    r = round(1.0 / exponent)
    return r if r >= 1 and math.isclose(1.0 / r, exponent, rel_tol=1e-12) else None


def check_factor_update(factor_update: str, values: Mapping[str, Any], prefix: str = "") -> None:
    """Raise ``ValueError`` if ``factor_update="shampoo"`` comes with a KL-only option (named
    ``prefix + key`` in the message) away from its default (:data:`KL_ONLY_DEFAULTS`)."""
    if factor_update != "shampoo":
        return
    changed = [f"{prefix}{k}={values[k]!r}" for k, v in KL_ONLY_DEFAULTS.items() if values[k] != v]
    if changed:
        defaults = ", ".join(f"{prefix}{k}={v!r}" for k, v in KL_ONLY_DEFAULTS.items())
        raise ValueError(
            f"{prefix}factor_update='shampoo' accumulates G Gᵀ and GᵀG, which take no "
            f"inverse root, so {', '.join(changed)} would be ignored: keep {defaults}, or use "
            f"{prefix}factor_update='kl'"
        )


def kl_soap_flops(m: int, n: int, factor_update: FactorUpdate = "kl") -> float:
    """FLOPs (2 per multiply-add) of one step with a refresh by ``qr``, one ``m×n`` matrix.

    Factor updates (kept as ``L·Q_L``, ``R·Q_R``): KL-Shampoo's need ``Q_Lᵀ G``, ``G Q_R`` and
    ``G'`` and two low-rank updates; Shampoo's ``G (Q_Lᵀ G)ᵀ`` and ``Gᵀ (G Q_R)`` need ``Q_Lᵀ G``,
    ``G Q_R`` and those two products (no ``G'``: ``2mn·min(m, n)`` fewer). Then per side a
    triangular product (``k³``), ``geqrf`` and forming Q (``4/3·k³`` each), and the three
    two-sided products of Adam in the eigenbasis.
    """
    two_sided = 2 * m * n * (m + n)
    updates = two_sided + two_sided
    if factor_update == "kl":
        updates += 2 * m * n * min(m, n)
    per_side = (1 + 4 / 3 + 4 / 3) * (m**3 + n**3)
    return updates + per_side + 3 * two_sided


def _step_flops(rows: int, cols: int, kwargs: Mapping[str, Any]) -> float:
    factor_update = kwargs.get("factor_update", "kl")
    return kl_soap_flops(rows, cols, factor_update) + ELEMENTWISE_FLOPS * rows * cols


def _state_bytes(rows: int, cols: int) -> int:
    # L·Q_L, R·Q_R, Q_L, Q_R and the two Adam moments (either factor update)
    return 4 * (2 * rows * rows + 2 * cols * cols + 2 * rows * cols)


def _refresh_every(kwargs: dict[str, Any]) -> dict[str, Any]:
    if kwargs["refresh_every"] == 0:  # the recipe's "default": 1, or 10 with stale_refresh
        kwargs["refresh_every"] = None
    return kwargs


def _factor_update(use_kl_shampoo: bool) -> str:
    """megatron-core's ``soap_use_kl_shampoo`` as ``kl_soap_factor_update``."""
    return "kl" if use_kl_shampoo else "shampoo"


def _check(section: Any) -> None:
    own: KLSoapOptions = section.options["kl_soap"]
    check_factor_update(
        own.factor_update,
        {k: getattr(own, k) for k in KL_ONLY_DEFAULTS},
        prefix="optimizer.kl_soap_",
    )
    if own.inverse_root == "newton_schulz" and root_index(own.factor_exponent) is None:
        raise ValueError(
            "optimizer.kl_soap_inverse_root=newton_schulz needs optimizer.kl_soap_factor_exponent "
            f"= 1/r for an integer r (1, 0.5, 0.25, ...), got {own.factor_exponent}"
        )


SPEC = OptimizerSpec(
    name="kl_soap",
    target="megatron_ext.optimizers.kl_soap:KLSoap",
    summary="KL-SOAP (Adam in the KL-Shampoo or Shampoo eigenbasis) on the hidden matrices, "
    "AdamW on the rest",
    couples_matrix_entries=True,
    tp_modes=("blockwise", "duplicated"),
    full_state_tp_modes=("duplicated",),
    uses=("lr", "weight_decay", "adam", "tp_mode"),
    options=KLSoapOptions,
    pack=_refresh_every,
    check=_check,
    flops=_step_flops,
    state_bytes=_state_bytes,
    label="KL-SOAP",
    # megatron-core's SOAP (Emerging-Optimizers'); soap_use_kl_shampoo picks the factor update
    # (megatron_ext.megatron.drop_in)
    megatron=MegatronNames(
        optimizers=("soap",),
        fields={
            "soap_shampoo_beta": "kl_soap_shampoo_beta",
            "soap_precondition_frequency": "kl_soap_refresh_every",
        },
        derived={"kl_soap_factor_update": ("soap_use_kl_shampoo", _factor_update)},
    ),
)
