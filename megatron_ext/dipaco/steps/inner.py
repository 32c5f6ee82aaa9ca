"""The inner phase of one path: τ optimizer steps on its shard, from its modules' global versions.

The inner optimizer is the recipe's ``optimizer`` section, built by name from the optimizer
registry: the matrix optimizer (Muon, MOP, KL-SOAP, Lion) on the hidden matrices and AdamW on the
rest (embeddings, output layer, norms), with megatron-core's weight-decay groups, global
grad-norm clipping and one learning rate (update-RMS matched, as in the GPT trainer). Its state
persists across phases per path (:meth:`InnerOptimizer.state_dict`).

The learning rate follows one cosine schedule over all ``phases · τ`` inner steps of a path
(:func:`inner_schedule`): step ``k`` of phase ``t`` uses ``lr_at(t · τ + k)``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.megatron.optimizer_factories import hyperparameters
from megatron_ext.optimizers.registry import build_optimizer
from megatron_ext.optimizers.routing import route_parameter, weight_decay_groups
from megatron_ext.schedules.lr import LRSchedule

from .guards import check_every_step_ran, check_finite_loss

__all__ = ["InnerOptimizer", "inner_schedule", "inner_steps"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


def inner_schedule(cfg: OptimizerConfig, phases: int, tau: int, warmup: int) -> LRSchedule:
    """One cosine from ``optimizer.lr`` to ``optimizer.min_lr`` over ``phases · tau`` steps."""
    return LRSchedule(
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        warmup_steps=warmup,
        decay_steps=phases * tau,
        decay_style="cosine",
    )


class InnerOptimizer:
    """The recipe's optimizer over one path's named parameters (see the module docstring)."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]], cfg: OptimizerConfig):
        hp = hyperparameters(cfg)
        routed: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, param in named:
            if param.requires_grad:
                choice = route_parameter(name, tuple(param.shape), matrix_optimizer=cfg.name)
                routed.setdefault(choice, []).append((name, param))
        self.parts = {
            choice: build_optimizer(choice, weight_decay_groups(params), hp[choice])
            for choice, params in sorted(routed.items())
        }
        self.params = [p for params in routed.values() for _, p in params]
        self.clip_grad = cfg.clip_grad

    def zero_grad(self) -> None:
        for part in self.parts.values():
            part.zero_grad(set_to_none=True)

    def step(self, lr: float) -> float:
        """Clip the gradients (global norm), then update at ``lr``; returns the norm before
        clipping."""
        if self.clip_grad > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.clip_grad)
        else:
            grads = [p.grad.detach().norm() for p in self.params if p.grad is not None]
            norm = torch.linalg.vector_norm(torch.stack(grads)) if grads else torch.zeros(())
        for part in self.parts.values():
            for group in part.param_groups:
                group["lr"] = lr
            part.step()
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        return {choice: part.state_dict() for choice, part in self.parts.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != set(self.parts):
            raise ValueError(f"inner state for {sorted(state)}, optimizer has {sorted(self.parts)}")
        for choice, part in self.parts.items():
            part.load_state_dict(state[choice])


def inner_steps(
    model: torch.nn.Module,
    optimizer: Any,
    batches: Iterable[Any],
    lrs: Sequence[float],
    loss_fn: LossFn,
    where: str = "",
) -> list[float]:
    """One optimizer step per learning rate in ``lrs``, each on the next batch; returns the
    losses. A batch is one input of ``loss_fn`` or a list of micro-batches (their mean loss,
    gradients accumulated micro-batch by micro-batch). ``optimizer``: anything with
    ``zero_grad()`` and ``step(lr)`` (:class:`InnerOptimizer`). A non-finite loss raises
    :class:`TrainingDivergedError` naming ``where`` and the step, before that step is taken."""
    losses = []
    model.train()
    for k, (lr, batch) in enumerate(zip(lrs, batches, strict=False)):
        micro = batch if isinstance(batch, list) else [batch]
        optimizer.zero_grad()
        value = 0.0
        for part in micro:
            loss = loss_fn(model, part) / len(micro)
            loss.backward()
            value += float(loss.detach())
        remedy = "lower optimizer.lr or enable optimizer.clip_grad"
        check_finite_loss(value, where, k, "loss", remedy)
        optimizer.step(lr)
        losses.append(value)
    check_every_step_ran(losses, lrs, where)
    return losses
