"""A path's parameters by module: which GPTModel parameter belongs to which level's module
(:mod:`.layout`), a path's state split that way, and its parts copied back into the model."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from megatron_ext.dipaco.model.layout import PathLayout

__all__ = ["assign_params", "module_names", "split_by_level"]


def module_names(names: Iterable[str], layout: PathLayout) -> dict[int | None, list[str]]:
    """Parameter names by level (None: path-specific), each list in the order given."""
    out: dict[int | None, list[str]] = {}
    for name in names:
        out.setdefault(layout.param_level(name), []).append(name)
    return out


def split_by_level(
    state: Mapping[str, torch.Tensor], layout: PathLayout
) -> dict[int | None, dict[str, torch.Tensor]]:
    """A path's parameters split into its level-l module (key l) and its path-specific part
    (key None); the tensors are detached clones."""
    return {
        level: {n: state[n].detach().clone() for n in names}
        for level, names in module_names(state, layout).items()
    }


def assign_params(model: torch.nn.Module, *parts: Mapping[str, torch.Tensor]) -> None:
    """Copy ``parts`` (a path's modules and its path-specific part) into ``model``'s
    parameters; together they must name every parameter exactly once."""
    params = dict(model.named_parameters())
    given: dict[str, torch.Tensor] = {}
    for part in parts:
        overlap = set(given) & set(part)
        if overlap:
            raise ValueError(f"parameters {sorted(overlap)[:3]} are given twice")
        given.update(part)
    if set(given) != set(params):
        diff = sorted(set(given) ^ set(params))
        raise ValueError(f"the path's parts and the model differ in {diff[:3]}")
    with torch.no_grad():
        for name, param in params.items():
            param.copy_(given[name])
