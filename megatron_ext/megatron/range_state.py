"""Checkpoint entries of element-sharded optimizer state (ZeRO-1 AdamW): a rank's element range
of a parameter, written under the parameter's own key and shape.

A rank holding elements ``[lo, hi)`` of a flattened parameter writes each 1-D state tensor of
that range as a few ShardedTensors of the parameter's shape (blocks from
:func:`~megatron_ext.distributed.shard_layout.rectangles`, irregular, no ``flattened_range``,
which dist_checkpointing 0.19 no longer supports). Every rank's blocks tile the tensor, so
the checkpoint holds whole tensors under the same keys as the layer-wise optimizer's
(``optimizer.layerwise.<state key>.<model shard tag>``) and a run at any data-parallel size
reads its own ranges back: torch_dist reads the saved chunks each requested block overlaps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

from megatron_ext.distributed.shard_layout import rectangles

__all__ = ["join_blocks", "range_entries"]


def _blocks(
    key: str, value: torch.Tensor, shape: tuple[int, ...], lo: int, hi: int, replica: int
) -> list[ShardedTensor]:
    """``value`` (the 1-D range ``[lo, hi)``) as ShardedTensors of the whole ``shape``."""
    out = []
    at = 0
    for offset, block in rectangles(shape, lo, hi):
        n = math.prod(block)
        data = value[at : at + n].view(block)
        at += n
        out.append(
            ShardedTensor(
                key=key,
                data=data,
                dtype=data.dtype,
                local_shape=block,
                global_shape=shape,
                global_offset=offset,
                axis_fragmentations=None,  # an irregular split: DCP checks the coverage
                replica_id=replica,
            )
        )
    return out


def range_entries(
    state: Mapping[str, Any],
    key_format: str,
    shape: tuple[int, ...],
    flat: tuple[int, int],
    replica: int,
    counter_replica: int,
) -> dict[str, Any]:
    """One parameter's entries: each 1-D state tensor of the range ``flat`` as blocks
    (``replica``: 0 unless a tensor-parallel duplicate), scalars (AdamW's step counter, equal on
    every rank) as one ShardedObject written by ``counter_replica == 0``; ``key_format`` gets
    the state key."""
    lo, hi = flat
    entry: dict[str, Any] = {}
    for k, v in state.items():
        key = key_format.format(k)
        if torch.is_tensor(v) and v.dim() > 0:
            entry[k] = _blocks(key, v, shape, lo, hi, replica)
        else:
            entry[k] = ShardedObject(key, v, (1,), (0,), replica_id=counter_replica)
    return entry


def join_blocks(value: Any) -> Any:
    """A loaded list of blocks back into its 1-D range; anything else as it is."""
    if isinstance(value, list) and value and all(torch.is_tensor(v) for v in value):
        return torch.cat([v.reshape(-1) for v in value])
    return value
