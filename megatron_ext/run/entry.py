"""``megatron-ext train``: the per-rank entry point of every trainer.

rank environment -> the recipe, checked once at this world size -> ``registry[recipe.trainer]``
-> its ``train(recipe)``; a diverged run is one line on stderr and exit code 1, a run stopped on
purpose (a stop signal, ``training.exit_duration_in_mins``/``exit_interval``) one line saying
where and how to resume and exit code 0, and the process groups are torn down however the
trainer ends. Rank, world size and local rank come from
torchrun, or from Open MPI / MPICH / SLURM variables when ``mpirun``/``srun`` started the
processes (:mod:`megatron_ext.run.rank_env`).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Sequence
from typing import Any

from megatron_ext.config import load_recipe
from megatron_ext.config.trainers import get_trainer
from megatron_ext.errors import ConfigError, TrainingDivergedError
from megatron_ext.run.hardware import check_precision_on_rank
from megatron_ext.run.lazy_compile import defer_compile_on_cpu
from megatron_ext.run.lifetime import die_with_parent
from megatron_ext.run.peers import describe_comm_failure
from megatron_ext.run.rank_env import detect_rank_env
from megatron_ext.run.rank_errors import record_error, record_stop
from megatron_ext.run.stopping import LAUNCH_COMMAND_VAR, RunStopped

__all__ = ["train_main"]


def train_main(recipe_path: str, overrides: Sequence[str]) -> int:
    """Train ``recipe_path`` (with ``overrides``) on this rank; returns the exit code: 0 (also
    when the run stopped early on purpose, :class:`RunStopped`), 1 for a diverged run; a
    ``ConfigError`` propagates (exit 2). A failure is recorded for the launcher
    (:mod:`megatron_ext.run.rank_errors`)."""
    env = detect_rank_env(os.environ)
    if LAUNCH_COMMAND_VAR in os.environ:  # under `megatron-ext launch`: a lost launcher ends us
        die_with_parent()
    try:
        return _train_main(recipe_path, overrides, env.rank, env.world_size)
    except ConfigError as exc:
        record_error(env.rank, 2, f"megatron-ext: error: {exc}")
        raise
    except Exception as exc:
        # a peer that went away, named (torch raises RuntimeError and its subclasses for them)
        lost = describe_comm_failure(str(exc), env.rank) if isinstance(exc, RuntimeError) else None
        if lost is not None:
            print(f"megatron-ext: error: {lost}", file=sys.stderr, flush=True)
        record_error(
            env.rank, 1, f"megatron-ext: error: {lost}" if lost else f"{type(exc).__name__}: {exc}"
        )
        raise


def _train_main(recipe_path: str, overrides: Sequence[str], rank: int, world_size: int) -> int:
    recipe = load_recipe(recipe_path, overrides, world_size=world_size)
    training = recipe.sections.get("training")  # again, as torch sees this rank's GPU
    precision = training.precision if training is not None else None
    check_precision_on_rank(precision, detect_rank_env(os.environ).local_rank)
    defer_compile_on_cpu()  # before the trainer imports megatron-core (run.lazy_compile)
    train = get_trainer(recipe.trainer).load_train()
    import torch

    from megatron_ext.run.distributed import destroy_process_groups

    if recipe.launch.threads_per_rank:
        torch.set_num_threads(recipe.launch.threads_per_rank)
    try:
        train(recipe)
    except TrainingDivergedError as exc:
        if rank == 0 or not exc.on_every_rank:
            print(f"megatron-ext: error: {exc}", file=sys.stderr, flush=True)
        record_error(rank, 1, f"megatron-ext: error: {exc}")
        return 1
    except RunStopped as stop:
        if rank == 0:
            message = stop.message(resume_command(recipe_path, overrides, recipe))
            if not record_stop(message):  # the launcher prints it last; without one, here
                print(message, flush=True)
        return 0
    finally:
        destroy_process_groups()
    return 0


def resume_command(recipe_path: str, overrides: Sequence[str], recipe: Any) -> str:
    """The command that continues this run: the launcher's own command line when it started
    the ranks (``MEGATRON_EXT_LAUNCH_COMMAND``), else this rank's ``megatron-ext train``; with
    ``checkpoint.load=auto`` added when the recipe loads something else."""
    command = os.environ.get(LAUNCH_COMMAND_VAR) or shlex.join(
        ["megatron-ext", "train", recipe_path, *overrides]
    )
    return command + ("" if recipe.checkpoint.load == "auto" else " checkpoint.load=auto")
