"""Bytes one rank sends and receives per optimizer step, by collective.

- **data parallel, layer-wise optimizer**: per bucket of each domain (dense over the
  data-parallel group, experts over the expert-data-parallel group) the gradient
  reduce-scatter-v (fp32 ``main_grad``) and the parameter all-gather-v (model dtype), counted by
  :class:`~megatron_ext.distributed.plan.BucketLayout` exactly as
  :class:`~megatron_ext.distributed.allgather_v.WireStats` counts them; the replicated small
  parameters' gradient all-reduce beside it (ring: ``2·(n−1)/n`` of the bytes each way);
- **data parallel, element-sharded AdamW** (ZeRO-1: plain AdamW, and the AdamW-routed
  parameters of a matrix-optimizer run): the same two collectives per bucket, each rank's
  range an even split of the bucket (:mod:`~megatron_ext.distributed.shard_layout`); none on
  a group of one rank; megatron-core DDP's all-reduce is replaced by them (``ddp_all_reduce``
  stays 0 for the GPT trainer);
- **tensor / sequence parallel**: per layer and micro-batch, forward and backward, the four
  activation collectives of a Megatron layer (two all-gathers and two reduce-scatters with
  sequence parallelism, two all-reduces each way without — the same bytes, ``(tp−1)/tp`` of a
  ``tokens × hidden`` tensor each, ×2 for an all-reduce);
- **expert parallel**: per MoE layer and micro-batch, dispatch and combine all-to-alls forward
  and backward, ``tokens·topk·hidden·(ep−1)/ep`` each (uniform routing);
- **pipeline parallel**: per micro-batch one ``tokens × hidden`` activation out and its gradient
  back at each stage boundary the rank sits on.

Sent and received are equal for every collective but the layer-wise ones (an owner receives
more than it sends in the reduce-scatter, and sends less in the all-gather).

Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_ext.planner.ownership import FP32, OptimizerLayout, domain_buckets
from megatron_ext.planner.params import PlannedParam

__all__ = ["CommFigures", "data_parallel_bytes", "ring_all_reduce_bytes"]


@dataclass
class CommFigures:
    """Bytes per optimizer step on one rank, (sent, received) per collective."""

    grad_reduce_scatter: tuple[int, int] = (0, 0)
    param_all_gather: tuple[int, int] = (0, 0)
    replicated_all_reduce: tuple[int, int] = (0, 0)
    ddp_all_reduce: tuple[int, int] = (0, 0)
    tensor_parallel: tuple[int, int] = (0, 0)
    expert_all_to_all: tuple[int, int] = (0, 0)
    pipeline: tuple[int, int] = (0, 0)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {
            name: {"sent": value[0], "received": value[1]} for name, value in vars(self).items()
        }

    @property
    def data_parallel_sent(self) -> int:
        return (
            self.grad_reduce_scatter[0]
            + self.param_all_gather[0]
            + self.replicated_all_reduce[0]
            + self.ddp_all_reduce[0]
        )


def ring_all_reduce_bytes(nbytes: int, world: int) -> int:
    """Bytes each rank sends (and receives) in a ring all-reduce of ``nbytes``."""
    return 2 * (world - 1) * nbytes // world if world > 1 else 0


def data_parallel_bytes(
    params: Sequence[PlannedParam],
    layout: OptimizerLayout,
    *,
    dense_rank: int,
    expert_rank: int,
    dp: int,
    edp: int,
    param_bytes: int,
) -> CommFigures:
    """The data-parallel collectives' bytes of one step on the given ranks."""
    figures = CommFigures()
    rs = [0, 0]
    ag = [0, 0]
    replicated = 0
    ranked = [
        (b, expert_rank if plan is layout.expert else dense_rank)
        for plan, buckets in domain_buckets(params, layout)
        for b in buckets
    ]
    # the element-sharded AdamW's buckets: nothing moves within one rank
    for buckets, rank in ((layout.dense_shards, dense_rank), (layout.expert_shards, expert_rank)):
        ranked += [(b, rank) for b in buckets if len(b.counts) > 1]
    for b, rank in ranked:
        for total, (sent, received) in (
            (rs, b.reduce_scatter_bytes(rank, FP32)),
            (ag, b.gather_bytes(rank, param_bytes)),
        ):
            total[0] += sent
            total[1] += received
    for plan, _ in domain_buckets(params, layout):
        world = dp if plan is layout.dense else edp
        small = set(plan.replicated)
        nbytes = FP32 * sum(p.numel for p in params if p.name in small)
        replicated += ring_all_reduce_bytes(nbytes, world)
    figures.grad_reduce_scatter = (rs[0], rs[1])
    figures.param_all_gather = (ag[0], ag[1])
    figures.replicated_all_reduce = (replicated, replicated)
    return figures
