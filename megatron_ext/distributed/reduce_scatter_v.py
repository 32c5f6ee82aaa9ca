"""Variable-size reduce-scatter of one rank-major flat bucket: the layer-wise optimizer's
gradient sync, the mirror of :mod:`.allgather_v`.

A bucket is laid out rank by rank (rank ``r``'s owned gradients are ``counts[r]`` consecutive
elements). Each rank sends segment ``p`` to rank ``p`` and receives every other rank's copy of
its own segment (point-to-point, batched: nothing padded, nothing sent to a rank that does not
own it, no copy of the local segment); the owner then adds the ``world`` contributions in rank
order, so the sum is the same bits on any backend and any run.

Per rank and bucket it sends the bytes of the gradients it does not own and receives
``world − 1`` copies of the ones it owns; a ring all-reduce sends and receives
``2·(world − 1)/world`` of the whole bucket.

The send side is the bucket itself (a view of the gradient storage) and the receive side a
buffer the caller keeps across steps: :func:`start_reduce_scatter_v` allocates nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.distributed.allgather_v import WireStats

__all__ = ["fold_in_rank_order", "start_reduce_scatter_v"]


def start_reduce_scatter_v(
    bucket: torch.Tensor,
    recv: torch.Tensor,
    counts: Sequence[int],
    rank: int,
    group: Any,
    wire: WireStats,
    tag: int = 0,
) -> list[Any]:
    """Start moving each segment of ``bucket`` (1-D, ``sum(counts)`` elements, rank-major) to
    its owner; returns the work handles.

    ``recv``: ``(world − 1, counts[rank])``, row ``j`` receives the ``j``-th other rank's copy
    (other ranks in rank order); ``tag`` tells concurrent buckets apart on backends that match
    point-to-point messages by tag (gloo). ``wire`` counts payload bytes."""
    world = len(counts)
    mine = counts[rank]
    offsets = [0, *accumulate(counts)]
    peers = [p for p in range(world) if p != rank]
    ops = []
    for j, peer in enumerate(peers):
        dst = peer if group is None else dist.get_global_rank(group, peer)
        if counts[peer]:
            segment = bucket[offsets[peer] : offsets[peer + 1]]
            ops.append(dist.P2POp(dist.isend, segment, dst, group=group, tag=tag))
        if mine:
            ops.append(dist.P2POp(dist.irecv, recv[j], dst, group=group, tag=tag))
    size = bucket.element_size()
    wire.sent += (bucket.numel() - mine) * size
    wire.received += (world - 1) * mine * size
    return dist.batch_isend_irecv(ops) if ops else []


def fold_in_rank_order(own: torch.Tensor, others: torch.Tensor, rank: int) -> None:
    """``own`` ← c₀ + c₁ + … + c_{w−1}, added left to right, in place (nothing allocated).

    ``own``: this rank's contribution c_rank; ``others``: ``(world − 1, n)``, the other ranks'
    contributions in rank order (overwritten: it holds the partial sum of the ranks before
    this one). IEEE addition is commutative, so adding that prefix into ``own`` gives the bits
    of ``(c₀ + … + c_{rank−1}) + c_rank``."""
    if rank:
        prefix = others[0]
        for j in range(1, rank):
            prefix.add_(others[j])
        own.add_(prefix)
    for j in range(rank, others.shape[0]):
        own.add_(others[j])
