"""Optimizers by name, with hyperparameters checked before anything is built."""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch

from .kl_soap import KLSoap
from .lion import Lion
from .mop import MOP
from .muon import Muon
from .validation import check_choice

__all__ = ["OPTIMIZERS", "OptimizerName", "build_optimizer", "hyperparameter_names"]

OptimizerName = Literal["adamw", "lion", "muon", "mop", "kl_soap"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "adamw": torch.optim.AdamW,
    "lion": Lion,
    "muon": Muon,
    "mop": MOP,
    "kl_soap": KLSoap,
}


def hyperparameter_names(name: str) -> list[str]:
    """Keyword hyperparameters that optimizer ``name`` accepts."""
    check_choice("optimizer", name, OptimizerName)
    signature = inspect.signature(OPTIMIZERS[name].__init__)
    return [p for p in signature.parameters if p not in ("self", "params")]


def build_optimizer(
    name: str,
    params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
    hyperparameters: Mapping[str, Any] | None = None,
) -> torch.optim.Optimizer:
    """Build optimizer ``name`` on ``params``.

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
    return OPTIMIZERS[name](params, **hyperparameters)
