"""Layer-wise optimizers over several data-parallel domains, behind one interface (and the
element-sharded AdamW parts beside them, :class:`~.sharded_adam.ShardedAdamW`, which answer
the same interface).

With expert parallelism the dense weights are replicated over the data-parallel group, but each
expert weight only over the (smaller) expert-data-parallel group: the ranks of one expert-parallel
group hold different experts. Each domain therefore gets its own ownership plan, buckets,
gradient reduce-scatter and parameter all-gather (:class:`LayerwiseOptimizer` over that domain's
group); :class:`LayerwiseDomains` steps them in turn and answers for whichever owns a name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from megatron_ext.distributed.allgather_v import WireStats
from megatron_ext.distributed.layerwise import LayerwiseOptimizer


class LayerwiseDomains:
    """The :class:`LayerwiseOptimizer` interface over disjoint parameter domains."""

    def __init__(self, parts: Sequence[LayerwiseOptimizer]) -> None:
        self.parts = [p for p in parts if p.named_params]
        self._of = {n: part for part in self.parts for n, _ in part.named_params}

    # -- the step -------------------------------------------------------------------------
    def step(self) -> None:
        for part in self.parts:
            part.step()

    def finish(self) -> None:
        for part in self.parts:
            part.finish()

    def reduce_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        for part in self.parts:
            part.reduce_grads({n: grads[n] for n, _ in part.named_params})

    def grad_ready(self, name: str) -> None:
        self._of[name].grad_ready(name)

    def finish_grad_sync(self) -> None:
        for part in self.parts:
            part.finish_grad_sync()

    def attach_forward_hooks(self, model: torch.nn.Module) -> list[Any]:
        return [h for part in self.parts for h in part.attach_forward_hooks(model)]

    # -- masters ----------------------------------------------------------------------------
    def master(self, name: str) -> torch.nn.Parameter:
        return self._of[name].master(name)

    def set_grads(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        for part in self.parts:  # each part takes the gradients of the masters it holds
            part.set_grads(grads)

    def reload_masters(self) -> None:
        for part in self.parts:
            part.reload_masters()

    def master_bytes(self) -> int:
        return sum(part.master_bytes() for part in self.parts)

    # -- ownership ------------------------------------------------------------------------
    def counts_toward_norm(self, name: str) -> bool:
        return self._of[name].counts_toward_norm(name)

    def saves(self, name: str) -> bool:
        return self._of[name].saves(name)

    def holds(self, name: str) -> bool:
        return self._of[name].holds(name)

    def flat_range(self, name: str) -> tuple[int, int] | None:
        """This rank's element range of ``name`` if an element-sharded part (ZeRO-1 AdamW,
        :mod:`.sharded_adam`) holds it, else ``None`` (whole matrices)."""
        part = self._of[name]
        return part.flat_range(name) if hasattr(part, "flat_range") else None

    @property
    def grad_wire(self) -> WireStats:
        """Gradient bytes over every domain (see :attr:`LayerwiseOptimizer.grad_wire`)."""
        return WireStats(
            sent=sum(p.grad_wire.sent for p in self.parts),
            received=sum(p.grad_wire.received for p in self.parts),
        )

    # -- torch.optim-like views and state --------------------------------------------------
    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        return [o for part in self.parts for o in part.all_optimizers()]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for part in self.parts for g in part.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {k: v for part in self.parts for k, v in part.state.items()}

    def named_state(self) -> dict[str, dict[str, Any]]:
        return {n: st for part in self.parts for n, st in part.named_state().items()}

    def load_named_state(self, named: Mapping[str, Mapping[str, Any]]) -> None:
        for part in self.parts:
            part.load_named_state(named)

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.named_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_named_state(state["state"])
