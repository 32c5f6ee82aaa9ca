"""Validation loss of the GPT trainer: the validation split of megatron-core's GPT dataset,
every ``training.eval_interval`` steps and after the last one.

The :class:`Evaluator` decides when (``should_evaluate``) and computes the loss with
megatron-core's forward-only schedule: ``training.eval_iters`` global batches, the same ones
every time (validation samples ``0 … eval_iters·global_batch − 1``, each data-parallel rank
taking its contiguous slice as in training), mean loss per token over them and over the
data-parallel ranks — so two evaluations of the same weights give the same number, whatever the
data-parallel size.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ext.gpt.step import chunk_iterators, forward_step, microbatches

if TYPE_CHECKING:
    from megatron_ext.gpt.setup import GPTRun

__all__ = ["Evaluator"]


@dataclass
class Evaluator:
    """When and how the validation loss is measured.

    Args:
        data: the validation split (``None`` when the recipe's split gives it no documents).
        interval: evaluate after every ``interval`` steps (0: only after the last step).
        iters: global batches per evaluation (0: never evaluate).
    """

    data: Any
    interval: int
    iters: int

    @property
    def enabled(self) -> bool:
        return self.iters > 0 and self.data is not None

    def should_evaluate(self, step: int, last_step: int) -> bool:
        """After completed step ``step``: every ``interval`` steps and after the last one."""
        if not self.enabled:
            return False
        return step == last_step or (self.interval > 0 and step % self.interval == 0)

    @torch.no_grad()
    def evaluate(self, run: GPTRun) -> float:
        """Mean validation loss (nats/token) of the current weights, the same on every rank."""
        run.optimizer.finish_param_sync()  # the forward must see this step's parameters
        t = run.recipe.training
        for chunk in run.chunks:
            chunk.eval()
        total = torch.zeros(1, dtype=torch.float64, device=run.env.device)
        for index in range(self.iters):
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=chunk_iterators(run, partial(microbatches, run, index, self.data)),
                model=run.chunks,
                num_microbatches=run.num_microbatches,
                seq_length=t.seq_length,
                micro_batch_size=t.micro_batch_size,
                forward_only=True,
            )
            if parallel_state.is_pipeline_last_stage():
                total += sum(float(o["lm loss"]) for o in outputs) / run.num_microbatches
        for chunk in run.chunks:
            chunk.train()
        dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
        dist.all_reduce(total, group=parallel_state.get_pipeline_model_parallel_group())
        return float(total) / (self.iters * run.dp_size)
