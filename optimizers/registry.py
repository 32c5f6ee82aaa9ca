"""Build an optimizer by its registered name, with its keyword hyperparameters checked first."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from .spec import optimizer_spec

__all__ = ["build_optimizer", "hyperparameter_names"]


def hyperparameter_names(name: str) -> list[str]:
    """Keyword hyperparameters that optimizer ``name`` accepts (from its signature)."""
    signature = inspect.signature(optimizer_spec(name).optimizer_class())
    return [p for p in signature.parameters if p not in ("self", "params")]


def build_optimizer(
    name: str,
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    hyperparameters: Mapping[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Build the optimizer registered as ``name`` on ``params``.

    Raises:
        ValueError: unknown optimizer name, unknown hyperparameter, or an invalid value; the
            message lists the valid choices.
    """
    valid = hyperparameter_names(name)
    hyperparameters = dict(hyperparameters or {})
    unknown = sorted(set(hyperparameters) - set(valid))
    if unknown:
        raise ValueError(
            f"optimizer {name!r} has no hyperparameter(s) {unknown}; valid ones are {valid}"
        )
    return optimizer_spec(name).optimizer_class()(params, **hyperparameters)
