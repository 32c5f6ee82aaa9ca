"""KL-SOAP's per-batch math: KL-Shampoo factors, eigenbasis refresh, Adam in the eigenbasis.

Per matrix ``G`` of shape ``(m, n)`` (Algorithm 2 of the KL-Shampoo paper, Lin et al., 2025,
arXiv:2509.03378, with SOAP's Adam-in-the-eigenbasis, Vyas et al., 2024):

1. KL-Shampoo factors, using the current bases Q_L, Q_R *before* this step's refresh:
   ``λ_L = diag(Q_Lᵀ L Q_L)``, ``λ_R = diag(Q_Rᵀ R Q_R)``, ``S^(−p) = Q diag((λ + ε)^(−p)) Qᵀ``,
   ``L ← (1 − β_k)L + (β_k/n)·G S_R^(−p) Gᵀ`` and ``R ← (1 − β_k)R + (β_k/m)·Gᵀ S_L^(−p) G``.
   Alternatively (``inverse_root="newton_schulz"``) ``S^(−p) = (factor + εI)^(−p)`` from a coupled
   Newton–Schulz iteration on the factor itself (:mod:`.matrix_roots`).
2. Every ``refresh_every`` steps: ``Q ← orth(L·Q)`` (:mod:`.eigenbasis`; ``eigh`` at the first
   refresh). Because the factors already hold this step's gradient, the basis never lags the
   gradient — with the per-step refresh this removes the loss spikes seen with stale bases.
3. Adam in the eigenbasis: ``G' = Q_Lᵀ G Q_R``, ``m ← β1·m + (1 − β1)·G'``,
   ``v ← β2·v + (1 − β2)·G'²``, ``N = m̂ / (√v̂ + ε)`` with bias corrections
   ``m̂ = m/(1 − β1ᵗ)``, ``v̂ = v/(1 − β2ᵗ)``, ``ΔW = Q_L N Q_Rᵀ``, and
   ``W ← (1 − ηλ)W − η·ΔW``. The paper's listing writes the moment EMAs with β and 1 − β swapped
   (``m ← (1 − β1)m + β1·G'``); this module uses the standard convention above.

Implementation notes.

* The first moment is stored in the parameter's own coordinates and projected into the current
  basis each step. That is exactly "rotate it out with the old basis and into the new one" at
  every refresh (``Q_newᵀ (Q_old m Q_oldᵀ) Q_new``) and costs one two-sided product instead of
  two. The second moment lives in the eigenbasis; its rows/columns follow the basis columns when
  a refresh reorders them.
* ``G S_R^(−p) Gᵀ`` is formed as ``(G Q_R D)(G Q_R D)ᵀ`` with ``D = diag((λ_R + ε)^(−p/2))``, so
  ``S`` is never materialised.
* The refresh's power-iteration product ``L·Q`` is not formed from scratch where a cheaper exact
  form exists: ``L_old·Q`` is computed once for the approximate eigenvalues, and
  ``L_new·Q = (1 − β_k)·L_old Q + (β_k/n)·X (Xᵀ Q)`` adds the low-rank term (see
  :func:`_accumulate`) — ``m²n`` instead of ``m³`` flops for the larger factor of a rectangular
  matrix. The factor updates form only half of the symmetric product
  (:func:`~.symmetric.symmetric_bmm`).
* ``stale_refresh=True`` reproduces the reference SOAP behaviour for ablations: the basis is
  refreshed every 10 steps (unless ``refresh_every`` says otherwise) from factors that do not yet
  include the current gradient (except at step 1, where the factors are still empty).

The functions here work on one batch of same-shape matrices (:class:`KLSoapMatrices`);
:class:`~.kl_soap.KLSoap` is the ``torch.optim.Optimizer`` around them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from .eigenbasis import RefreshMode, eigh_descending, refresh_eigenbasis
from .matrix_roots import inverse_root_newton_schulz
from .symmetric import symmetric_bmm
from .validation import check_betas, check_choice, check_range

__all__ = [
    "STALE_REFRESH_EVERY",
    "STATE_KEYS",
    "InverseRoot",
    "KLSoapConfig",
    "KLSoapMatrices",
    "accumulate_kl_factors",
    "adam_in_eigenbasis",
    "kl_soap_direction",
    "refresh_bases",
]

InverseRoot = Literal["eigenbasis", "newton_schulz"]

STATE_KEYS = ("exp_avg", "exp_avg_sq", "factor_l", "factor_r", "basis_l", "basis_r")
STALE_REFRESH_EVERY = 10


@dataclass(frozen=True)
class KLSoapConfig:
    """Hyperparameters of the per-matrix KL-SOAP math (see the module docstring)."""

    betas: tuple[float, float] = (0.9, 0.95)
    kron_beta: float = 0.95
    eps: float = 1e-8
    factor_eps: float = 1e-8
    factor_exponent: float = 1.0
    refresh_every: int = 1
    refresh_mode: RefreshMode = "qr"
    inverse_root: InverseRoot = "eigenbasis"
    root_iters: int = 25
    stale_refresh: bool = False

    def __post_init__(self) -> None:
        check_betas("betas", self.betas)
        check_range("kron_beta", self.kron_beta, low=0.0, high=1.0, low_open=True)
        check_range("eps", self.eps, low=0.0)
        check_range("factor_eps", self.factor_eps, low=0.0)
        check_range("factor_exponent", self.factor_exponent, low=0.0, low_open=True)
        check_range("refresh_every", self.refresh_every, low=1)
        check_choice("refresh_mode", self.refresh_mode, RefreshMode)
        check_choice("inverse_root", self.inverse_root, InverseRoot)
        check_range("root_iters", self.root_iters, low=1)
        if not isinstance(self.stale_refresh, bool):
            raise ValueError(f"stale_refresh must be a bool, got {self.stale_refresh!r}")
        if self.inverse_root == "newton_schulz" and self.root_index is None:
            raise ValueError(
                "inverse_root='newton_schulz' needs factor_exponent = 1/r for an integer r "
                f"(1, 0.5, 0.25, ...), got {self.factor_exponent}"
            )

    @property
    def root_index(self) -> int | None:
        """r with ``factor_exponent = 1/r``, or None if there is no such integer."""
        r = round(1.0 / self.factor_exponent)
        return r if r >= 1 and math.isclose(1.0 / r, self.factor_exponent, rel_tol=1e-12) else None


@dataclass
class KLSoapMatrices:
    """Batched KL-SOAP state of B matrices of shape ``(m, n)``; updated in place.

    Attributes:
        exp_avg: ``(B, m, n)`` first moment, parameter coordinates.
        exp_avg_sq: ``(B, m, n)`` second moment, eigenbasis coordinates.
        factor_l: ``(B, m, m)`` Kronecker factor L.
        factor_r: ``(B, n, n)`` Kronecker factor R.
        basis_l: ``(B, m, m)`` eigenbasis Q_L (orthonormal columns).
        basis_r: ``(B, n, n)`` eigenbasis Q_R.
    """

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    factor_l: torch.Tensor
    factor_r: torch.Tensor
    basis_l: torch.Tensor
    basis_r: torch.Tensor

    @classmethod
    def zeros(
        cls, batch: int, m: int, n: int, device: torch.device | None = None
    ) -> KLSoapMatrices:
        """Fresh state: zero moments and factors, identity bases."""

        def eye(k: int) -> torch.Tensor:
            return torch.eye(k, device=device).expand(batch, k, k).clone()

        zeros = torch.zeros(batch, m, n, device=device)
        return cls(
            zeros,
            zeros.clone(),
            torch.zeros(batch, m, m, device=device),
            torch.zeros(batch, n, n, device=device),
            eye(m),
            eye(n),
        )


def accumulate_kl_factors(grad: torch.Tensor, s: KLSoapMatrices, cfg: KLSoapConfig) -> None:
    """Step 1: add ``G S_R^(−p) Gᵀ/n`` to L and ``Gᵀ S_L^(−p) G/m`` to R (EMA ``kron_beta``)."""
    _accumulate(grad, s, cfg, with_products=False)


def _low_rank_cheaper(k: int, other: int) -> bool:
    """Whether ``L_new·Q`` (``k×k`` factor of a ``k×other`` gradient) is cheaper from the
    low-rank form ``(1−β)·(L_old·Q) + w·X·(XᵀQ)`` than as a fresh ``k³`` product: it costs
    ``k²·other`` plus the shared ``Q_Lᵀ G Q_R`` (``k·other·min(k, other)``)."""
    return k * k * other + k * other * min(k, other) < k**3


def _accumulate(
    grad: torch.Tensor, s: KLSoapMatrices, cfg: KLSoapConfig, *, with_products: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Step 1, and with ``with_products`` also ``(L_new·Q_L, R_new·Q_R)`` for the refresh.

    The approximate eigenvalues need ``L_old·Q_L`` anyway, and ``L_new = (1−β)L_old + w·XXᵀ``
    with ``X = G Q_R D_R``, so ``L_new·Q_L = (1−β)·L_old Q_L + w·X·(D_R G'ᵀ)`` where
    ``G' = Q_Lᵀ G Q_R`` (old bases): an ``m²n`` product instead of ``m³``. The same holds for R
    with ``Y = D_L Q_Lᵀ G`` and ``Y·Q_R = D_L G'``. Each side takes whichever form has fewer
    flops (:func:`_low_rank_cheaper`); both equal ``factor @ basis`` up to rounding.
    """
    m, n = grad.shape[-2], grad.shape[-1]
    decay, weight = 1.0 - cfg.kron_beta, cfg.kron_beta
    if cfg.inverse_root != "eigenbasis":
        root = cfg.root_index
        assert root is not None
        inv_r = inverse_root_newton_schulz(
            s.factor_r, root, eps=cfg.factor_eps, num_iters=cfg.root_iters
        )
        inv_l = inverse_root_newton_schulz(
            s.factor_l, root, eps=cfg.factor_eps, num_iters=cfg.root_iters
        )
        s.factor_l.baddbmm_(torch.bmm(grad, inv_r), grad.mT, beta=decay, alpha=weight / n)
        s.factor_r.baddbmm_(grad.mT, torch.bmm(inv_l, grad), beta=decay, alpha=weight / m)
        return None
    # Both λ from the factors before either is updated.
    half = -0.5 * cfg.factor_exponent
    lq = torch.bmm(s.factor_l, s.basis_l)
    rq = torch.bmm(s.factor_r, s.basis_r)
    d_l = (s.basis_l * lq).sum(dim=-2).clamp_min_(0).add_(cfg.factor_eps).pow_(half)
    d_r = (s.basis_r * rq).sum(dim=-2).clamp_min_(0).add_(cfg.factor_eps).pow_(half)
    qtg = torch.bmm(s.basis_l.mT, grad)  # Q_Lᵀ G
    gq = torch.bmm(grad, s.basis_r)  # G Q_R
    low_l = with_products and _low_rank_cheaper(m, n)
    low_r = with_products and _low_rank_cheaper(n, m)
    projected = None
    if low_l or low_r:  # G' = Q_Lᵀ G Q_R, in the cheaper order
        projected = torch.bmm(qtg, s.basis_r) if n <= m else torch.bmm(s.basis_l.mT, gq)
    left = gq.mul_(d_r.unsqueeze(-2))  # G Q_R D_R
    right = qtg.mul_(d_l.unsqueeze(-1))  # D_L Q_Lᵀ G
    symmetric_bmm(left, left.mT, s.factor_l, add=s.factor_l, beta=decay, alpha=weight / n)
    symmetric_bmm(right.mT, right, s.factor_r, add=s.factor_r, beta=decay, alpha=weight / m)
    if not with_products:
        return None
    if low_l:
        assert projected is not None
        lq.baddbmm_(left, (projected * d_r.unsqueeze(-2)).mT, beta=decay, alpha=weight / n)
    else:
        torch.bmm(s.factor_l, s.basis_l, out=lq)
    if low_r:
        assert projected is not None
        rq.baddbmm_(right.mT, projected.mul_(d_l.unsqueeze(-1)), beta=decay, alpha=weight / m)
    else:
        torch.bmm(s.factor_r, s.basis_r, out=rq)
    return lq, rq


