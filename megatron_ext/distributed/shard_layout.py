"""Where each element of an element-sharded (ZeRO-1) parameter set lives: the flat buckets of
:mod:`.sharded_adam` and each data-parallel rank's contiguous range in them.

Parameters are laid out in forward order, one dtype per bucket, in buckets of at most
``bucket_numel`` elements (a larger parameter gets a bucket of its own), like the layer-wise
optimizer's. Each bucket is one flat index space split evenly over the ``world`` ranks of the
data-parallel group: rank ``r`` holds elements ``[r·n // world, (r+1)·n // world)`` of a bucket
of ``n`` elements (no padding: when ``world`` does not divide ``n``, the later ranks hold one
element more). A parameter may therefore be split between neighbouring ranks; each rank keeps
fp32 masters and optimizer state for its range only. megatron-core's DistributedOptimizer
splits its gradient buckets the same way (it pads each bucket to a multiple of the
data-parallel size instead).

The buckets are :class:`~.plan.BucketLayout` objects (members, elements per rank, dtype), so
the wire bytes of the gradient reduce-scatter and the parameter all-gather are counted by the
same functions as the layer-wise optimizer's.

Torch-free: the planner (:mod:`megatron_ext.planner`) uses it as the optimizer does.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from megatron_ext.distributed.plan import BucketLayout

__all__ = ["even_counts", "piece_ranges", "rank_range", "rectangles", "shard_buckets"]


def even_counts(numel: int, world: int) -> tuple[int, ...]:
    """Elements per rank of a bucket of ``numel`` elements split evenly over ``world`` ranks."""
    return tuple((r + 1) * numel // world - r * numel // world for r in range(world))


def shard_buckets(
    params: Sequence[tuple[str, int, str]],
    world: int,
    bucket_numel: int,
    alone: Collection[str] = (),
) -> list[BucketLayout]:
    """The buckets of ``params`` — ``(name, numel, dtype)`` in forward order — each split over
    ``world`` ranks (:func:`even_counts`). A name in ``alone`` gets a bucket of its own, so
    its ranges depend on its size only (a tied embedding's copies on the first and last
    pipeline stage then split alike, as megatron-core's DDP buckets them)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    groups: list[list[tuple[str, int, str]]] = [[]]
    size = 0
    for name, numel, dtype in params:
        current = groups[-1]
        apart = name in alone or (current and current[-1][0] in alone)
        if current and (size + numel > bucket_numel or current[-1][2] != dtype or apart):
            groups.append([])
            size = 0
        groups[-1].append((name, numel, dtype))
        size += numel
    return [
        BucketLayout(
            tuple(n for n, _, _ in g), even_counts(sum(k for _, k, _ in g), world), g[0][2]
        )
        for g in groups
        if g
    ]


def rank_range(bucket: BucketLayout, rank: int) -> tuple[int, int]:
    """``[start, end)`` of ``rank``'s elements in the bucket's flat index space."""
    start = sum(bucket.counts[:rank])
    return start, start + bucket.counts[rank]


def piece_ranges(
    bucket: BucketLayout, numels: Sequence[int], rank: int
) -> list[tuple[int, int, int]]:
    """Per member (``numels[i]`` elements each, the bucket's order): ``(lo, hi, offset)``:
    the elements ``[lo, hi)`` of the flattened parameter that ``rank`` holds (``lo == hi``:
    none) and where ``lo`` sits in the bucket."""
    start, end = rank_range(bucket, rank)
    out = []
    offset = 0
    for numel in numels:
        lo = min(max(start - offset, 0), numel)
        hi = max(min(end - offset, numel), lo)
        out.append((lo, hi, offset + lo))
        offset += numel
    return out


def rectangles(
    shape: Sequence[int], lo: int, hi: int
) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """The flat range ``[lo, hi)`` of a row-major tensor of ``shape`` as a few blocks
    ``(offset, block shape)``, in flat order, each contiguous in the flattened tensor (at most
    ``2·(ndim − 1) + 1``): a checkpoint can then name a rank's range by the tensor's own shape
    and coordinates, which any other split of the same tensor reads back."""
    if lo >= hi:
        return []
    if len(shape) <= 1:
        return [((lo,), (hi - lo,))]
    inner = 1
    for size in shape[1:]:
        inner *= size
    first, last = lo // inner, (hi - 1) // inner

    def within(index: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        return [((index, *o), (1, *s)) for o, s in rectangles(shape[1:], a, b)]

    if first == last:
        return within(first, lo - first * inner, hi - first * inner)
    out = []
    full_from = first
    if lo % inner:
        out += within(first, lo % inner, inner)
        full_from = first + 1
    full_to = last + 1 if hi % inner == 0 else last
    if full_to > full_from:
        out.append(((full_from, *[0] * (len(shape) - 1)), (full_to - full_from, *shape[1:])))
    if hi % inner:
        out += within(last, 0, hi % inner)
    return out
