"""KL-SOAP: SOAP with KL-Shampoo Kronecker factors and a per-step eigenbasis refresh.

The factor update is selectable (``factor_update``): KL-Shampoo's (default) or SOAP's plain
Shampoo accumulation ``L ← βL + (1 − β)·G Gᵀ``, ``R ← βR + (1 − β)·Gᵀ G``; state and refresh are
the same for both.

The algorithm and its implementation notes are in :mod:`.kl_soap_math`; this module is the
``torch.optim.Optimizer`` around it.

* Matrices of equal shape and step count are processed as one batch. State lives in stacked
  tensors (:class:`~.packing.StatePacker`), the same for both factor updates; per step the
  full-size transients are the stacked gradient and three matmul workspaces per matrix in the
  batch (``Q_Lᵀ G``, ``G Q_R`` and ``Q_Lᵀ G Q_R``; two with Shampoo factors, which need no
  ``Q_Lᵀ G Q_R``; Adam in the eigenbasis reuses two of them), plus ``k×k`` refresh workspaces
  per side (the sorted basis, the sorted product and the QR's reflectors).
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

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from .kl_soap_math import (
    COLUMN_MAJOR_KEYS,
    STALE_REFRESH_EVERY,
    STATE_KEYS,
    KLSoapConfig,
    KLSoapMatrices,
    kl_soap_direction,
)
from .options import FactorUpdate, InverseRoot, RefreshMode, TPMode
from .orthogonalized import default_max_batch_numel
from .packing import StatePacker
from .tensor_parallel import (
    ShardSplit,
    TPShardInfo,
    check_tp_mode,
    gather_shards,
    own_shard,
)
from .validation import check_range

__all__ = ["KLSoap"]


class KLSoap(torch.optim.Optimizer):
    """KL-SOAP for 2-D weights and 3-D ``(E, m, n)`` expert stacks (each expert its own matrix).

    Args:
        params: parameters (2-D or 3-D) or parameter-group dicts.
        lr: learning rate η.
        betas: Adam's (β1, β2) in the eigenbasis.
        factor_update: ``kl`` (default): KL-Shampoo factors, ``L ← β_s·L + (1 − β_s)/n·G S_R^(−p)
            Gᵀ`` and ``R ← β_s·R + (1 − β_s)/m·Gᵀ S_L^(−p) G`` (``m×m`` and ``n×n`` for an
            ``m×n`` G); ``shampoo``: SOAP's ``L ← β_s·L + (1 − β_s)·G Gᵀ``,
            ``R ← β_s·R + (1 − β_s)·Gᵀ G``, which read neither ``factor_eps``, ``factor_exponent``
            nor ``inverse_root`` (those must then keep their defaults). Either way the factors
            include the current gradient before the refresh.
        shampoo_beta: weight β_s of the *old* factor in the EMA of L and R (SOAP's convention:
            ``L ← β_s·L + (1 − β_s)·new``).
        correct_shampoo_beta_bias: bias-correct that EMA (``β_t = 1 − (1 − β_s)/(1 − β_sᵗ)``),
            as Emerging-Optimizers does by default.
        eps: Adam's ε.
        factor_eps: ε in ``(λ + ε)^(−p)`` (absolute, in the units of the factors).
        factor_exponent: p (1 for KL-Shampoo).
        weight_decay: decoupled weight decay λ.
        refresh_every: refresh period F in steps (default 1; 10 with ``stale_refresh``).
        refresh_mode: ``qr``, ``eigh`` or ``cholesky_qr2``.
        inverse_root: ``eigenbasis`` or ``newton_schulz`` (see :mod:`.kl_soap_math`).
        root_iters: most Newton–Schulz iterations for ``inverse_root="newton_schulz"`` (p = 1
            stops once converged; other roots run all of them).
        root_damping: their damping relative to the factor's Frobenius norm (see
            :mod:`.kl_soap_math`).
        stale_refresh: ablation: reference SOAP's stale refresh (see :mod:`.kl_soap_math`).
        tp_mode: for parameters in ``tp_shards``: ``duplicated`` (default; TP=1 update, full
            state on every TP rank) or ``blockwise`` (each shard its own matrix).
        tp_shards: tensor-parallel shards among ``params`` and their
            :class:`~megatron_ext.optimizers.tensor_parallel.TPShardInfo`.
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
        factor_update: FactorUpdate = "kl",
        shampoo_beta: float = 0.95,
        correct_shampoo_beta_bias: bool = True,
        eps: float = 1e-8,
        factor_eps: float = 1e-8,
        factor_exponent: float = 1.0,
        weight_decay: float = 0.0,
        refresh_every: int | None = None,
        refresh_mode: RefreshMode = "qr",
        inverse_root: InverseRoot = "eigenbasis",
        root_iters: int = 25,
        root_damping: float = 1e-4,
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
            factor_update=factor_update,
            shampoo_beta=shampoo_beta,
            correct_shampoo_beta_bias=correct_shampoo_beta_bias,
            eps=eps,
            factor_eps=factor_eps,
            factor_exponent=factor_exponent,
            weight_decay=weight_decay,
            refresh_every=refresh_every,
            refresh_mode=refresh_mode,
            inverse_root=inverse_root,
            root_iters=root_iters,
            root_damping=root_damping,
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
            factor_update=group["factor_update"],
            betas=tuple(group["betas"]),
            shampoo_beta=group["shampoo_beta"],
            correct_shampoo_beta_bias=group["correct_shampoo_beta_bias"],
            eps=group["eps"],
            factor_eps=group["factor_eps"],
            factor_exponent=group["factor_exponent"],
            refresh_every=group["refresh_every"],
            refresh_mode=group["refresh_mode"],
            inverse_root=group["inverse_root"],
            root_iters=group["root_iters"],
            root_damping=group["root_damping"],
            stale_refresh=group["stale_refresh"],
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict installs the saved groups through here: groups saved before
        # factor_update existed held KL-Shampoo factors
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("factor_update", "kl")

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
            "factor_basis_l": (m, m),
            "factor_basis_r": (n, n),
            "basis_l": (m, m),
            "basis_r": (n, n),
        }
        packed = {
            key: self._packer.pack(
                self.state, params, key, shapes[key], column_major=key in COLUMN_MAJOR_KEYS
            )
            for key in STATE_KEYS
        }
        local = params[0].shape[-2:]
        grads = torch.cat([_grad(p).reshape(-1, *local) for p in params]).to(torch.float32)
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


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p.grad``: the step batches only parameters that have one (the others are skipped)."""
    if p.grad is None:
        raise RuntimeError("KLSoap: a parameter without a gradient reached the batched step")
    return p.grad