def refresh_bases(
    s: KLSoapMatrices,
    mode: RefreshMode,
    first: bool,
    products: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Step 2: refresh Q_L and Q_R from the factors; permute v to follow reordered columns.

    ``products`` are ``(L·Q_L, R·Q_R)`` if the caller has them (they are overwritten).
    """
    sides = ((s.factor_l, s.basis_l, -2), (s.factor_r, s.basis_r, -1))
    for i, (factor, basis, dim) in enumerate(sides):
        if first:
            basis.copy_(eigh_descending(factor))  # v is still zero: nothing to permute
            continue
        product = None if products is None else products[i]
        _, order = refresh_eigenbasis(factor, basis, mode, product, out=basis)
        index = order.unsqueeze(-1) if dim == -2 else order.unsqueeze(-2)
        s.exp_avg_sq.copy_(torch.take_along_dim(s.exp_avg_sq, index, dim=dim))


def adam_in_eigenbasis(
    grad: torch.Tensor, s: KLSoapMatrices, cfg: KLSoapConfig, step: int
) -> torch.Tensor:
    """Step 3: update the moments and return ``ΔW = Q_L N Q_Rᵀ``, ``N = m̂'/(√v̂ + ε)``.

    ``m̂' = Q_Lᵀ m Q_R / (1 − β1ᵗ)`` is the first moment projected into the current basis.
    ``grad`` (``(B, m, n)``, fp32; ``step`` is 1-based) is overwritten: its storage holds ΔW.
    """
    beta1, beta2 = cfg.betas
    s.exp_avg.lerp_(grad, 1.0 - beta1)
    work = torch.bmm(s.basis_l.mT, grad)
    projected = torch.bmm(work, s.basis_r, out=grad)  # G' (the gradient is no longer needed)
    s.exp_avg_sq.mul_(beta2).addcmul_(projected, projected, value=1.0 - beta2)
    torch.bmm(s.basis_l.mT, s.exp_avg, out=work)
    moment = torch.bmm(work, s.basis_r, out=projected)  # m' = Q_Lᵀ m Q_R
    # (1 − β1ᵗ)(√v̂ + ε), so that one division gives N
    denom = torch.sqrt(s.exp_avg_sq, out=work).div_((1.0 - beta2**step) ** 0.5).add_(cfg.eps)
    moment.div_(denom.mul_(1.0 - beta1**step))
    torch.bmm(s.basis_l, moment, out=work)
    return torch.bmm(work, s.basis_r.mT, out=moment)


def kl_soap_direction(
    grad: torch.Tensor, s: KLSoapMatrices, cfg: KLSoapConfig, step: int
) -> torch.Tensor:
    """One KL-SOAP step for a batch: update ``s`` and return ``ΔW`` (``W ← W − η·ΔW``).

    Args:
        grad: ``(B, m, n)`` fp32 gradients; overwritten (the result reuses their storage).
        s: batched state, updated in place.
        cfg: hyperparameters.
        step: 1-based step count of these matrices.

    Returns:
        ``(B, m, n)`` update direction ΔW, without learning rate or weight decay.
    """
    refresh = (step - 1) % cfg.refresh_every == 0
    if cfg.stale_refresh and step > 1:
        if refresh:
            refresh_bases(s, cfg.refresh_mode, first=False)
        accumulate_kl_factors(grad, s, cfg)
    else:
        first = step == 1
        want = refresh and not first and cfg.refresh_mode != "eigh"
        products = _accumulate(grad, s, cfg, with_products=want)
        if refresh:
            refresh_bases(s, cfg.refresh_mode, first, products)
    return adam_in_eigenbasis(grad, s, cfg, step)
