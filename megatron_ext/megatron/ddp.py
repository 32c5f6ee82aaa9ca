"""megatron-core's ``DistributedDataParallel``, with a gradient synchronisation an optimizer
can take over.

megatron-core's DDP accumulates each parameter's gradient into ``param.main_grad`` (a view of
its fp32 grad buffer) from a hook on the parameter's gradient accumulator, and its schedule
calls ``finalize_model_grads`` after the last micro-batch, which calls each model chunk's
``finish_grad_sync``: an all-reduce (or reduce-scatter for its distributed optimizer) of every
bucket. The layer-wise optimizer only needs each gradient on the rank that owns it, so it
takes that step over (:meth:`MegatronExtOptimizer.take_over_grad_sync`): it lays DDP's grad
buffer out its own way (:meth:`DistributedDataParallel.grad_storage`), hears from the same
hook when each gradient is complete (so its reduce-scatter-v starts during backward), and
finishes in ``finish_grad_sync``. Until an optimizer does, this class is megatron-core's DDP
unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from megatron.core.distributed import DistributedDataParallel as McDistributedDataParallel

__all__ = ["DistributedDataParallel", "GradSyncHandler"]


class GradSyncHandler(Protocol):
    """What takes over DDP's gradient sync."""

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        """``param.main_grad`` is complete for this step (its last micro-batch)."""

    def finish(self) -> None:
        """Leave every gradient the optimizer reads summed over the data-parallel ranks."""


class DistributedDataParallel(McDistributedDataParallel):
    """megatron-core's DDP; :meth:`hand_grad_sync_to` replaces its gradient reduction."""

    _grad_sync: GradSyncHandler | None = None

    def _make_backward_post_hook(self, param: torch.nn.Parameter) -> Callable[..., None]:
        """DDP's hook (accumulate into ``main_grad``), then, on the last micro-batch of a step
        (outside ``no_sync``), tell the handler the gradient is complete."""
        ddp_hook = super()._make_backward_post_hook(param)

        def hook(*unused: Any) -> None:
            ddp_hook(*unused)
            sync = self._grad_sync
            group = self.param_to_bucket_group.get(param)
            if sync is not None and group is not None and group.is_last_microbatch:
                sync.grad_ready(param)

        return hook

    def grad_storage(self, params: Sequence[torch.nn.Parameter]) -> tuple[torch.Tensor, float, int]:
        """The grad buffer holding every one of ``params`` (its whole 1-D ``grad_data``), the
        factor DDP scales it by before reducing (``gradient_scaling_factor``, e.g. 1/dp) and
        how many parameters the buffer holds (several optimizer parts may share one buffer:
        the layer-wise matrices and the element-sharded AdamW parameters of one dtype).
        The caller may lay the buffer out anew and point ``main_grad`` at its views: with the
        sync handed over, DDP's own code only zeroes the buffer as a whole."""
        buffers = self.buffers + self.expert_parallel_buffers
        holders = {id(b) for p in params for b in buffers if p in b.param_index_map}
        if len(holders) != 1:
            raise ValueError(
                f"the {len(params)} parameters lie in {len(holders)} DDP gradient buffers; "
                "the layer-wise gradient sync needs each optimizer part in one buffer "
                "(one parameter dtype per part)"
            )
        (buffer,) = (b for b in buffers if id(b) in holders)
        return (
            buffer.grad_data,
            float(buffer.gradient_scaling_factor),
            len(buffer.param_index_map),
        )

    def hand_grad_sync_to(self, sync: GradSyncHandler) -> None:
        """From now on backward reports complete gradients to ``sync`` and
        ``finish_grad_sync`` calls ``sync.finish()`` instead of reducing; ``sync`` scales the
        gradients as DDP would."""
        self._grad_sync = sync

    @torch.no_grad()
    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        if self._grad_sync is None:
            super().finish_grad_sync(force_all_reduce=force_all_reduce)
            return
        self._grad_sync.finish()
