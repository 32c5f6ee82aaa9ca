"""``megatron-ext train``: the per-rank entry point, as a registered command."""

from __future__ import annotations

import argparse

from megatron_ext.commands import Command, add_recipe_arguments


def _run(args: argparse.Namespace) -> int:
    from megatron_ext.run.ending import end_process
    from megatron_ext.run.entry import train_main

    end_process(train_main(args.recipe, args.overrides))  # without the interpreter's teardown


#: The ``megatron_ext.commands`` entry point ``train`` (setup.py).
COMMAND = Command(
    name="train",
    usage="RECIPE [key=value ...]",
    help="per-rank entry point (torchrun, mpirun, srun)",
    description="Train RECIPE on this rank. Rank, world size and local rank come from "
    "torchrun's variables, or from OMPI_/PMI_/SLURM_ when the processes were started by "
    "mpirun/mpiexec or srun.",
    add_arguments=add_recipe_arguments,
    run=_run,
)
