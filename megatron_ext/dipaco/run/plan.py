"""The whole run as a graph of queue tasks, a pure function of the recipe (so every worker that
joins enqueues the same tasks, idempotently).

::

    prepare ─► base ─► route/0000 ─► train/t/p ─► outer/t/l_e ─► train/t+1/p ─► ...
                                       (every path p)  (every module, once its paths reported)
    re-shard after phase t (discriminative): outer/t/* ─► score/t/p ─► route/t+1 ─► train/t+1/*
    after the last phase: outer/T-1/* ─► final/p (early-stopping choice, eval scores) ─► eval

``train/t/p`` waits for the new version of each module path p uses (not for the whole phase)
and for its own previous phase (its inner optimizer state). Priorities order the claimable
tasks by phase, so workers finish a phase before starting far ahead.

The run's identity in the queue (:func:`run_fingerprint`) is a pure function of the recipe too.
"""

from __future__ import annotations

import hashlib
import json

from megatron_ext.config.schema import Recipe, recipe_dict
from megatron_ext.dipaco.model.layout import ModuleId, PathLayout
from megatron_ext.dipaco.queue.task_queue import TaskSpec
from megatron_ext.dipaco.recipe import DipacoConfig, path_layout

__all__ = [
    "build_plan",
    "outer_id",
    "reshard_phases",
    "route_id",
    "run_fingerprint",
    "train_id",
]

PREPARE, BASE, EVAL = "prepare", "base", "eval"


def train_id(phase: int, path: int) -> str:
    return f"train/{phase:04d}/{path:04d}"


def outer_id(phase: int, module: ModuleId) -> str:
    return f"outer/{phase:04d}/{module.name}"


def score_id(phase: int, path: int) -> str:
    return f"score/{phase:04d}/{path:04d}"


def route_id(phase: int) -> str:
    return f"route/{phase:04d}"


def final_id(path: int) -> str:
    return f"final/{path:04d}"


def reshard_phases(recipe: Recipe) -> list[int]:
    """Phases that start from a discriminative re-shard (made after the phase before)."""
    d = recipe.section(DipacoConfig)
    if d.routing != "discriminative" or d.reshards == 0:
        return []
    # k = 1..R at round(k·T / (R + 1)): one re-shard halfway, R = T - 1 before every phase
    return sorted({round(k * d.phases / (d.reshards + 1)) for k in range(1, d.reshards + 1)})


def shard_phase(recipe: Recipe, phase: int) -> int:
    """The phase whose routing task made the shards phase ``phase`` trains on."""
    return max([0, *(t for t in reshard_phases(recipe) if t <= phase)])


def build_plan(recipe: Recipe) -> list[TaskSpec]:
    """Every task of the run with its dependencies (see the module docstring)."""
    d, layout = recipe.section(DipacoConfig), path_layout(recipe)
    reshards = set(reshard_phases(recipe))
    tasks = [
        TaskSpec(PREPARE, "prepare", priority=0),
        TaskSpec(BASE, "base", priority=1, deps=(PREPARE,)),
        TaskSpec(route_id(0), "route", {"phase": 0}, priority=2, deps=(BASE,)),
    ]
    for t in range(d.phases):
        base = 100 * (t + 1)
        if t in reshards:
            scores = tuple(score_id(t - 1, p) for p in range(layout.num_paths))
            tasks += [
                TaskSpec(
                    score_id(t - 1, p),
                    "score",
                    {"phase": t - 1, "path": p},
                    priority=base,
                    deps=_module_deps(layout, t - 1, p),
                )
                for p in range(layout.num_paths)
            ]
            tasks.append(
                TaskSpec(route_id(t), "route", {"phase": t}, priority=base + 1, deps=scores)
            )
        for p in range(layout.num_paths):
            deps = [route_id(shard_phase(recipe, t))]
            if t > 0:
                deps += [train_id(t - 1, p), *_module_deps(layout, t - 1, p)]
            tasks.append(
                TaskSpec(
                    train_id(t, p),
                    "train",
                    {"phase": t, "path": p},
                    priority=base + 2,
                    deps=tuple(deps),
                )
            )
        for m in layout.modules:
            tasks.append(
                TaskSpec(
                    outer_id(t, m),
                    "outer",
                    {"phase": t, "level": m.level, "index": m.index},
                    priority=base + 3,
                    deps=tuple(train_id(t, p) for p in layout.paths_of(m)),
                )
            )
    last = d.phases - 1
    end = 100 * (d.phases + 1)
    finals = []
    for p in range(layout.num_paths):
        deps = (*_module_deps(layout, last, p), *(train_id(t, p) for t in range(d.phases)))
        finals.append(TaskSpec(final_id(p), "final", {"path": p}, priority=end, deps=deps))
    tasks += finals
    tasks.append(TaskSpec(EVAL, "eval", priority=end + 1, deps=tuple(f.id for f in finals)))
    return tasks


def _module_deps(layout: PathLayout, phase: int, path: int) -> tuple[str, ...]:
    """The outer tasks of ``phase`` that make the module versions path ``path`` uses next."""
    return tuple(outer_id(phase, m) for m in layout.path_modules(path))


# fields that do not change what a run computes: workers may differ in them
_OPERATIONAL = (
    "queue",
    "lease_seconds",
    "heartbeat_seconds",
    "max_attempts",
    "poll_seconds",
    "ranks_per_worker",  # a multi-rank worker computes the same bits (:mod:`.group`)
)


def run_fingerprint(recipe: Recipe) -> str:
    """A hash of everything that decides the run's results (not logging, launching or queue
    timing), so workers started with the same recipe agree and another recipe is refused."""
    raw = recipe_dict(recipe)
    for key in ("logging", "launch", "checkpoint"):
        raw.pop(key, None)
    for key in _OPERATIONAL:
        raw["sections"]["dipaco"].pop(key, None)
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]
