"""One GPT optimizer step: this rank's micro-batches of the step's global batch (its batch
stage, :mod:`megatron_ext.schedules.plan`) through megatron-core's forward/backward schedule,
the optimizer step at the scheduled LR, and the global batch's mean loss."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

if TYPE_CHECKING:
    from megatron_ext.gpt.setup import GPTRun

__all__ = ["StepResult", "chunk_iterators", "forward_step", "microbatches", "train_step"]


@dataclass(frozen=True)
class StepResult:
    """What one optimizer step reports."""

    loss: float  # mean over the global batch, nats/token
    grad_norm: float | None  # global, before clipping; None when fp16 skipped the step
    success: bool
    optimizer_s: float  # wall time of the optimizer step on this rank (clip, update, sync)
    lr: float  # the learning rate the step was given (its main parameter group's)
    moe: dict[str, Any] = field(default_factory=dict)  # MoE models: gpt.moe_load's figures
    #: fp16: the loss scale after the step (megatron_ext.megatron.loss_scale); else None
    loss_scale: float | None = None

    @property
    def skipped(self) -> bool:
        """fp16 skipped the update: a gradient overflowed at the loss scale (the scale then
        drops, as Megatron-LM's ``--fp16`` does; not a divergence)."""
        return self.loss_scale is not None and not self.success and self.grad_norm is None


def microbatches(run: GPTRun, step: int, data: Any = None) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of global batch ``step`` of ``data``.

    Training split (``data`` None): step ``step``'s stage batch ``B`` (``run.schedule``),
    samples ``samples_before(step) … + B − 1``. Another split (validation): the target batch
    ``B``, samples ``step·B … + B − 1``. Data-parallel rank r takes the r-th contiguous slice.
    Each value is (micro_batch_size, seq_length)."""
    t, schedule = run.recipe.training, run.schedule
    if data is None:
        data, batch = run.train_data, schedule.global_batch(step)
        start = schedule.samples_before(step)
    else:
        batch = schedule.target_batch
        start = step * batch
    per_rank = batch // run.dp_size
    first = start + run.dp_rank * per_rank
    for m in range(per_rank // t.micro_batch_size):
        start = first + m * t.micro_batch_size
        samples = [data[start + i] for i in range(t.micro_batch_size)]
        yield {
            key: torch.stack([torch.as_tensor(s[key]) for s in samples]).to(run.env.device)
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }


def chunk_iterators(run: GPTRun, make: Callable[[], Iterator[Any]]) -> Any:
    """The schedule's data iterator: ``make()``, or with virtual pipeline stages one per
    model chunk (megatron-core's interleaved schedule reads chunk ``v``'s micro-batches from
    the ``v``-th): copies of one ``make()`` (``itertools.tee``), so each micro-batch is read
    once and every chunk sees the same ones in the same order."""
    if len(run.chunks) == 1:
        return make()
    return list(itertools.tee(make(), len(run.chunks)))


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """One micro-batch forward: per-token losses [b, s] and the masked-mean loss function."""
    batch = next(data_iterator)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (output.float() * mask).sum() / mask.sum().clamp(min=1.0)
        # clone: the schedule divides the returned loss by the micro-batch count in place
        return loss, {"lm loss": loss.detach().clone()}

    return losses, loss_func


def train_step(run: GPTRun, step: int, skipped: int = 0) -> StepResult:
    """One optimizer step (``step``: completed steps before it; ``skipped``: how many of them
    fp16 skipped, which the LR schedule does not count, as Megatron-LM advances its scheduler
    on successful steps only)."""
    for chunk in run.chunks:
        chunk.zero_grad_buffer()
    run.optimizer.zero_grad()
    t = run.recipe.training
    # The stage's batch: the micro-batch count changes at stage boundaries only.
    num_microbatches = run.schedule.num_microbatches(step, t.micro_batch_size, run.dp_size)
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=chunk_iterators(run, lambda: microbatches(run, step)),
        model=run.chunks,
        num_microbatches=num_microbatches,
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        forward_only=False,
    )
    moe: dict[str, Any] = {}
    if run.expert_load is not None:  # before the optimizer step: the loads of this forward
        tokens = run.schedule.global_batch(step) * t.seq_length
        moe = run.expert_load.collect(tokens, num_microbatches, step + 1)
    # on consumed tokens, times the stage's sqrt(B) factor; the embedding and output layer's
    # group (is_decoupled_lr) on optimizer.decoupled_lr's schedule where one is set
    lr = run.schedule.lr_at(step - skipped)
    for group in run.optimizer.param_groups:
        decoupled = group.get("is_decoupled_lr", False)
        group["lr"] = run.schedule.lr_at(step - skipped, True) if decoupled else lr
    start = time.perf_counter()
    success, grad_norm, _ = run.optimizer.step()
    optimizer_s = time.perf_counter() - start
    loss = torch.zeros(1, dtype=torch.float64, device=run.env.device)
    if parallel_state.is_pipeline_last_stage():
        loss += sum(float(o["lm loss"]) for o in outputs) / num_microbatches
    # Mean over data-parallel replicas; the last pipeline stage holds it, broadcast to the rest.
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    loss /= run.dp_size
    dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
    scale = run.optimizer.loss_scale
    if grad_norm is None and (scale is None or success):
        # megatron-core's step returns one whenever it clips or logs it, unless fp16 skipped it
        raise RuntimeError("the optimizer step returned no gradient norm")
    return StepResult(
        float(loss),
        None if grad_norm is None else float(grad_norm),
        success,
        optimizer_s,
        lr,
        moe,
        loss_scale=None if scale is None else float(scale.scale),
    )
