"""KL-SOAP: SOAP with KL-Shampoo Kronecker factors and a per-step eigenbasis refresh.

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
* Matrices of equal shape and step count are processed as one batch. State lives in stacked
  tensors (:class:`~.packing.StatePacker`); per step the full-size transients are the stacked
  gradient and up to three matmul workspaces per matrix in the batch (``Q_Lᵀ G``, ``G Q_R`` and,
  for the low-rank refresh product, ``Q_Lᵀ G Q_R``).
* ``stale_refresh=True`` reproduces the reference SOAP behaviour for ablations: the basis is
  refreshed every 10 steps (unless ``refresh_every`` says otherwise) from factors that do not yet
  include the current gradient (except at step 1, where the factors are still empty).
* 1-D parameters are not preconditioned: route them to AdamW.
* Tensor parallelism (``tp_shards``, group option ``tp_mode``): ``duplicated`` all-gathers the
  gradient shards of a stacked batch (one collective), keeps full-size state — factors
  ``m² + n²``, bases ``m² + n²``, moments ``2mn`` per matrix — replicated on every TP rank (the
  TP=1 memory, t times a rank's share of it), computes the full update and applies this rank's
  slice: the TP=1 update. ``blockwise`` treats each shard as its own matrix (not the TP=1
  algorithm). There is no ``distributed`` mode: the eigenbases of the factors couple all rows
  and columns, so sharding them would need a distributed eigensolver/QR.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from megatron_ext.distributed.tensor_parallel import (
    ShardSplit,
    TPMode,
    TPShardInfo,
    check_tp_mode,
    gather_shards,
    own_shard,
)

from .eigenbasis import RefreshMode, eigh_descending, refresh_eigenbasis
from .matrix_roots import inverse_root_newton_schulz
from .orthogonalized import default_max_batch_numel
from .packing import StatePacker
from .symmetric import symmetric_bmm
from .validation import check_betas, check_choice, check_range

__all__ = [
    "InverseRoot",
    "KLSoap",
    "KLSoapConfig",
    "KLSoapMatrices",
    "accumulate_kl_factors",
    "adam_in_eigenbasis",
    "kl_soap_direction",
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


class KLSoap(torch.optim.Optimizer):
    """KL-SOAP for 2-D weights and 3-D ``(E, m, n)`` expert stacks (each expert its own matrix).

    Args:
        params: parameters (2-D or 3-D) or parameter-group dicts.
        lr: learning rate η.
        betas: Adam's (β1, β2) in the eigenbasis.
        kron_beta: EMA weight β_k of the new KL-Shampoo term in L and R.
        eps: Adam's ε.
        factor_eps: ε in ``(λ + ε)^(−p)`` (absolute, in the units of the factors).
        factor_exponent: p (1 for KL-Shampoo).
        weight_decay: decoupled weight decay λ.
        refresh_every: refresh period F in steps (default 1; 10 with ``stale_refresh``).
        refresh_mode: ``qr``, ``eigh`` or ``cholesky_qr2``.
        inverse_root: ``eigenbasis`` or ``newton_schulz`` (see the module docstring).
        root_iters: coupled Newton–Schulz iterations for ``inverse_root="newton_schulz"``.
        stale_refresh: ablation: reference SOAP's stale refresh (see the module docstring).
        tp_mode: for parameters in ``tp_shards``: ``duplicated`` (default; TP=1 update, full
            state on every TP rank) or ``blockwise`` (each shard its own matrix).
        tp_shards: tensor-parallel shards among ``params`` and their
            :class:`~megatron_ext.distributed.tensor_parallel.TPShardInfo`.
        max_batch_numel: largest stacked batch, in gradient elements; default
            :func:`~.orthogonalized.default_max_batch_numel`.
    """

    #: ``tp_mode`` values KL-SOAP implements.
    supported_tp_modes = ("blockwise", "duplicated")

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 3e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        kron_beta: float = 0.95,
        eps: float = 1e-8,
        factor_eps: float = 1e-8,
        factor_exponent: float = 1.0,
        weight_decay: float = 0.0,
        refresh_every: int | None = None,
        refresh_mode: RefreshMode = "qr",
        inverse_root: InverseRoot = "eigenbasis",
        root_iters: int = 25,
        stale_refresh: bool = False,
        tp_mode: TPMode = "duplicated",
        tp_shards: Mapping[torch.Tensor, TPShardInfo] | None = None,
        max_batch_numel: int | None = None,
    ) -> None:
        if max_batch_numel is not None:
            check_range("max_batch_numel", max_batch_numel, low=1)
        self.max_batch_numel = max_batch_numel
        self.tp_shards = {p: i for p, i in (tp_shards or {}).items() if i.world_size > 1}
        self._packer = StatePacker()
        if refresh_every is None:
            refresh_every = STALE_REFRESH_EVERY if stale_refresh else 1
        defaults = dict(
            lr=lr,
            betas=tuple(betas),
            kron_beta=kron_beta,
            eps=eps,
            factor_eps=factor_eps,
            factor_exponent=factor_exponent,
            weight_decay=weight_decay,
            refresh_every=refresh_every,
            refresh_mode=refresh_mode,
            inverse_root=inverse_root,
            root_iters=root_iters,
            stale_refresh=stale_refresh,
            tp_mode=tp_mode,
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._config(group)  # validates
        check_range("lr", group["lr"], low=0.0)
        check_range("weight_decay", group["weight_decay"], low=0.0)
        check_tp_mode(group["tp_mode"], self.supported_tp_modes, "KLSoap")
        for p in group["params"]:
            if p.ndim not in (2, 3):
                raise ValueError(
                    f"KLSoap takes 2-D matrices or 3-D expert stacks, got a parameter of shape "
                    f"{tuple(p.shape)}; 1-D parameters are not preconditioned: route them to AdamW"
                )
            if p in self.tp_shards:
                self.tp_shards[p].matrix_axis(p.shape)  # validates partition_dim

    @staticmethod
    def _config(group: dict[str, Any]) -> KLSoapConfig:
        return KLSoapConfig(
            betas=tuple(group["betas"]),  # type: ignore[arg-type]
            kron_beta=group["kron_beta"],
            eps=group["eps"],
            factor_eps=group["factor_eps"],
            factor_exponent=group["factor_exponent"],
            refresh_every=group["refresh_every"],
            refresh_mode=group["refresh_mode"],
            inverse_root=group["inverse_root"],
            root_iters=group["root_iters"],
            stale_refresh=group["stale_refresh"],
        )

    def _split(self, p: torch.Tensor, group: dict[str, Any]) -> ShardSplit | None:
        """How ``p``'s matrices split over TP; None for whole matrices and ``blockwise``."""
        info = self.tp_shards.get(p)
        if info is None or group["tp_mode"] == "blockwise":
            return None
        return ShardSplit.of(info, info.matrix_axis(p.shape))

    def _init_state(self, p: torch.Tensor, m: int, n: int) -> None:
        """Fresh state for ``p``'s ``m×n`` matrices (the full ones for a duplicated shard)."""
        lead = p.shape[:-2]
        fresh = KLSoapMatrices.zeros(1, m, n, device=p.device)
        state = self.state[p]
        state["step"] = 0
        for key in STATE_KEYS:
            t = getattr(fresh, key)[0]
            state[key] = t.expand(*lead, *t.shape).clone()

    @torch.no_grad()
    def step(self, closure: Any = None) -> float | None:  # type: ignore[override]
        """One optimisation step; ``closure`` re-evaluates the loss as in torch.optim."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            cfg = self._config(group)
            # Batches: same (full) shape, same step count, split the same way over TP.
            buckets: dict[tuple[int, int, int, ShardSplit | None], list[torch.Tensor]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                split = self._split(p, group)
                m, n = p.shape[-2], p.shape[-1]
                if split is not None:
                    m, n = split.full_shape(m, n)
                if not self.state[p]:
                    self._init_state(p, m, n)
                key = (m, n, self.state[p]["step"], split)
                buckets.setdefault(key, []).append(p)
            for (m, n, done, split), params in buckets.items():
                gathered = 1 if split is None else split.world_size
                for chunk in self._chunks(params, gathered):
                    self._step_chunk(chunk, group, cfg, done + 1, (m, n), split)
        return loss

    def _chunks(
        self, params: list[torch.Tensor], gathered: int = 1
    ) -> Iterator[list[torch.Tensor]]:
        """Consecutive runs of params whose stacked gradients (``gathered`` shards each, for
        duplicated TP shards) stay within max_batch_numel."""
        limit = self.max_batch_numel or default_max_batch_numel(params[0].device)
        chunk: list[torch.Tensor] = []
        size = 0
        for p in params:
            if chunk and size + p.numel() * gathered > limit:
                yield chunk
                chunk, size = [], 0
            chunk.append(p)
            size += p.numel() * gathered
        if chunk:
            yield chunk

    def _step_chunk(
        self,
        params: list[torch.Tensor],
        group: dict[str, Any],
        cfg: KLSoapConfig,
        step: int,
        shape: tuple[int, int],
        split: ShardSplit | None,
    ) -> None:
        """One step of same-shape parameters; ``shape`` is their (full) matrix shape, ``split``
        how the local shards make up full matrices (None: the parameters are whole)."""
        m, n = shape
        shapes = {
            "exp_avg": (m, n),
            "exp_avg_sq": (m, n),
            "factor_l": (m, m),
            "factor_r": (n, n),
            "basis_l": (m, m),
            "basis_r": (n, n),
        }
        packed = {
            key: self._packer.pack(self.state, params, key, shapes[key]) for key in STATE_KEYS
        }
        local = params[0].shape[-2:]
        grads = torch.cat([p.grad.reshape(-1, *local) for p in params]).to(torch.float32)
        if split is not None:
            grads = gather_shards(grads, split)
        delta = kl_soap_direction(grads, KLSoapMatrices(**packed), cfg, step)
        if split is not None:
            delta = own_shard(delta, split)
        lr, wd = group["lr"], group["weight_decay"]
        offset = 0
        for p in params:
            count = p.numel() // local.numel()
            if wd != 0.0:
                p.mul_(1.0 - lr * wd)
            p.add_(delta[offset : offset + count].view_as(p), alpha=-lr)
            offset += count
            self.state[p]["step"] = step
