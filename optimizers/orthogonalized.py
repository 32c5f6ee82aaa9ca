"""Base class of the momentum-orthogonalising optimizers (Muon, MOP).

:meth:`OrthogonalizedOptimizer.step` is fixed; subclasses override one hook,
:meth:`~OrthogonalizedOptimizer.orthogonalize`, which maps a ``(B, m, n)`` batch of momenta
(m ≤ n) to their (approximate) polar factors. Per step and parameter group:

1. decoupled weight decay ``W ← (1 − ηλ)W`` and EMA momentum ``M ← βM + (1 − β)G``;
2. every parameter is cut into matrices: a 2-D weight is one matrix, a 3-D ``(E, m, n)`` stack of
   experts is E matrices, a fused QKV weight (group option ``qkv_layout``) is Q, K and V;
3. matrices of the same shape (after turning each to rows ≤ columns) are stacked and
   orthogonalised in one batched call — one copy of each momentum, nothing else full-size;
4. ``W ← W − η·s·O`` with the per-matrix scale ``s`` of :func:`update_scale`, whose extra
   factor is ``extra_scale_factor`` (group option ``rms_match="constant"``) or
   ``extra_scale_factor·√((1 − β)/(1 + β))`` (``rms_match="beta"``,
   :func:`~.muon_spec.momentum_rms_factor`).

Tensor parallelism: parameters listed in ``tp_shards`` (a :class:`TPShardInfo` per shard) are
orthogonalised according to their group's ``tp_mode`` (see
:mod:`.tensor_parallel`): ``blockwise`` treats each shard as its own
matrix; ``duplicated`` (and ``distributed``, where a subclass supports it) gives the TP=1 update,
with the scale from the full matrix's shape. Shards that split the same way are still stacked,
one collective per stacked batch.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from .muon_spec import momentum_rms_factor
from .options import RMSMatch, ScaleMode
from .qkv import QKVLayout, qkv_views
from .tensor_parallel import (
    DistributedIteration,
    ShardSplit,
    TPShardInfo,
    check_tp_mode,
    orthogonalize_distributed,
    orthogonalize_duplicated,
)
from .validation import check_choice, check_range

__all__ = [
    "MatrixSlot",
    "OrthogonalizedOptimizer",
    "default_max_batch_numel",
    "matrix_slots",
    "update_scale",
]


def default_max_batch_numel(device: torch.device) -> int:
    """Elements of one stacked batch: shape groups are cut into batches of at most this size.

    On GPUs a large batch (2^26 elements, 256 MiB in fp32) keeps the device busy while bounding
    transient memory. On CPUs small batches (2^20 elements, 4 MiB) are faster: the m×m
    intermediates of a batch then stay in cache, and buffers under glibc's 32 MiB mmap threshold
    are reused instead of being page-faulted in afresh on every call (measured 0.66 s vs 0.75 s
    for 128 matrices of 256×512 on 2 cores).
    """
    return 1 << 20 if device.type == "cpu" else 1 << 26


def update_scale(rows: int, cols: int, mode: ScaleMode, extra: float = 1.0) -> float:
    """Factor multiplying the orthogonalised ``rows×cols`` update.

    * ``spectral``: ``√max(rows, cols)``. An orthogonal factor has RMS ``1/√max(rows, cols)``,
      so the scaled update has RMS 1; ``extra=0.2`` gives AdamW's typical update RMS of 0.2
      (Liu et al., "Muon is Scalable for LLM Training", 2025).
    * ``shape``: ``√max(1, rows/cols)`` (Keller Jordan's original Muon).
    * ``unit_rms``: ``√(rows/cols)``: the update has unit RMS→RMS operator norm, i.e. it maps
      unit-RMS inputs to unit-RMS outputs (Bernstein & Newhouse; Pethick et al., Scion).
    """
    if mode == "spectral":
        base = math.sqrt(max(rows, cols))
    elif mode == "shape":
        base = math.sqrt(max(1.0, rows / cols))
    elif mode == "unit_rms":
        base = math.sqrt(rows / cols)
    else:
        check_choice("scale_mode", mode, ScaleMode)
        raise AssertionError("unreachable")
    return base * extra


@dataclass(frozen=True)
class MatrixSlot:
    """One matrix of a parameter: where its momentum is read and its update written.

    ``source`` and ``target`` are views of the same shape ``(*lead, cols)`` whose row-major
    flattening to ``(rows, cols)`` is the logical matrix (``lead`` is ``(rows,)`` for a plain
    matrix and ``(groups, rows_per_group)`` for a Q, K or V block of a fused QKV weight).
    """

    source: torch.Tensor
    target: torch.Tensor
    rows: int
    cols: int

    @property
    def transposed(self) -> bool:
        """Processed as its transpose so that rows ≤ columns."""
        return self.rows > self.cols

    @property
    def batch_shape(self) -> tuple[int, int]:
        """Shape of this matrix inside the stacked batch."""
        return (min(self.rows, self.cols), max(self.rows, self.cols))

    def load_into(self, dst: torch.Tensor, native: bool = False) -> None:
        """Copy the source matrix into ``dst`` (contiguous, :attr:`batch_shape`; with
        ``native``, ``(rows, cols)``: never transposed)."""
        lead = self.source.shape[:-1]
        if self.transposed and not native:
            dst.view(self.cols, *lead).copy_(self.source.movedim(-1, 0))
        else:
            dst.view(self.source.shape).copy_(self.source)

    def add_to_target(self, update: torch.Tensor, alpha: float, native: bool = False) -> None:
        """``target += alpha · update`` for ``update`` laid out as in :meth:`load_into`."""
        lead = self.target.shape[:-1]
        if self.transposed and not native:
            update = update.view(self.cols, *lead).movedim(0, -1)
        else:
            update = update.view(self.target.shape)
        self.target.add_(update, alpha=alpha)


def matrix_slots(
    source: torch.Tensor, target: torch.Tensor, qkv_layout: QKVLayout | None = None
) -> list[MatrixSlot]:
    """The matrices of one parameter: itself (2-D), one per expert (3-D) or Q, K, V (fused)."""
    if source.ndim == 3:
        return [
            MatrixSlot(s, t, s.shape[0], s.shape[1]) for s, t in zip(source, target, strict=True)
        ]
    if source.ndim != 2:
        raise ValueError(f"matrix optimizers take 2-D or 3-D parameters, got {tuple(source.shape)}")
    if qkv_layout is None:
        return [MatrixSlot(source, target, source.shape[0], source.shape[1])]
    slots = []
    for s, t in zip(qkv_views(source, qkv_layout), qkv_views(target, qkv_layout), strict=True):
        slots.append(MatrixSlot(s, t, s.shape[0] * s.shape[1], s.shape[2]))
    return slots


def full_matrix_shape(slot: MatrixSlot, split: ShardSplit | None) -> tuple[int, int]:
    """``(rows, cols)`` of the matrix whose shard ``slot`` is (itself if ``split`` is None)."""
    if split is None:
        return slot.rows, slot.cols
    batch_axis = 0 if split.axis == -2 else 1
    if batch_axis ^ int(slot.transposed) == 0:
        return slot.rows * split.world_size, slot.cols
    return slot.rows, slot.cols * split.world_size


def batched(slots: list[MatrixSlot], max_numel: int) -> Iterator[list[MatrixSlot]]:
    """Cut a list of same-shape slots into batches of at most ``max_numel`` elements."""
    m, n = slots[0].batch_shape
    size = max(1, max_numel // (m * n))
    for start in range(0, len(slots), size):
        yield slots[start : start + size]


class OrthogonalizedOptimizer(torch.optim.Optimizer):
    """Momentum, then a batched orthogonalisation hook, then a scaled decoupled update.

    Parameter-group options (all keyword-only in the subclasses): ``lr``, ``momentum`` (β of the
    EMA), ``nesterov``, ``weight_decay`` (λ of ``W ← (1 − ηλ)W``), ``scale_mode``,
    ``extra_scale_factor``, ``rms_match`` (``constant``: the extra factor is
    ``extra_scale_factor``; ``beta``: times √((1 − β)/(1 + β))), ``qkv_layout`` (a
    :class:`~.qkv.QKVLayout` for groups holding fused QKV weights, else None; under TP the layout
    of the shard), ``tp_mode``.

    ``tp_shards`` maps tensor-parallel shards among the parameters to their
    :class:`TPShardInfo`; parameters not in it (or with a TP world size of 1) are whole matrices.
    """

    #: ``tp_mode`` values this optimizer implements (``distributed`` needs
    #: :meth:`distributed_iteration`).
    supported_tp_modes: ClassVar[tuple[str, ...]] = ("blockwise", "duplicated")
    #: Whether :meth:`orthogonalize` takes tall batches (m > n) as they are: whole matrices with
    #: more rows than columns are then stacked untransposed (no transposing copy in or out).
    takes_tall_batches: ClassVar[bool] = False

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        defaults: dict[str, Any],
        *,
        max_batch_numel: int | None = None,
        tp_shards: Mapping[torch.Tensor, TPShardInfo] | None = None,
    ) -> None:
        if max_batch_numel is not None:
            check_range("max_batch_numel", max_batch_numel, low=1)
        self.max_batch_numel = max_batch_numel
        self.tp_shards = {p: i for p, i in (tp_shards or {}).items() if i.world_size > 1}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        self._validate_group(group)
        for p in group["params"]:
            if p.ndim not in (2, 3):
                raise ValueError(
                    f"{type(self).__name__} takes 2-D matrices or 3-D expert stacks, got a "
                    f"parameter of shape {tuple(p.shape)}; route it to AdamW "
                    "(see megatron_ext.optimizers.routing)"
                )
            layout = group["qkv_layout"]
            if layout is not None and (p.ndim != 2 or p.shape[0] != layout.rows):
                raise ValueError(f"parameter of shape {tuple(p.shape)} does not match {layout}")
            info = self.tp_shards.get(p)
            axis = None if info is None else info.matrix_axis(p.shape)  # validates
            if layout is not None and info is not None and (axis, info.partition_stride) != (0, 1):
                raise ValueError(
                    "a fused QKV weight under tensor parallelism is split along its rows into "
                    "whole query groups (partition_dim=0, partition_stride=1), got "
                    f"partition_dim={info.partition_dim}, partition_stride={info.partition_stride}"
                )

    def _validate_group(self, group: dict[str, Any]) -> None:
        """Check a group's hyperparameters; subclasses extend it for their own keys."""
        check_range("lr", group["lr"], low=0.0)
        check_range("momentum", group["momentum"], low=0.0, high=1.0, high_open=True)
        check_range("weight_decay", group["weight_decay"], low=0.0)
        check_range("extra_scale_factor", group["extra_scale_factor"], low=0.0, low_open=True)
        check_choice("scale_mode", group["scale_mode"], ScaleMode)
        check_choice("rms_match", group["rms_match"], RMSMatch)
        if not isinstance(group["nesterov"], bool):
            raise ValueError(f"nesterov must be a bool, got {group['nesterov']!r}")
        layout = group["qkv_layout"]
        if layout is not None and not isinstance(layout, QKVLayout):
            raise ValueError(f"qkv_layout must be a QKVLayout or None, got {layout!r}")
        check_tp_mode(group["tp_mode"], self.supported_tp_modes, type(self).__name__)

    def __setstate__(self, state: dict[str, Any]) -> None:
        # torch's load_state_dict installs the saved groups through here: groups saved before
        # rms_match existed scaled by extra_scale_factor alone
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("rms_match", "constant")

    def orthogonalize(self, x: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        """Polar factor (approximate) of each matrix of the ``(B, m, n)`` fp32 batch, m ≤ n
        (m > n too where :attr:`takes_tall_batches`).

        ``x`` is a private copy of the momenta, which the hook may overwrite.
        """
        raise NotImplementedError

    def distributed_iteration(self, group: dict[str, Any]) -> DistributedIteration:
        """The iteration for ``tp_mode="distributed"`` (see
        :func:`~.tensor_parallel.orthogonalize_distributed`)."""
        raise NotImplementedError(f"{type(self).__name__} has no distributed TP mode")

    def _split(self, slot: MatrixSlot, p: torch.Tensor, group: dict[str, Any]) -> ShardSplit | None:
        """How ``slot``'s batch splits over TP; None for whole matrices and ``blockwise``."""
        info = self.tp_shards.get(p)
        if info is None or group["tp_mode"] == "blockwise":
            return None
        # Split along the slot's rows or columns, and in the batch the slot may be transposed.
        return ShardSplit.of(info, info.matrix_axis(p.shape) ^ int(slot.transposed))

    def _orthogonalize_shards(
        self, x: torch.Tensor, group: dict[str, Any], split: ShardSplit, flipped: bool
    ) -> torch.Tensor:
        """This rank's block of the orthogonalised full matrices of a ``(B, m, n)`` shard batch
        (``flipped``: the batch holds the parameters' transposes)."""
        if group["tp_mode"] == "duplicated":
            # The full matrices go to the hook as a single process would give them.
            orientation = "parameter" if self.takes_tall_batches else "wide"
            return orthogonalize_duplicated(
                x, split, lambda full: self.orthogonalize(full, group), orientation, flipped
            )
        return orthogonalize_distributed(
            x, split.axis, split.world_size, split.all_reduce_, self.distributed_iteration(group)
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimisation step; ``closure`` re-evaluates the loss as in torch.optim."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            self._step_group(group)
        return loss

    def _step_group(self, group: dict[str, Any]) -> None:
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        buffers = []
        for p in params:
            state = self.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            buffers.append(state["momentum_buffer"])

        lr, beta = group["lr"], group["momentum"]
        extra = group["extra_scale_factor"]
        if group["rms_match"] == "beta":
            extra = extra * momentum_rms_factor(beta)
        if group["weight_decay"] != 0.0:  # W + (−ηλ)W: Emerging-Optimizers' rounding of (1 − ηλ)W
            torch._foreach_add_(params, params, alpha=-lr * group["weight_decay"])
        torch._foreach_lerp_(buffers, grads, 1.0 - beta)
        if group["nesterov"]:
            sources = [g.lerp(b, beta) for g, b in zip(grads, buffers, strict=True)]
        else:
            sources = buffers

        # Batches: same shape, and (TP shards) split the same way over the same group; whole
        # tall matrices stay untransposed where the orthogonalisation takes them so.
        by_batch: dict[tuple[tuple[int, int], ShardSplit | None, bool, bool], list[MatrixSlot]]
        by_batch = defaultdict(list)
        for p, source in zip(params, sources, strict=True):
            for slot in matrix_slots(source, p, group["qkv_layout"]):
                split = self._split(slot, p, group)
                native = self.takes_tall_batches and split is None and slot.transposed
                shape = (slot.rows, slot.cols) if native else slot.batch_shape
                # Shards of tall and wide matrices are gathered apart when the hook takes each
                # full matrix as the parameter holds it (see orthogonalize_duplicated).
                flipped = (
                    self.takes_tall_batches
                    and split is not None
                    and group["tp_mode"] == "duplicated"
                    and slot.transposed
                )
                by_batch[(shape, split, native, flipped)].append(slot)

        for ((m, n), split, native, flipped), slots in by_batch.items():
            device = slots[0].source.device
            limit = self.max_batch_numel or default_max_batch_numel(device)
            if split is not None and group["tp_mode"] == "duplicated":
                limit //= split.world_size  # the batch is gathered: count full matrices
            for chunk in batched(slots, limit):
                x = torch.empty(
                    len(chunk), m, n, dtype=torch.float32, device=chunk[0].source.device
                )
                for i, slot in enumerate(chunk):
                    slot.load_into(x[i], native)
                if split is None:
                    ortho = self.orthogonalize(x, group)
                else:
                    ortho = self._orthogonalize_shards(x, group, split, flipped)
                for i, slot in enumerate(chunk):
                    rows, cols = full_matrix_shape(slot, split)
                    scale = update_scale(rows, cols, group["scale_mode"], extra)
                    slot.add_to_target(ortho[i], alpha=-lr * scale, native=native)
