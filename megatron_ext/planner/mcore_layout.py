"""megatron-core 0.19's parameter-buffer layouts, re-implemented without torch.

Two of megatron-core's layouts of one flat parameter-and-gradient buffer (one
``BufferKey``: one dtype, dense or expert-parallel, layer-wise-managed or not), as functions of
``(name, numel)`` pairs in forward order:

- :func:`layerwise_layout`: ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout``
  (megatron/core/optimizer/layer_wise_optimizer.py) with its ``_shard_divisor``: parameters in
  backprop (reverse) order cut into chunks, a chunk closing once its elements reach
  ``max(bucket_size, int(dp·largest·0.9))`` (the ``PADDING_FLOOR`` rule); each chunk bin-packed
  by greedy LPT on element counts (largest first, onto the least-filled shard, the lowest on
  ties) into ``dp`` shards, each parameter whole at a 64-element aligned start; every shard of
  the bucket padded to the largest, rounded up to ``lcm(64, bucket_end_divisor/dp)``. A shared
  (tied, cross-stage) embedding closes the chunk before it and gets a bucket alone, in shard 0,
  with as much padding in every other shard. Rank ``r`` owns the parameters in the ``r``-th
  shard of each bucket (``_shard_params_from_layout``).
- :func:`distributed_optimizer_layout`: ``DistributedOptimizer._compute_per_buffer_param_layout``
  (megatron/core/optimizer/distrib_optimizer.py): the same reverse walk with 64-element aligned
  starts (``pad_param_start``), a bucket closing once its span reaches ``bucket_size``, its end
  padded to ``bucket_end_divisor`` (``pad_bucket_end``, megatron/core/optimizer/param_layout.py),
  a shared embedding closing the bucket before it and its own. ZeRO-1: rank ``r`` holds the
  ``r``-th of ``dp`` equal element ranges of each bucket (``_build_model_gbuf_range``), across
  parameter boundaries.

``tests/test_planner_baselines.py`` compares both with megatron-core's own functions on real
(meta-device) parameters. All figures are elements.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "PADDING_FLOOR",
    "PARAM_ALIGNMENT",
    "BufferLayout",
    "bucket_end_divisor",
    "default_bucket_size",
    "distributed_optimizer_layout",
    "layerwise_layout",
    "layerwise_shard_divisor",
]

PARAM_ALIGNMENT = 64  # elements: every parameter starts on a multiple (pad_param_start)
PADDING_FLOOR = 0.9  # layer-wise: a bucket grows until its elements reach 0.9·dp·largest param


def _round_up(value: int, divisor: int) -> int:
    """``value`` up to a multiple of ``divisor`` (megatron-core's ``pad_to_divisor``, in integer
    arithmetic: the same result for any buffer below 2**52 elements)."""
    return -(-value // divisor) * divisor


def bucket_end_divisor(dp_size: int, pad_buckets_for_high_nccl_busbw: bool = False) -> int:
    """Elements a bucket's size is a multiple of: ``lcm(dp, 128)``, and of 2**16 with
    ``pad_buckets_for_high_nccl_busbw`` (megatron-core's ``bucket_end_divisor``)."""
    if pad_buckets_for_high_nccl_busbw:
        return math.lcm(dp_size, 128, 2**16)
    return math.lcm(dp_size, 128)


def layerwise_shard_divisor(dp_size: int, pad_buckets_for_high_nccl_busbw: bool = False) -> int:
    """Elements a layer-wise shard is padded to a multiple of (``_shard_divisor``)."""
    per_shard = bucket_end_divisor(dp_size, pad_buckets_for_high_nccl_busbw) // dp_size
    return math.lcm(PARAM_ALIGNMENT, per_shard)


def default_bucket_size(dp_size: int) -> int:
    """megatron-core DDP's bucket size when ``ddp_config.bucket_size`` is None and
    ``overlap_grad_reduce`` is on: ``max(4e7, 1e6·dp)`` elements (without overlap, and on
    pipeline stages after the first, DDP uses one bucket: ``bucket_size=None``)."""
    return max(40_000_000, 1_000_000 * dp_size)


@dataclass(frozen=True)
class BufferLayout:
    """One flat parameter buffer as megatron-core lays it out (all figures in elements).

    ``index`` is megatron-core's ``param_index_map`` by name: ``(start, end, bucket)`` in the
    buffer. Bucket ``b`` spans ``bucket_indices[b]`` and is split into ``dp_size`` equal shards,
    shard ``r`` being rank ``r``'s."""

    dp_size: int
    index: Mapping[str, tuple[int, int, int]]
    bucket_indices: tuple[tuple[int, int], ...]
    bucket_numel_unpadded: tuple[int, ...]  # megatron-core's per_bucket_numel_unpadded

    @property
    def numel(self) -> int:
        """Elements of the buffer, padding included."""
        return self.bucket_indices[-1][1] if self.bucket_indices else 0

    @property
    def padding(self) -> int:
        """Elements of padding: the buffer less the parameters (megatron-core's total_padding)."""
        return self.numel - sum(end - start for start, end, _ in self.index.values())

    @property
    def shard_sizes(self) -> tuple[int, ...]:
        """Per bucket, the elements of each rank's (padded) shard."""
        return tuple((end - start) // self.dp_size for start, end in self.bucket_indices)

    def shard_range(self, bucket: int, rank: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s shard of ``bucket`` in the buffer."""
        start = self.bucket_indices[bucket][0]
        size = self.shard_sizes[bucket]
        return start + rank * size, start + (rank + 1) * size

    def shard_of(self, name: str) -> int:
        """The rank whose shard holds the first element of parameter ``name`` (the layer-wise
        optimizer's owner: ``(start − bucket start) // shard size``)."""
        start, _, bucket = self.index[name]
        return (start - self.bucket_indices[bucket][0]) // self.shard_sizes[bucket]

    def held(self, rank: int) -> dict[str, int]:
        """Elements of each parameter that lie in rank ``rank``'s shards (parameters with none
        are left out)."""
        out = {}
        for name, (start, end, bucket) in self.index.items():
            lo, hi = self.shard_range(bucket, rank)
            count = min(end, hi) - max(start, lo)
            if count > 0:
                out[name] = count
        return out


def _check(params: Sequence[tuple[str, int]], dp_size: int, bucket_size: int | None) -> None:
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    if bucket_size is not None and bucket_size < 1:
        raise ValueError(f"bucket_size must be >= 1 elements or None, got {bucket_size}")
    names = [name for name, _ in params]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique in one buffer")


def layerwise_layout(
    params: Sequence[tuple[str, int]],
    *,
    dp_size: int,
    bucket_size: int | None,
    pad_buckets_for_high_nccl_busbw: bool = False,
    shared_embeddings: Collection[str] = (),
) -> BufferLayout:
    """megatron-core's layer-wise buffer for ``params`` (``(name, numel)`` in forward order).

    ``bucket_size``: elements (None: one bucket, save shared embeddings'); a bucket closes once
    its elements reach ``max(bucket_size, int(dp·largest·0.9))``. ``shared_embeddings``: the
    names megatron-core marks ``shared_embedding`` (a tied embedding or output layer when the
    two are on different pipeline stages)."""
    _check(params, dp_size, bucket_size)
    divisor = layerwise_shard_divisor(dp_size, pad_buckets_for_high_nccl_busbw)
    index: dict[str, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int]] = []
    unpadded: list[int] = []

    def emit(chunk: list[tuple[str, int]], shared: bool = False) -> None:
        if not chunk:
            return
        shards: list[list[tuple[str | None, int]]] = [[] for _ in range(dp_size)]
        if shared:  # alone, whole in shard 0; the same size of padding in every other shard
            name, numel = chunk[0]
            shards[0].append((name, numel))
            for other in shards[1:]:
                other.append((None, numel))
            cursors = [numel] * dp_size
        else:  # LPT: largest first (stable: ties keep backprop order), least-filled shard
            cursors = [0] * dp_size
            heap = [(0, r) for r in range(dp_size)]  # (cursor, shard): lowest shard on ties
            for name, numel in sorted(chunk, key=lambda p: -p[1]):
                _, r = heapq.heappop(heap)
                shards[r].append((name, numel))
                cursors[r] = _round_up(cursors[r], PARAM_ALIGNMENT) + numel
                heapq.heappush(heap, (cursors[r], r))
        shard = _round_up(max(cursors), divisor)
        bucket_start = buckets[-1][1] if buckets else 0
        for r, members in enumerate(shards):
            cursor = bucket_start + r * shard
            for name, numel in members:
                cursor = _round_up(cursor, PARAM_ALIGNMENT)
                if name is not None:
                    index[name] = (cursor, cursor + numel, len(buckets))
                cursor += numel
        buckets.append((bucket_start, bucket_start + dp_size * shard))
        unpadded.append(sum(numel for _, numel in chunk))

    chunk: list[tuple[str, int]] = []
    chunk_numel = chunk_largest = 0
    for name, numel in reversed(params):
        if name in shared_embeddings:
            emit(chunk)  # what came before it in backprop order, then the embedding alone
            chunk, chunk_numel, chunk_largest = [], 0, 0
            emit([(name, numel)], shared=True)
            continue
        chunk.append((name, numel))
        chunk_numel += numel
        chunk_largest = max(chunk_largest, numel)
        # megatron-core's float expression, kept as is so that the threshold rounds the same way
        floor = int(dp_size * chunk_largest * PADDING_FLOOR)
        if bucket_size is not None and chunk_numel >= max(bucket_size, floor):
            emit(chunk)
            chunk, chunk_numel, chunk_largest = [], 0, 0
    emit(chunk)
    return BufferLayout(dp_size, index, tuple(buckets), tuple(unpadded))


def distributed_optimizer_layout(
    params: Sequence[tuple[str, int]],
    *,
    dp_size: int,
    bucket_size: int | None,
    pad_buckets_for_high_nccl_busbw: bool = False,
    shared_embeddings: Collection[str] = (),
) -> BufferLayout:
    """megatron-core's distributed-optimizer (ZeRO-1) buffer for ``params`` (``(name, numel)``
    in forward order): a bucket closes once its span reaches ``bucket_size`` elements (None:
    one bucket), and a shared embedding closes the bucket before it and its own."""
    _check(params, dp_size, bucket_size)
    divisor = bucket_end_divisor(dp_size, pad_buckets_for_high_nccl_busbw)
    index: dict[str, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int]] = []
    unpadded: list[int] = []
    bucket_start = start = end = 0
    open_bucket = False

    def close(last: int) -> int:  # the end of the last parameter (or its padded start)
        unpadded.append(last - bucket_start)
        buckets.append((bucket_start, _round_up(last, divisor)))
        return buckets[-1][1]

    for name, numel in reversed(params):
        start = _round_up(start, PARAM_ALIGNMENT)
        shared = name in shared_embeddings
        if shared and open_bucket:
            bucket_start = start = close(start)
        end = start + numel
        index[name] = (start, end, len(buckets))
        open_bucket = True
        if (bucket_size is not None and end - bucket_start >= bucket_size) or shared:
            bucket_start = start = close(end)
            open_bucket = False
        else:
            start = end
    if open_bucket:
        close(end)
    return BufferLayout(dp_size, index, tuple(buckets), tuple(unpadded))
