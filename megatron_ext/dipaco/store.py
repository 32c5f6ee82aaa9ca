"""Where a DiPaCo run keeps its tensors, and how a path's parameters split into its modules.

Every file a task writes goes to that task's *attempt folder*,
``<run_dir>/dipaco/tasks/<task>/<lease token>/``, written atomically (temporary file, then
rename). Only the attempt whose completion the queue accepted is ever read (its token is the
task's token in the queue), so a zombie's late files are never used, and the zombie deletes them
when its completion is rejected. Files are immutable once written: a module version is the
output of the outer task that made it, a path's state after phase t the output of its train task.
"""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from megatron_ext.atomic import atomic_path
from megatron_ext.dipaco.layout import PathLayout

__all__ = [
    "assign_params",
    "attempt_dir",
    "discard_attempt",
    "load_tensors",
    "module_names",
    "save_tensors",
    "set_mid_write_fault",
    "split_by_level",
]


def attempt_dir(run_dir: str | Path, task: str, token: str) -> Path:
    """The folder of one attempt (``token``) at ``task`` (ids and tokens made path-safe)."""
    return Path(run_dir) / "dipaco" / "tasks" / task.replace("/", "-") / token.replace(":", "-")


def discard_attempt(run_dir: str | Path, task: str, token: str) -> None:
    """Delete a rejected attempt's files."""
    shutil.rmtree(attempt_dir(run_dir, task, token), ignore_errors=True)


# fault tests only (``megatron-ext dipaco worker --pause-mid-write KIND``): called with the
# target path once half of a file's bytes are in its temporary file; it stops the process
_mid_write: Callable[[Path], None] | None = None


def set_mid_write_fault(hook: Callable[[Path], None] | None) -> None:
    """Make the next :func:`save_tensors` call ``hook`` half-way through writing (once)."""
    global _mid_write
    _mid_write = hook


def save_tensors(path: Path, obj: Mapping[str, Any]) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically (a crash leaves the old file or none)."""
    global _mid_write
    with atomic_path(path) as tmp, open(tmp, "wb") as stream:
        if _mid_write is None:
            torch.save(dict(obj), stream)
            return
        hook, _mid_write = _mid_write, None
        data = io.BytesIO()
        torch.save(dict(obj), data)
        raw = data.getvalue()
        stream.write(raw[: len(raw) // 2])
        stream.flush()
        hook(path)
        stream.write(raw[len(raw) // 2 :])


def load_tensors(path: Path) -> dict[str, Any]:
    """A file written by :func:`save_tensors` (tensors, numbers, strings, lists, dicts only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


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
