"""megatron-core's ``DistributedDataParallel``, with a gradient synchronisation an optimizer
can take over.

megatron-core's schedule calls ``finalize_model_grads`` after the last micro-batch, which calls
each model chunk's ``finish_grad_sync``: an all-reduce (or reduce-scatter for its distributed
optimizer) of every gradient bucket. The layer-wise optimizer only needs each gradient on the
rank that owns it, so it replaces that step with a variable-size reduce-scatter to the owners
(:meth:`MegatronExtOptimizer.take_over_grad_sync`). Until an optimizer does, this class is
megatron-core's DDP unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.distributed import DistributedDataParallel as McDistributedDataParallel

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(McDistributedDataParallel):
    """megatron-core's DDP; :meth:`hand_grad_sync_to` replaces its gradient reduction."""

    _grad_sync: Callable[[], None] | None = None

    def hand_grad_sync_to(self, sync: Callable[[], None]) -> None:
        """From now on ``finish_grad_sync`` scales each bucket as DDP would (its
        ``gradient_scaling_factor``, e.g. 1/dp) and then calls ``sync`` instead of reducing:
        ``sync`` must leave every gradient its caller reads summed over the data-parallel
        ranks."""
        self._grad_sync = sync

    @torch.no_grad()
    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if self._grad_sync is None:
            super().finish_grad_sync(force_all_reduce=force_all_reduce)
            return
        for bucket_group in self.bucket_groups + self.expert_parallel_bucket_groups:
            for bucket in bucket_group.buckets:
                if bucket.gradient_scaling_factor != 1.0:
                    bucket.grad_data *= bucket.gradient_scaling_factor
        self._grad_sync()
