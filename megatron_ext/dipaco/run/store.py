"""Where a DiPaCo run keeps its tensors and arrays.

Every file a task writes goes to that task's *attempt folder*,
``<run_dir>/dipaco/tasks/<task>/<lease token>/``, written atomically (temporary file, then
rename). Only the attempt whose completion the queue accepted is ever read (its token is the
task's token in the queue), so a zombie's late files are never used, and the zombie deletes them
when its completion is rejected. Files are immutable once written: a module version is the
output of the outer task that made it, a path's state after phase t the output of its train task.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_ext.atomic import atomic_path

__all__ = [
    "attempt_dir",
    "discard_attempt",
    "load_arrays",
    "load_tensors",
    "save_arrays",
    "save_tensors",
]


def attempt_dir(run_dir: str | Path, task: str, token: str) -> Path:
    """The folder of one attempt (``token``) at ``task`` (ids and tokens made path-safe)."""
    return Path(run_dir) / "dipaco" / "tasks" / task.replace("/", "-") / token.replace(":", "-")


def discard_attempt(run_dir: str | Path, task: str, token: str) -> None:
    """Delete a rejected attempt's files."""
    shutil.rmtree(attempt_dir(run_dir, task, token), ignore_errors=True)


def save_tensors(path: Path, obj: Mapping[str, Any]) -> None:
    """``torch.save`` ``obj`` to ``path`` atomically (a crash leaves the old file or none)."""
    with atomic_path(path) as tmp, open(tmp, "wb") as stream:
        torch.save(dict(obj), stream)


def load_tensors(path: Path) -> dict[str, Any]:
    """A file written by :func:`save_tensors` (tensors, numbers, strings, lists, dicts only)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def save_arrays(path: Path, **arrays: np.ndarray) -> None:
    """``numpy.savez`` to ``path`` (``.npz``) atomically."""
    with atomic_path(path) as tmp:
        np.savez(tmp, **arrays)


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    """A file written by :func:`save_arrays` (no pickled objects)."""
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}
