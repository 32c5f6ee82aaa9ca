"""What a task reads: the recipe, the layout, the corpus, this worker's GPTModel, and the files
of the tasks it depends on (their accepted attempts, :mod:`.store`).

Also where every version lives: module version v of module m is the output of ``outer/v-1/m``
(version 0: the base model), a path's own part after phase t the output of ``train/t/p``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_ext.atomic import atomic_path
from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.group import WorkerGroup
from megatron_ext.dipaco.layout import ModuleId
from megatron_ext.dipaco.plan import BASE, PREPARE, outer_id, route_id, shard_phase, train_id
from megatron_ext.dipaco.queue import Lease, TaskQueue
from megatron_ext.dipaco.recipe import DipacoConfig, path_layout
from megatron_ext.dipaco.store import attempt_dir, load_tensors, module_names

__all__ = ["LeaseLost", "TaskContext", "save_arrays"]


class LeaseLost(Exception):
    """The worker's lease on its task was taken over: stop working on it."""


def save_arrays(path: Path, **arrays: np.ndarray) -> None:
    """``numpy.savez`` to ``path`` (``.npz``) atomically."""
    with atomic_path(path) as tmp:
        np.savez(tmp, **arrays)


def load_arrays(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


class TaskContext:
    """One worker's view of the run; ``lost()`` says whether the current lease was lost;
    ``group``: the ranks of this worker (one, or R: :mod:`.group`)."""

    def __init__(
        self,
        recipe: Recipe,
        queue: TaskQueue,
        lost: Callable[[], bool],
        group: WorkerGroup | None = None,
    ) -> None:
        self.recipe, self.queue, self.lost = recipe, queue, lost
        self.group = group or WorkerGroup.single()
        self.d: DipacoConfig = recipe.section(DipacoConfig)
        self.layout = path_layout(recipe)
        self.run_dir = Path(recipe.run_dir)

    def check_lease(self) -> None:
        if self.lost():
            raise LeaseLost()

    # ------------------------------------------------------------------ corpus and model
    @cached_property
    def corpus(self) -> tuple[Any, Any]:
        """(tokenizer, indexed dataset), once ``prepare`` made them."""
        from megatron_ext.dipaco.data import open_corpus

        return open_corpus(self.recipe)

    @cached_property
    def path_model(self) -> Any:
        """This worker's GPTModel (built on first use, after ``prepare``)."""
        from megatron_ext.dipaco.model import PathModel

        return PathModel(self.recipe, self.corpus[0].vocab_size)

    # ------------------------------------------------------------------ files of done tasks
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
        result = self.queue.result(task)
        if result is None:
            raise RuntimeError(f"task {task} is not done")
        return result

    def split(self) -> dict[str, np.ndarray]:
        return load_arrays(self.done(PREPARE) / "split.npz")

    def features(self) -> dict[str, np.ndarray]:
        """Base-model prefix features of the train, router and eval documents."""
        return load_arrays(self.done(route_id(0)) / "features.npz")

    def shards(self, phase: int) -> dict[str, np.ndarray]:
        """``train_<p>``/``val_<p>`` document ids of the shards phase ``phase`` trains on."""
        return load_arrays(self.done(route_id(shard_phase(self.recipe, phase))) / "shards.npz")

    def router_arrays(self, route_phase: int) -> dict[str, np.ndarray]:
        return load_arrays(self.done(route_id(route_phase)) / "router.npz")

    @cached_property
    def _base(self) -> dict[str, torch.Tensor]:
        return load_tensors(self.done(BASE) / "model.pt")

    def base_part(self, level: int | None) -> dict[str, torch.Tensor]:
        """The base model's parameters of ``level`` (None: the path-specific ones)."""
        names = module_names(self._base, self.layout).get(level, [])
        return {n: self._base[n] for n in names}

    def module(self, version: int, module: ModuleId) -> tuple[dict, dict | None]:
        """(parameters, outer momentum or None) of ``module`` at ``version``."""
        if version == 0:
            return self.base_part(module.level), None
        saved = load_tensors(self.done(outer_id(version - 1, module)) / "module.pt")
        return saved["params"], saved["momentum"]

    def path_state(self, version: int, path: int) -> tuple[dict, dict | None, dict | None]:
        """(path-specific parameters, inner optimizer state or None, their outer momentum or
        None) of ``path`` at ``version`` (after ``version`` phases)."""
        if version == 0:
            return self.base_part(None), None, None
        saved = load_tensors(self.done(train_id(version - 1, path)) / "state.pt")
        return saved["specific"], saved["optimizer"], saved["specific_momentum"] or None

    def composition(self, version: int, path: int) -> list[dict[str, torch.Tensor]]:
        """Every part of ``path`` at ``version``: its modules, then its own parameters."""
        modules = [self.module(version, m)[0] for m in self.layout.path_modules(path)]
        return [*modules, self.path_state(version, path)[0]]
