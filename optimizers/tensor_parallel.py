"""Tensor-parallel modes of the matrix optimizers: what "the matrix" is when a rank holds a shard.

Under tensor parallelism (TP) each rank of a TP group holds a shard of a weight, split along the
parameter's ``partition_dim`` (megatron-core: 0 for ColumnParallelLinear weights such as
``linear_qkv``/``linear_fc1``, 1 for RowParallelLinear weights ``linear_proj``/``linear_fc2``).
An elementwise optimizer does not care; a matrix optimizer does. Three modes (:data:`TPMode`):

* ``blockwise`` — each shard is a matrix of its own (orthogonalised alone, scaled with the
  shard's shape). No communication, but **not** the TP=1 algorithm: the polar factor of a block
  is not a block of the polar factor, so results change with the TP size.
* ``duplicated`` — the shards of a stacked batch are all-gathered (one ``all_gather`` per
  batch) into the full matrices, every rank runs the unchanged single-matrix path on them
  (normalisation, orientation and scale from the full shape) and keeps its own slice. The TP=1
  update, bit for bit where the batches are the same; the full matrix's work on every rank.
* ``distributed`` (Muon only) — the full matrix is never formed. The batch is turned so that
  the split runs along its columns, ``X = [X_1 … X_t]``; then ``X Xᵀ = Σ_r X_r X_rᵀ``, so
  every Newton–Schulz Gram product is an all-reduce of per-shard products, and every other
  product is a left-multiplication by a replicated matrix, which acts on each column block
  alone (:func:`~megatron_ext.optimizers.ns_iteration.newton_schulz_iterate`). The Frobenius
  norm comes from an all-reduced sum of squares; the scale uses the full shape. The TP=1 update
  up to rounding (the Grams are summed in another order).

Costs per rank for a full ``M×N`` matrix (M ≤ N) over t ranks, K NS steps, counting full
products (2 flops per multiply-add; the symmetric ones cost 3/4 of that), words communicated:

* ``duplicated``: one all-gather of ``MN`` words (``(t−1)/t·MN`` received) per optimizer step;
  the TP=1 flops (plain NS ``K(4M²N + 2M³)``) and a full-size ``M×N`` transient on every rank.
* ``distributed``, split along N (the long side; the usual case): per plain NS step
  ``4M²N/t + 2M³`` flops and one all-reduce of ``M²`` words; Gram NS (chosen, as at TP=1, when
  N > ~1.5M) all-reduces only its Gram matrices — ``R`` and one per restart, 2 by default —
  and its ``(8K−6)M³`` m×m flops are replicated. Memory: the shard and m×m workspaces.
* ``distributed``, split along M (the short side): the column-split orientation is ``N×(M/t)``,
  whose Gram is the N×N matrix ``XᵀX = Σ_r X_rᵀX_r``: per step ``4MN²/t + 2N³`` flops (plain
  NS) and ``N²`` words. That is more work than ``duplicated`` whenever N ≫ M/t, so prefer
  ``duplicated`` for matrices split along their short side.

Which side is split, for megatron-core's weights: fc1 and QKV are column-parallel and tall
(split along rows = long side); fc2 is row-parallel and wide (columns = long side);
``linear_proj`` is square. The short side is split for K and V under GQA with ``qkv_layout``
(``kv_rows < hidden``) and for narrow experts (``ffn < hidden`` with expert TP).

**What "the full matrix" is: the TP=1 weight.** The shards concatenated along
``partition_dim`` in rank order give it for plain column/row-parallel weights, and for the fused
``linear_qkv`` too: its layout keeps query groups outermost, so rank r holds whole groups
``[rG/t, (r+1)G/t)``, i.e. contiguous rows (with ``qkv_layout``, the *per-rank* layout, each of
Q, K and V is a row-split matrix whose concatenation is the TP=1 block). For SwiGLU's
``linear_fc1`` it is not: TP=1 stores ``[gate; up]`` while rank r holds ``[gate_r; up_r]``, so
the rank-order concatenation is a row permutation of the TP=1 weight. megatron-core marks such
weights with ``partition_stride=2`` (:class:`TPShardInfo`), and :func:`gather_shards` uses it to
assemble the TP=1 layout. That matters: NS and the polar factor are row-permutation-equivariant
(``polar(PX) = P·polar(X)``), but KL-SOAP in practice is not — on a rectangular matrix its early
factors are rank-deficient, the eigenbasis inside their null space is whatever the solver
returns, the QR refresh carries that choice forward and Adam's elementwise normalisation is not
rotation-invariant, so a permuted run differs by O(1) even in float64 (see
tests/test_tensor_parallel.py). ``distributed`` needs no reordering: the Gram sums over the
split dimension and the updates act on each column, so the order along the split is immaterial.

The process groups come in as arguments (:class:`TPShardInfo`); which parameters are shards
is read from megatron-core's attributes by
:func:`megatron_ext.distributed.tensor_parallel.shard_infos_from_attributes`.

All TP ranks of a group must step the same parameters (same shapes, same order, gradients
present on all or none), since every stacked batch is one collective.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import get_args

import torch
import torch.distributed as dist

from .options import TPMode

__all__ = [
    "TP_MODES",
    "DistributedIteration",
    "ShardSplit",
    "TPShardInfo",
    "check_tp_mode",
    "gather_shards",
    "orthogonalize_distributed",
    "orthogonalize_duplicated",
    "own_shard",
]

TP_MODES: tuple[str, ...] = get_args(TPMode)

#: ``(work, gram_reduce, full_shape) -> result``: the Newton–Schulz steps on a normalised
#: ``(B, m, n_local)`` batch of column blocks whose full matrices are ``full_shape = (m, N)``;
#: ``gram_reduce`` sums a ``(B, m, m)`` Gram over the blocks in place.
DistributedIteration = Callable[
    [torch.Tensor, Callable[[torch.Tensor], None], tuple[int, int]], torch.Tensor
]


def check_tp_mode(mode: object, supported: Iterable[str], owner: str) -> None:
    """Raise ``ValueError`` for an unknown mode (listing all) or one ``owner`` does not support."""
    if mode not in TP_MODES:
        raise ValueError(f"tp_mode={mode!r} is not valid; choose one of {list(TP_MODES)}")
    supported = list(supported)
    if mode not in supported:
        raise ValueError(
            f"{owner} does not support tp_mode={mode!r}; it supports {supported} "
            "(use tp_mode='duplicated' for the TP=1 update)"
        )


@dataclass(frozen=True)
class TPShardInfo:
    """Where a parameter's tensor-parallel shard sits.

    Attributes:
        partition_dim: dimension of the *parameter* that is split (megatron-core's attribute:
            0 or 1 for a 2-D weight; 1 or 2 for an ``(E, m, n)`` expert stack, whose dim 0 is
            never split).
        group: the TP process group (None: the default group).
        world_size: ranks in ``group``; shards are equal-sized.
        rank: this rank's index in ``group``.
        partition_stride: megatron-core's attribute: the TP=1 weight is ``partition_stride``
            equal blocks along ``partition_dim``, each split over the ranks in rank order, and
            a shard is its part of every block, in block order (2 for SwiGLU's fc1).
    """

    partition_dim: int
    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    partition_stride: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a TP group of {self.world_size}")
        if self.partition_stride < 1:
            raise ValueError(f"partition_stride must be ≥ 1, got {self.partition_stride}")

    @classmethod
    def of_group(
        cls, partition_dim: int, group: dist.ProcessGroup | None = None, partition_stride: int = 1
    ) -> TPShardInfo:
        """Info for this process in ``group`` (must be initialised)."""
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        return cls(partition_dim, group, world, rank, partition_stride)

    def matrix_axis(self, shape: Sequence[int]) -> int:
        """0 if the split runs along the rows of each matrix of a shard of ``shape``, 1 along
        its columns; ``ValueError`` if this info does not fit the shape."""
        ndim = len(shape)
        axis = self.partition_dim - (ndim - 2)
        if ndim not in (2, 3) or axis not in (0, 1):
            raise ValueError(
                f"partition_dim={self.partition_dim} does not split the matrices of a "
                f"{ndim}-D parameter; expected one of {[ndim - 2, ndim - 1]}"
            )
        if shape[self.partition_dim] % self.partition_stride:
            raise ValueError(
                f"a shard of shape {tuple(shape)} cannot hold partition_stride="
                f"{self.partition_stride} equal blocks along dim {self.partition_dim}"
            )
        return axis


@dataclass(frozen=True)
class ShardSplit:
    """How a stacked ``(B, m, n)`` batch of shards splits: along ``axis`` (-2 rows, -1 columns)
    into ``world_size`` shards over ``group``, this rank holding shard ``rank``; with
    ``stride`` > 1 each full matrix is ``stride`` blocks along ``axis``, each split over the
    ranks (:class:`TPShardInfo`).

    Hashable by value (the group by identity): batches of different parameters that split the
    same way over the same group are stacked and share their collectives.
    """

    axis: int
    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    stride: int = 1

    @classmethod
    def of(cls, info: TPShardInfo, batch_axis: int) -> ShardSplit:
        """Split of a batch whose dimension ``batch_axis`` (0 rows, 1 columns) is ``info``'s."""
        axis = -2 if batch_axis == 0 else -1
        return cls(axis, info.group, info.world_size, info.rank, info.partition_stride)

    def full_shape(self, m: int, n: int) -> tuple[int, int]:
        """Shape of the full matrices of a batch of ``m×n`` shards."""
        return (m * self.world_size, n) if self.axis == -2 else (m, n * self.world_size)

    def all_reduce_(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the group in place (half precision is summed in fp32)."""
        if t.dtype in (torch.float16, torch.bfloat16):
            wide = t.float()
            dist.all_reduce(wide, group=self.group)
            t.copy_(wide)
        else:
            dist.all_reduce(t, group=self.group)


def gather_shards(x: torch.Tensor, split: ShardSplit) -> torch.Tensor:
    """All-gather a ``(B, m, n)`` batch of shards into its ``(B, M, N)`` full matrices.

    One collective for the whole batch. The shards are put together in the TP=1 layout: in rank
    order along the split, block by block when ``split.stride`` > 1.
    """
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(split.world_size)]
    dist.all_gather(parts, x, group=split.group)
    if split.stride == 1:
        return torch.cat(parts, dim=split.axis)
    blocks = [part.chunk(split.stride, dim=split.axis) for part in parts]
    ordered = [blocks[r][b] for b in range(split.stride) for r in range(split.world_size)]
    return torch.cat(ordered, dim=split.axis)


def own_shard(full: torch.Tensor, split: ShardSplit) -> torch.Tensor:
    """This rank's ``(B, m, n)`` shard of ``(B, M, N)`` full matrices in the TP=1 layout (a
    contiguous copy); the inverse of :func:`gather_shards`."""
    blocks = full.chunk(split.stride, dim=split.axis)
    size = blocks[0].shape[split.axis] // split.world_size
    mine = [block.narrow(split.axis, split.rank * size, size) for block in blocks]
    return torch.cat(mine, dim=split.axis) if len(mine) > 1 else mine[0].contiguous()


def orthogonalize_duplicated(
    x: torch.Tensor,
    split: ShardSplit,
    orthogonalize: Callable[[torch.Tensor], torch.Tensor],
    orientation: str = "wide",
    flipped: bool = False,
) -> torch.Tensor:
    """``duplicated`` mode: gather, orthogonalise the full matrices, keep this rank's block.

    Args:
        x: ``(B, m, n)`` fp32 batch of this rank's shards (any orientation).
        split: how the batch splits.
        orthogonalize: the single-matrix hook, ``(B, M', N') -> (B, M', N')``.
        orientation: how the hook receives the full matrices (transposed here if needed):
            ``wide`` with M' ≤ N'; ``parameter`` as the parameters hold them, which is how a
            single process hands them to a hook that takes tall batches too (so the result is
            that process's, bit for bit).
        flipped: the batch holds the parameters' transposes.

    Returns:
        ``(B, m, n)`` this rank's block of the full matrices' orthogonalisation.
    """
    full = gather_shards(x, split)
    if orientation == "parameter":
        transpose = flipped
    elif orientation == "wide":
        transpose = full.shape[-2] > full.shape[-1]
    else:
        raise ValueError(f"orientation must be 'wide' or 'parameter', got {orientation!r}")
    out = orthogonalize(full.mT.contiguous()).mT if transpose else orthogonalize(full)
    return own_shard(out, split)


def orthogonalize_distributed(
    x: torch.Tensor,
    axis: int,
    world_size: int,
    all_reduce: Callable[[torch.Tensor], None],
    iterate: DistributedIteration,
    eps: float = 1e-7,
) -> torch.Tensor:
    """``distributed`` mode: Newton–Schulz on shards, with all-reduced Gram products.

    The batch is turned so that the split runs along columns (``(B, m, n_local)`` blocks of
    ``(B, m, N)`` matrices, ``N = n_local·world_size``); each matrix is divided by
    ``max(‖X‖_F, eps)`` with ``‖X‖_F²`` summed over the shards; ``iterate`` runs the steps
    with ``all_reduce`` as its Gram reduction (the module docstring says which Gram that is and
    what it costs). Collectives per batch: one for the B norms, one per Gram formed. The order
    of the shards along the split (rank order, strides) does not matter here.

    Args:
        x: ``(B, m, n)`` batch of this rank's shards, split along ``axis`` (-2 or -1); its
            dtype is kept (fp32 from the optimizers; float64 in the algebra tests).
        axis: the split dimension of ``x``.
        world_size: number of shards of each full matrix.
        all_reduce: in-place sum over the shards' ranks.
        iterate: the NS steps (:data:`DistributedIteration`).
        eps: floor of the full Frobenius norm.

    Returns:
        ``(B, m, n)`` this rank's block of the full matrices' NS orthogonalisation.
    """
    work = x.mT.contiguous() if axis == -2 else x.contiguous()
    squares = work.square().sum(dim=(-2, -1))
    all_reduce(squares)
    work.div_(squares.sqrt_().clamp_min_(eps)[:, None, None])
    full_shape = (work.shape[-2], work.shape[-1] * world_size)
    out = iterate(work, all_reduce, full_shape)
    return out.mT.contiguous() if axis == -2 else out
