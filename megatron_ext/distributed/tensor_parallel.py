"""Which parameters are tensor-parallel shards, from the attributes megatron-core sets.

The optimizers' side of tensor parallelism (modes, shard layouts, gathers) is in
:mod:`megatron_ext.optimizers.tensor_parallel`; this module only reads megatron-core's marks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from megatron_ext.optimizers.tensor_parallel import TPShardInfo

__all__ = ["shard_infos_from_attributes"]


def shard_infos_from_attributes(
    params: Iterable[torch.Tensor], group: dist.ProcessGroup | None = None
) -> dict[torch.Tensor, TPShardInfo]:
    """:class:`TPShardInfo` for every parameter megatron-core marks as TP-split.

    Reads the attributes megatron-core sets on sharded weights (``tensor_model_parallel=True``,
    ``partition_dim``, ``partition_stride``); unmarked parameters are replicated over TP and
    left out. Returns an empty dict when ``group`` has one rank.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return {}
    infos = {}
    for p in params:
        if getattr(p, "tensor_model_parallel", False):
            dim, stride = int(p.partition_dim), int(getattr(p, "partition_stride", 1))  # type: ignore[attr-defined]
            infos[p] = TPShardInfo(dim, group, world, rank, stride)
    return infos
