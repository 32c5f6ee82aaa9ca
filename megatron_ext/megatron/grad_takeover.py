"""The layer-wise optimizer's takeover of megatron-core DDP's gradient sync (called by
:meth:`~megatron_ext.megatron.optimizer.MegatronExtOptimizer.take_over_grad_sync`).

Each optimizer part (a layer-wise domain or an element-sharded AdamW) lays its gradients out
in the DDP grad buffer that holds its parameters -- parts sharing a buffer take consecutive
regions of it -- and ``param.main_grad`` is re-pointed at the new views, their values moved
along. Every DDP (one per model chunk with virtual pipeline stages) then reports completed
gradients to a :class:`LayerwiseGradSync` and waits for its own parts in
``finish_grad_sync``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["LayerwiseGradSync", "hand_grad_sync_over"]


def hand_grad_sync_over(
    parts: Sequence[Any], param_of: dict[str, torch.nn.Parameter], models: Sequence[Any]
) -> None:
    """Bind each of ``parts`` to the grad buffer of the DDP in ``models`` holding its
    parameters (``param_of``: name -> model parameter) and hand each DDP's sync to a
    :class:`LayerwiseGradSync` over its parts (see the module docstring)."""
    chunk_of = {id(p): m for m in models for p in m.parameters()}
    part_of: dict[torch.nn.Parameter, tuple[Any, str]] = {}
    parts_of: dict[int, list[Any]] = {id(m): [] for m in models}
    # parts sharing a DDP buffer (matrices and element-sharded AdamW of one dtype) take
    # consecutive regions of it: [next free element, parameters bound, parameters held]
    claimed: dict[int, list[int]] = {}
    for part in parts:
        names = [n for n, _ in part.named_params]
        holder = chunk_of[id(param_of[names[0]])]
        storage, scale, held = holder.grad_storage([param_of[n] for n in names])
        parts_of[id(holder)].append(part)
        slot = claimed.setdefault(id(storage), [0, 0, held])
        region = storage[slot[0] :]
        slot[0] += part.grad_numel
        slot[1] += len(names)
        before = {n: param_of[n].main_grad.clone() for n in names}  # once, at setup
        views = part.bind_grad_storage(region, scale)
        region[: part.grad_numel].zero_()
        for name in names:
            p = param_of[name]
            p.main_grad = views[name].view_as(p)
            p.main_grad.copy_(before[name])
            part_of[p] = (part, name)
    for _, bound, held in claimed.values():
        if bound != held:
            raise ValueError(
                f"a DDP gradient buffer holds {held} parameters, the optimizer {bound}: "
                "the layer-wise gradient sync cannot lay it out (build the optimizer over "
                "every parameter of the model)"
            )
    for m in models:  # each chunk's finish_grad_sync waits for its own parts
        m.hand_grad_sync_to(LayerwiseGradSync(part_of, parts_of[id(m)]))


class LayerwiseGradSync:
    """DDP's gradient-sync handler for the layer-wise optimizer's domains: a completed
    gradient goes to its domain (:meth:`LayerwiseOptimizer.grad_ready`), ``finish`` waits for
    every domain's reduce-scatters."""

    def __init__(
        self, part_of: dict[torch.nn.Parameter, tuple[Any, str]], parts: Sequence[Any]
    ) -> None:
        self.part_of, self.parts = part_of, parts

    def grad_ready(self, param: torch.nn.Parameter) -> None:
        part, name = self.part_of[param]
        part.grad_ready(name)

    def finish(self) -> None:
        for part in self.parts:
            part.finish_grad_sync()
