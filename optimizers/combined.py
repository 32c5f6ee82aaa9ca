"""One optimizer object over a whole model: a matrix optimizer for hidden weights, AdamW (or a
routed override) for everything else."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch

from .qkv import QKVLayout
from .registry import build_optimizer
from .routing import split_parameters

__all__ = ["CombinedOptimizer", "build_model_optimizer"]


class CombinedOptimizer:
    """Several optimizers stepped together; ``param_groups`` concatenates theirs."""

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        self.optimizers = dict(optimizers)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.optimizers.values() for g in opt.param_groups]

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers.values():
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers.values():
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {name: opt.state_dict() for name, opt in self.optimizers.items()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if set(state_dict) != set(self.optimizers):
            raise ValueError(
                f"state dict holds optimizers {sorted(state_dict)}, "
                f"this one has {sorted(self.optimizers)}"
            )
        for name, opt in self.optimizers.items():
            opt.load_state_dict(state_dict[name])


def build_model_optimizer(
    named_parameters: Iterable[tuple[str, torch.Tensor]],
    *,
    matrix_optimizer: str = "muon",
    hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
    overrides: Sequence[tuple[str, str]] = (),
    qkv_layout: QKVLayout | None = None,
) -> CombinedOptimizer:
    """Route a model's parameters (:mod:`.routing`) and build one optimizer per routed name.

    Args:
        named_parameters: ``model.named_parameters()``.
        matrix_optimizer: ``muon``, ``mop`` or ``kl_soap`` for the hidden matrices.
        hyperparameters: per optimizer name, its keyword hyperparameters.
        overrides: ``(glob, optimizer)`` routing overrides.
        qkv_layout: for ``muon``/``mop``: split fused ``linear_qkv.weight`` into Q, K, V.
    """
    hyperparameters = hyperparameters or {}
    routed = split_parameters(
        named_parameters, matrix_optimizer=matrix_optimizer, overrides=overrides
    )
    optimizers: dict[str, torch.optim.Optimizer] = {}
    for name, members in routed.items():
        params: list[torch.Tensor] | list[dict[str, Any]] = [p for _, p in members]
        if qkv_layout is not None and name in ("muon", "mop"):
            fused = [p for n, p in members if n.endswith("linear_qkv.weight")]
            rest = [p for n, p in members if not n.endswith("linear_qkv.weight")]
            params = [
                g
                for g in ({"params": rest}, {"params": fused, "qkv_layout": qkv_layout})
                if g["params"]
            ]
        optimizers[name] = build_optimizer(name, params, hyperparameters.get(name))
    return CombinedOptimizer(optimizers)
