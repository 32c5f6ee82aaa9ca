"""The DiPaCo trainer (``trainer: dipaco``): every rank the launcher starts is one worker.

    prepare -> base model -> routing -> phases of (tau inner steps per path -> outer step per
    module -> re-shard) -> early-stopping choice per path -> routed evaluation (summary.json)

The work is the queue's (:mod:`.plan`, :mod:`.tasks`); a rank here, or any process started with
``megatron-ext dipaco worker RECIPE``, claims tasks until the run is complete, and fewer workers
than paths is normal. Workers do not communicate with each other; with
``dipaco.ranks_per_worker`` = R, R consecutive ranks are one worker and train a path
data-parallel (:mod:`.group`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.queue.task_queue import TaskFailedError
from megatron_ext.dipaco.run.worker import run_worker

__all__ = ["start_worker_process", "train"]


def start_worker_process(recipe: Recipe) -> int:
    """Join the process groups megatron-core's layers need (a single process started without a
    launcher uses no rendezvous port: run.distributed, so independent workers on one host do not
    collide) and fix the thread count (``launch.threads_per_rank``, 1 when 0: results must not
    depend on it). Returns the global rank."""
    from megatron_ext.megatron.parallel import init_distributed

    joined = init_distributed(
        recipe.parallel,
        recipe.seed,
        recipe.launch.master_port,
        recipe.launch.collective_timeout_s,
    )
    torch.set_num_threads(recipe.launch.threads_per_rank or 1)
    return joined.rank


def train(recipe: Recipe) -> dict[str, Any]:
    """Per-rank entry point: work as one DiPaCo worker until the run is complete."""
    rank = start_worker_process(recipe)
    try:
        report = run_worker(recipe, name=f"rank{rank}")
    except TaskFailedError as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    return {"completed": report.completed, "rejected": report.rejected}
