"""Where a DiPaCo run keeps its tensors and arrays, and how a task reads them.

Every file a task writes goes to that task's *attempt folder*,
``<run_dir>/dipaco/tasks/<task>/<lease token>/``, written atomically (temporary file, then
rename). Only the attempt whose completion the queue accepted is ever read (its token is the
task's token in the queue), so a zombie's late files are never used, and the zombie deletes them
when its completion is rejected. Files are immutable once written: a module version is the
output of the outer task that made it, a path's state after phase t the output of its train task.

:class:`RunFiles` is a task's view of them: its own attempt folder, and the accepted attempts of
the tasks it depends on (module version v of module m is the output of ``outer/v-1/m``, version
0 the base model; a path's own part after phase t the output of ``train/t/p``).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_ext.atomic import atomic_path
from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.model.layout import ModuleId
from megatron_ext.dipaco.model.parts import module_names
from megatron_ext.dipaco.queue.task_queue import Lease, TaskQueue
from megatron_ext.dipaco.recipe import path_layout
from megatron_ext.dipaco.run.plan import BASE, PREPARE, outer_id, route_id, shard_phase, train_id

__all__ = [
    "RunFiles",
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


Params = dict[str, torch.Tensor]


class RunFiles:
    """The files of the run of ``recipe`` whose queue is ``queue``; ``layout``: its paths and
    modules, ``run_dir`` its folder."""

    def __init__(self, recipe: Recipe, queue: TaskQueue) -> None:
        self.queue = queue
        self.layout = path_layout(recipe)
        self.run_dir = Path(recipe.run_dir)
        self._recipe = recipe  # which route task re-sharded for a phase (plan.shard_phase)

    def out(self, lease: Lease) -> Path:
        """The folder this attempt writes to."""
        return attempt_dir(self.run_dir, lease.task, lease.token)

    def done(self, task: str) -> Path:
        """The folder of ``task``'s accepted attempt (it must be done)."""
        token = self.queue.token(task)
        if token is None or self.queue.result(task) is None:
            raise RuntimeError(f"task {task} is not done; its dependants cannot run")
        return attempt_dir(self.run_dir, task, token)

    def result(self, task: str) -> dict[str, Any]:
        """The result (JSON) ``task`` completed with."""
        result = self.queue.result(task)
        if result is None:
            raise RuntimeError(f"task {task} is not done")
        return result

    def split(self) -> dict[str, np.ndarray]:
        """``eval``/``router``/``train`` document ids (``prepare``)."""
        return load_arrays(self.done(PREPARE) / "split.npz")

    def features(self) -> dict[str, np.ndarray]:
        """Base-model prefix features of the train, router and eval documents."""
        return load_arrays(self.done(route_id(0)) / "features.npz")

    def shards(self, phase: int) -> dict[str, np.ndarray]:
        """``train_<p>``/``val_<p>`` document ids of the shards phase ``phase`` trains on."""
        return load_arrays(self.done(route_id(shard_phase(self._recipe, phase))) / "shards.npz")

    def router_arrays(self, route_phase: int) -> dict[str, np.ndarray]:
        """The router fitted by ``route/<route_phase>`` (:meth:`Router.from_arrays`)."""
        return load_arrays(self.done(route_id(route_phase)) / "router.npz")

    @cached_property
    def _base(self) -> Params:
        return load_tensors(self.done(BASE) / "model.pt")

    def base_part(self, level: int | None) -> Params:
        """The base model's parameters of ``level`` (None: the path-specific ones)."""
        names = module_names(self._base, self.layout).get(level, [])
        return {n: self._base[n] for n in names}

    def module(self, version: int, module: ModuleId) -> tuple[Params, Params | None]:
        """(parameters, outer momentum or None) of ``module`` at ``version``."""
        if version == 0:
            return self.base_part(module.level), None
        saved = load_tensors(self.done(outer_id(version - 1, module)) / "module.pt")
        return saved["params"], saved["momentum"]

    def path_state(self, version: int, path: int) -> tuple[Params, dict | None, Params | None]:
        """(path-specific parameters, inner optimizer state or None, their outer momentum or
        None) of ``path`` at ``version`` (after ``version`` phases)."""
        if version == 0:
            return self.base_part(None), None, None
        saved = load_tensors(self.done(train_id(version - 1, path)) / "state.pt")
        return saved["specific"], saved["optimizer"], saved["specific_momentum"] or None

    def composition(self, version: int, path: int) -> list[Params]:
        """Every part of ``path`` at ``version``: its modules, then its own parameters."""
        modules = [self.module(version, m)[0] for m in self.layout.path_modules(path)]
        return [*modules, self.path_state(version, path)[0]]
