"""``megatron-ext train``: the per-rank entry point of every trainer.

rank environment -> the recipe, checked once at this world size -> ``registry[recipe.trainer]``
-> its ``train(recipe)``; a diverged run is one line on stderr and exit code 1, and the process
groups are torn down however the trainer ends. Rank, world size and local rank come from
torchrun, or from Open MPI / MPICH / SLURM variables when ``mpirun``/``srun`` started the
processes (:mod:`megatron_ext.run.rank_env`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from megatron_ext.config import load_recipe
from megatron_ext.errors import TrainingDivergedError
from megatron_ext.run.hardware import check_precision_on_rank
from megatron_ext.run.rank_env import detect_rank_env
from megatron_ext.run.trainers import get_trainer

__all__ = ["train_main"]


def train_main(recipe_path: str, overrides: Sequence[str]) -> int:
    """Train ``recipe_path`` (with ``overrides``) on this rank; returns the exit code."""
    env = detect_rank_env(os.environ)
    recipe = load_recipe(recipe_path, overrides, world_size=env.world_size)
    check_precision_on_rank(recipe, env.local_rank)  # again, as torch sees this rank's GPU
    train = get_trainer(recipe.trainer).load_train()
    import torch

    from megatron_ext.run.distributed import destroy_process_groups

    if recipe.launch.threads_per_rank:
        torch.set_num_threads(recipe.launch.threads_per_rank)
    try:
        train(recipe)
    except TrainingDivergedError as exc:
        if env.rank == 0 or not exc.on_every_rank:
            print(f"megatron-ext: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        destroy_process_groups()
    return 0
