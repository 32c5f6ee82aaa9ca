"""Variable-size reduce-scatter of one rank-major flat bucket: the layer-wise optimizer's
gradient sync, the mirror of :mod:`.allgather_v`.

A bucket is laid out rank by rank (rank ``r``'s owned gradients are ``counts[r]`` consecutive
elements). One ``all_to_all_single`` gives rank ``r`` every rank's segment ``r`` (nothing padded,
nothing sent to a rank that does not own it); the owner then adds the ``world`` contributions in
rank order, so the sum is the same bits on any backend and any run.

Per rank and bucket it sends the bytes of the gradients it does not own and receives
``world − 1`` copies of the ones it owns; a ring all-reduce sends and receives
``2·(world − 1)/world`` of the whole bucket.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_ext.distributed.allgather_v import WireStats

__all__ = ["reduce_scatter_v"]


def reduce_scatter_v(
    grads: Mapping[str, torch.Tensor],
    order: Sequence[str],
    owned: Sequence[bool],
    counts: Sequence[int],
    rank: int,
    group: Any,
    wire: WireStats,
) -> None:
    """Sum the gradients of one bucket over ``group`` into their owners' copies, in place.

    ``grads[name]``: this rank's contribution; ``order``: the bucket's parameter names,
    rank-major; ``owned[i]``: whether this rank owns ``order[i]``; ``counts[r]``: elements rank
    ``r`` owns (``sum(counts)`` = the bucket's elements). Afterwards only the owned gradients
    hold sums; the others keep this rank's partial values. ``wire`` counts payload bytes."""
    world = len(counts)
    mine = counts[rank]
    send = torch.cat([grads[n].reshape(-1) for n in order])
    recv = send.new_empty(world * mine)
    if world > 1:
        torch.distributed.all_to_all_single(recv, send, [mine] * world, list(counts), group=group)
    else:
        recv.copy_(send)
    parts = recv.view(world, mine)
    total = parts[0].clone()
    for r in range(1, world):
        total += parts[r]
    offset = 0
    for name, own in zip(order, owned, strict=True):
        if own:
            g = grads[name]
            g.copy_(total[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
    size = send.element_size()
    wire.sent += (send.numel() - mine) * size
    wire.received += (world - 1) * mine * size
