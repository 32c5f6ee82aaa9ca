"""``megatron-ext train``: the per-rank entry point, shared by every trainer.

Rank, world size and local rank come from torchrun, or from Open MPI / MPICH / SLURM variables
when ``mpirun``/``srun`` started the processes (see :mod:`megatron_ext.launch.rank_env`).
"""

from __future__ import annotations

import os
import sys

from megatron_ext.config import load_recipe
from megatron_ext.launch.rank_env import detect_rank_env

TRAINERS = {
    "gpt": "megatron_ext.training.gpt:train_gpt",
    "soma": "megatron_ext.soma.trainer:train_soma",
}


def train_main(recipe_path: str, overrides: list[str]) -> int:
    env = detect_rank_env(os.environ)
    recipe = load_recipe(recipe_path, overrides, world_size=env.world_size)
    if recipe.trainer not in TRAINERS:
        from megatron_ext.errors import ConfigError

        raise ConfigError(
            f"trainer={recipe.trainer!r} is not available yet; available: {', '.join(TRAINERS)}"
        )
    if recipe.launch.threads_per_rank:
        import torch

        torch.set_num_threads(recipe.launch.threads_per_rank)
    module_name, func_name = TRAINERS[recipe.trainer].split(":")
    import importlib

    from megatron_ext.training.gpt import NonFiniteLossError

    trainer = getattr(importlib.import_module(module_name), func_name)
    try:
        trainer(recipe)
    except NonFiniteLossError as exc:
        if env.rank == 0:
            print(f"megatron-ext: error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        from megatron_ext.megatron.parallel import destroy_distributed

        destroy_distributed()
    return 0
