"""KL-SOAP's per-batch math: KL-Shampoo (or Shampoo) factors, eigenbasis refresh, Adam in the
eigenbasis.

Per matrix ``G`` of shape ``(m, n)`` (Algorithm 2 of the KL-Shampoo paper, Lin et al., 2025,
arXiv:2509.03378, with SOAP's Adam-in-the-eigenbasis, Vyas et al., 2024):

1. KL-Shampoo factors, using the current bases Q_L, Q_R *before* this step's refresh:
   ``λ_L = diag(Q_Lᵀ L Q_L)``, ``λ_R = diag(Q_Rᵀ R Q_R)``, ``S^(−p) = Q diag((λ + ε)^(−p)) Qᵀ``,
   ``L ← β_s·L + (1 − β_s)/n·G S_R^(−p) Gᵀ`` and ``R ← β_s·R + (1 − β_s)/m·Gᵀ S_L^(−p) G``.
   β_s (``shampoo_beta``, default 0.95) weighs the *old* factor, as in Shampoo, SOAP and
   Emerging-Optimizers (``L.lerp_(new, 1 − shampoo_beta)``). With ``correct_shampoo_beta_bias``
   (default on, as in Emerging-Optimizers) step t uses ``β_t = 1 − (1 − β_s)/(1 − β_sᵗ)``, so
   the factors are the bias-corrected average of the terms so far (β_1 = 0: the first step's
   factor is its own term). ε is absolute (units of λ); Emerging-Optimizers clamps instead,
   ``max(λ, ε)^(−p)``, which differs from ``(λ + ε)^(−p)`` only where λ is within a few ε.
   Alternatively (``inverse_root="newton_schulz"``) ``S^(−p) = (factor + δI)^(−p)`` from a
   Newton–Schulz iteration (:mod:`.matrix_roots`), damped by ``δ = ε + root_damping·‖factor‖_F``:
   the relative term bounds the condition number by 1/root_damping (1e4), which fp32
   Newton–Schulz needs to converge in ``root_iters`` steps — zero-initialised factors of
   rectangular matrices are rank-deficient, and from the first step's ``S = I/ε`` their
   eigenvalues span ~1e16. The root is taken in the held basis, ``S^(−p) = Q X Qᵀ`` with
   ``X = (Qᵀ·factor·Q + δI)^(−p)`` (exact for any orthogonal Q; :func:`root_in_basis`), where
   the factor is nearly diagonal: for p = 1 the inverse of its unit-diagonal scaling converges
   in a few iterations and stops once its residual says so (measured: 1 on Gaussian gradients,
   also with ``refresh_every = 10``; at most ``root_iters``); for p = 1/r, r > 1, the coupled
   iteration from I runs ``root_iters`` iterations.
   With ``factor_update="shampoo"`` the factors are SOAP's plain Shampoo EMA instead (SOAP
   Alg. 1; Emerging-Optimizers' ``SOAP(use_kl_shampoo=False)``):
   ``L ← β_t·L + (1 − β_t)·G Gᵀ`` and ``R ← β_t·R + (1 − β_t)·Gᵀ G`` — same β_t (old factor
   weighted, bias-corrected alike), no 1/n, 1/m scales, no S^(−p) (so no ``factor_eps``,
   ``factor_exponent`` or ``inverse_root``), and the same refresh and Adam steps below.
2. Every ``refresh_every`` steps: ``Q ← orth(L·Q)`` (:mod:`.eigenbasis`; ``eigh`` at the first
   refresh). Because the factors already hold this step's gradient, the basis never lags the
   gradient — with the per-step refresh this removes the loss spikes seen with stale bases.
3. Adam in the eigenbasis: ``G' = Q_Lᵀ G Q_R``, ``m ← β1·m + (1 − β1)·G'``,
   ``v ← β2·v + (1 − β2)·G'²``, ``N = m̂ / (√v̂ + ε)`` with bias corrections
   ``m̂ = m/(1 − β1ᵗ)``, ``v̂ = v/(1 − β2ᵗ)``, ``ΔW = Q_L N Q_Rᵀ``, and
   ``W ← (1 − ηλ)W − η·ΔW``. The paper's listing writes the moment EMAs with β and 1 − β swapped
   (``m ← (1 − β1)m + β1·G'``); this module uses the standard convention above.

Implementation notes.

* The factors are held as their products with the bases, ``P_L = L·Q_L`` and ``P_R = R·Q_R``
  (state ``factor_basis_l``/``factor_basis_r``; ``L = P_L·Q_Lᵀ``), never as L and R:
  - ``λ_L = diag(Q_Lᵀ P_L)`` is an element-wise product, not a ``m³`` matmul;
  - the factor update needs only its product with the basis, and that has a low-rank form:
    ``L_new·Q_L = β_t·P_L + (1 − β_t)/n·G S_R^(−p) Gᵀ Q_L
    = β_t·P_L + (1 − β_t)/n·(G Q_R D_R)·G'ᵀ`` with ``G' = Q_Lᵀ G Q_R`` and
    ``D = diag((λ + ε)^(−p))`` (S is never materialised), and for R
    ``(1 − β_t)/m·(D_L Q_Lᵀ G)ᵀ·G'`` — ``2m²n`` and ``2mn²`` flops, and no product for the
    factor itself;
  - the refresh is ``orth(P)``, and the QR's triangular factor gives the next product at half
    the cost of a matmul (:mod:`.eigenbasis`).
  Per matrix and step that is ``k³`` (triangular product) + ``2k²·other`` (update) per side
  instead of ``2k³`` (λ) + ``2k³`` (power product) + ``1.5k²·other`` (update) with explicit
  factors. Only the ``eigh`` refresh needs L itself; it forms it (``P·Qᵀ``, symmetrised). The
  Newton–Schulz roots need ``Qᵀ L Q = Qᵀ P`` (one product), and their ``X`` replaces ``D²``
  in the same low-rank update: ``(G Q_R X_R)·G'ᵀ`` and ``(X_L Q_Lᵀ G)ᵀ·G'``.
* The first moment is stored in the parameter's own coordinates and projected into the current
  basis each step. That is exactly "rotate it out with the old basis and into the new one" at
  every refresh (``Q_newᵀ (Q_old m Q_oldᵀ) Q_new``) and costs one two-sided product instead of
  two. The second moment lives in the eigenbasis; its rows/columns follow the basis columns when
  a refresh reorders them.
* The Shampoo factor update uses the same held products,
  ``L_new·Q_L = β_t·P_L + (1 − β_t)·G·(Q_Lᵀ G)ᵀ`` and
  ``R_new·Q_R = β_t·P_R + (1 − β_t)·Gᵀ·(G Q_R)``: ``4mn(m + n)`` flops per matrix (no ``G'``:
  ``2mn·min(m, n)`` fewer than the KL update).
* ``stale_refresh=True`` reproduces the reference SOAP behaviour for ablations: the basis is
  refreshed every 10 steps (unless ``refresh_every`` says otherwise) from factors that do not yet
  include the current gradient (except at step 1, where the factors are still empty). With
  ``factor_update="shampoo"`` (and ``correct_shampoo_beta_bias=False``) that is the reference
  SOAP's factor and refresh schedule.

The functions here work on one batch of same-shape matrices (:class:`KLSoapMatrices`);
:class:`~.kl_soap.KLSoap` is the ``torch.optim.Optimizer`` around them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .eigenbasis import (
    RefreshMode,
    column_major,
    diagonal_in_basis,
    factor_from_product,
    refresh_eigenbasis,
    take_rows,
)
from .kl_soap_spec import check_factor_update, root_index
from .matrix_roots import inverse_newton_schulz, inverse_root_newton_schulz
from .options import FactorUpdate, InverseRoot
from .validation import check_betas, check_choice, check_range

__all__ = [
    "STALE_REFRESH_EVERY",
    "STATE_KEYS",
    "KLSoapConfig",
    "KLSoapMatrices",
    "accumulate_factors",
    "accumulate_kl_factors",
    "accumulate_shampoo_factors",
    "adam_in_eigenbasis",
    "explicit_factors",
    "kl_soap_direction",
    "refresh_bases",
    "root_in_basis",
]


STATE_KEYS = (
    "exp_avg",
    "exp_avg_sq",
    "factor_basis_l",
    "factor_basis_r",
    "basis_l",
    "basis_r",
)
#: State held column-major (:func:`~.eigenbasis.column_major`).
COLUMN_MAJOR_KEYS = ("factor_basis_l", "factor_basis_r", "basis_l", "basis_r")
STALE_REFRESH_EVERY = 10


@dataclass(frozen=True)
class KLSoapConfig:
    """Hyperparameters of the per-matrix KL-SOAP math (see the module docstring).

    ``factor_update`` is ``kl`` (KL-Shampoo factors) or ``shampoo`` (SOAP's ``G Gᵀ``, ``Gᵀ G``);
    with ``shampoo``, ``factor_eps``, ``factor_exponent`` and ``inverse_root`` must keep their
    defaults (nothing reads them).
    """

    factor_update: FactorUpdate = "kl"
    betas: tuple[float, float] = (0.9, 0.95)
    shampoo_beta: float = 0.95
    correct_shampoo_beta_bias: bool = True
    eps: float = 1e-8
    factor_eps: float = 1e-8
    factor_exponent: float = 1.0
    refresh_every: int = 1
    refresh_mode: RefreshMode = "qr"
    inverse_root: InverseRoot = "eigenbasis"
    root_iters: int = 25
    root_damping: float = 1e-4
    stale_refresh: bool = False

    def __post_init__(self) -> None:
        check_choice("factor_update", self.factor_update, FactorUpdate)
        check_betas("betas", self.betas)
        check_range("shampoo_beta", self.shampoo_beta, low=0.0, high=1.0, high_open=True)
        if not isinstance(self.correct_shampoo_beta_bias, bool):
            raise ValueError(
                f"correct_shampoo_beta_bias must be a bool, got {self.correct_shampoo_beta_bias!r}"
            )
        check_range("eps", self.eps, low=0.0)
        check_range("factor_eps", self.factor_eps, low=0.0)
        check_range("factor_exponent", self.factor_exponent, low=0.0, low_open=True)
        check_range("refresh_every", self.refresh_every, low=1)
        check_choice("refresh_mode", self.refresh_mode, RefreshMode)
        check_choice("inverse_root", self.inverse_root, InverseRoot)
        check_range("root_iters", self.root_iters, low=1)
        check_range("root_damping", self.root_damping, low=0.0)
        if not isinstance(self.stale_refresh, bool):
            raise ValueError(f"stale_refresh must be a bool, got {self.stale_refresh!r}")
        check_factor_update(
            self.factor_update,
            {
                "factor_eps": self.factor_eps,
                "factor_exponent": self.factor_exponent,
                "inverse_root": self.inverse_root,
            },
        )
        if self.inverse_root == "newton_schulz" and self.root_index is None:
            raise ValueError(
                "inverse_root='newton_schulz' needs factor_exponent = 1/r for an integer r "
                f"(1, 0.5, 0.25, ...), got {self.factor_exponent}"
            )

    def factor_beta(self, step: int) -> float:
        """β_t, the weight of the old factor at 1-based ``step`` (bias-corrected if enabled)."""
        beta = self.shampoo_beta
        if not self.correct_shampoo_beta_bias:
            return beta
        return 1.0 - (1.0 - beta) / (1.0 - beta**step)

    @property
    def root_index(self) -> int | None:
        """r with ``factor_exponent = 1/r``, or None if there is no such integer."""
        return root_index(self.factor_exponent)


@dataclass
class KLSoapMatrices:
    """Batched KL-SOAP state of B matrices of shape ``(m, n)``; updated in place.

    Attributes:
        exp_avg: ``(B, m, n)`` first moment, parameter coordinates.
        exp_avg_sq: ``(B, m, n)`` second moment, eigenbasis coordinates.
        factor_basis_l: ``(B, m, m)`` ``L·Q_L``, the Kronecker factor L times its eigenbasis.
        factor_basis_r: ``(B, n, n)`` ``R·Q_R``.
        basis_l: ``(B, m, m)`` eigenbasis Q_L (orthonormal columns).
        basis_r: ``(B, n, n)`` eigenbasis Q_R.

    The last four are best column-major (see :mod:`.eigenbasis`); :meth:`zeros` makes them so.
    """

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    factor_basis_l: torch.Tensor
    factor_basis_r: torch.Tensor
    basis_l: torch.Tensor
    basis_r: torch.Tensor

    @classmethod
    def zeros(
        cls, batch: int, m: int, n: int, device: torch.device | None = None
    ) -> KLSoapMatrices:
        """Fresh state: zero moments and factors, identity bases."""

        def eye(k: int) -> torch.Tensor:
            return column_major(torch.eye(k, device=device).expand(batch, k, k))

        def square_zeros(k: int) -> torch.Tensor:
            return torch.zeros(batch, k, k, device=device).mT

        zeros = torch.zeros(batch, m, n, device=device)
        return cls(zeros, zeros.clone(), square_zeros(m), square_zeros(n), eye(m), eye(n))


def explicit_factors(s: KLSoapMatrices) -> tuple[torch.Tensor, torch.Tensor]:
    """The Kronecker factors ``(L, R)`` themselves, ``(B, m, m)`` and ``(B, n, n)``."""
    return (
        factor_from_product(s.factor_basis_l, s.basis_l),
        factor_from_product(s.factor_basis_r, s.basis_r),
    )


def accumulate_kl_factors(
    grad: torch.Tensor, s: KLSoapMatrices, cfg: KLSoapConfig, step: int
) -> None:
    """Step 1: EMA of ``G S_R^(−p) Gᵀ/n`` into L and ``Gᵀ S_L^(−p) G/m`` into R (the old factor
    weighted by :meth:`KLSoapConfig.factor_beta` at 1-based ``step``), keeping
    ``factor_basis_l = L·Q_L`` and ``factor_basis_r = R·Q_R`` with the current bases."""
    m, n = grad.shape[-2], grad.shape[-1]
    decay = cfg.factor_beta(step)
    weight = 1.0 - decay
    qtg = torch.bmm(s.basis_l.mT, grad)  # Q_Lᵀ G
    gq = torch.bmm(grad, s.basis_r)  # G Q_R
    # G' = Q_Lᵀ G Q_R, in the cheaper order
    projected = torch.bmm(qtg, s.basis_r) if n <= m else torch.bmm(s.basis_l.mT, gq)
    if cfg.inverse_root == "eigenbasis":
        # Both λ from the factors before either is updated: λ = diag(Qᵀ·(L·Q)); D² = (λ + ε)^(−p)
        power = -cfg.factor_exponent
        d2_l = diagonal_in_basis(s.factor_basis_l, s.basis_l).clamp_min_(0)
        d2_r = diagonal_in_basis(s.factor_basis_r, s.basis_r).clamp_min_(0)
        d2_l = d2_l.add_(cfg.factor_eps).pow_(power)
        d2_r = d2_r.add_(cfg.factor_eps).pow_(power)
        left = gq.mul_(d2_r.unsqueeze(-2))  # G Q_R D_R²
        right = qtg.mul_(d2_l.unsqueeze(-1))  # D_L² Q_Lᵀ G
    else:
        # S^(−p) = Q X Qᵀ with X = (Qᵀ L Q + δI)^(−p) (Q orthogonal), both before the update
        left = torch.bmm(gq, root_in_basis(s.factor_basis_r, s.basis_r, cfg)[0])
        right = torch.bmm(root_in_basis(s.factor_basis_l, s.basis_l, cfg)[0], qtg)
    # L_new·Q_L = β·L Q_L + (1−β)/n·G S_R Gᵀ Q_L = β·L Q_L + (1−β)/n·(G Q_R X_R)·G'ᵀ
    s.factor_basis_l.baddbmm_(left, projected.mT, beta=decay, alpha=weight / n)
    # R_new·Q_R = β·R Q_R + (1−β)/m·Gᵀ S_L G Q_R = β·R Q_R + (1−β)/m·(X_L Q_Lᵀ G)ᵀ·G'
    s.factor_basis_r.baddbmm_(right.mT, projected, beta=decay, alpha=weight / m)


def root_in_basis(
    product: torch.Tensor, basis: torch.Tensor, cfg: KLSoapConfig
) -> tuple[torch.Tensor, int]:
    """``X = Qᵀ (F + δI)^(−p) Q`` ``(B, k, k)`` of the factor ``F`` (given as ``P = F·Q`` and Q),
    ``δ = ε + root_damping·‖F‖_F``, by Newton–Schulz on ``Qᵀ F Q + δI`` (equal to ``Qᵀ(F + δI)Q``
    for orthogonal Q); and the iterations it took.

    For p = 1 the held eigenbasis nearly diagonalises F, which is what
    :func:`~.matrix_roots.inverse_newton_schulz` exploits (it stops once converged, at most
    ``root_iters``); other roots run ``root_iters`` coupled iterations from I.
    """
    root = cfg.root_index
    assert root is not None
    in_basis = torch.bmm(basis.mT, product)  # Qᵀ F Q
    in_basis = in_basis.add_(in_basis.mT.clone()).mul_(0.5)
    eps = _root_eps(in_basis, cfg)  # ‖Qᵀ F Q‖_F = ‖F‖_F
    if root == 1:
        return inverse_newton_schulz(in_basis, eps=eps, max_iters=cfg.root_iters)
    x = inverse_root_newton_schulz(in_basis, root, eps=eps, num_iters=cfg.root_iters)
    return x, cfg.root_iters


def accumulate_shampoo_factors(
    grad: torch.Tensor, s: KLSoapMatrices, cfg: KLSoapConfig, step: int
) -> None:
    """Step 1 with ``factor_update="shampoo"``: EMA of ``G Gᵀ`` into L and ``Gᵀ G`` into R (the
    old factor weighted by :meth:`KLSoapConfig.factor_beta`), keeping ``factor_basis_l = L·Q_L``
    and ``factor_basis_r = R·Q_R`` with the current bases; ``grad`` is ``(B, m, n)``."""
    decay = cfg.factor_beta(step)
    weight = 1.0 - decay
    qtg = torch.bmm(s.basis_l.mT, grad)  # Q_Lᵀ G
    gq = torch.bmm(grad, s.basis_r)  # G Q_R
    # L_new·Q_L = β·L Q_L + (1−β)·G Gᵀ Q_L = β·L Q_L + (1−β)·G·(Q_Lᵀ G)ᵀ
    s.factor_basis_l.baddbmm_(grad, qtg.mT, beta=decay, alpha=weight)
    # R_new·Q_R = β·R Q_R + (1−β)·Gᵀ G Q_R
    s.factor_basis_r.baddbmm_(grad.mT, gq, beta=decay, alpha=weight)


def accumulate_factors(grad: torch.Tensor, s: KLSoapMatrices, cfg: KLSoapConfig, step: int) -> None:
    """Step 1, the factor update ``cfg.factor_update`` selects."""
    if cfg.factor_update == "shampoo":
        accumulate_shampoo_factors(grad, s, cfg, step)
    else:
        accumulate_kl_factors(grad, s, cfg, step)


def _root_eps(factor: torch.Tensor, cfg: KLSoapConfig) -> torch.Tensor:
    """``(B, 1, 1)`` damping ``ε + root_damping·‖factor‖_F`` of the Newton–Schulz roots."""
    norm = torch.linalg.matrix_norm(factor, ord="fro", keepdim=True)
    return norm.mul_(cfg.root_damping).add_(cfg.factor_eps)


def refresh_bases(s: KLSoapMatrices, mode: RefreshMode, first: bool) -> None:
    """Step 2: refresh Q_L and Q_R (``eigh`` if ``first``) from the factors, keep the products
    ``L·Q_L``, ``R·Q_R`` current, and permute v to follow reordered columns."""
    sides = ((s.factor_basis_l, s.basis_l, -2), (s.factor_basis_r, s.basis_r, -1))
    for product, basis, dim in sides:
        order = refresh_eigenbasis(product, basis, "eigh" if first else mode)
        if first:
            continue  # v is still zero: nothing to permute
        if dim == -2:
            s.exp_avg_sq.copy_(take_rows(s.exp_avg_sq, order))
        else:
            s.exp_avg_sq.copy_(torch.take_along_dim(s.exp_avg_sq, order.unsqueeze(-2), dim=-1))


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
        accumulate_factors(grad, s, cfg, step)
    else:
        accumulate_factors(grad, s, cfg, step)
        if refresh:
            refresh_bases(s, cfg.refresh_mode, first=step == 1)
    return adam_in_eigenbasis(grad, s, cfg, step)
