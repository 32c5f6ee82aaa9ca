"""``megatron-ext dipaco worker|status``: join a DiPaCo run as a worker; show a run's state.
Registered as the ``dipaco`` command (no torch import at the top)."""

from __future__ import annotations

import argparse
import shlex
import sys

from megatron_ext.commands import Command, add_recipe_arguments, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="dipaco_command", metavar="ACTION", required=True)
    w = sub.add_parser(
        "worker",
        help="claim the run's tasks until it is complete (join at any time, any number)",
    )
    add_recipe_arguments(w)
    w.add_argument(
        "--max-tasks", type=positive_int, default=None, help="stop after this many tasks"
    )
    w.add_argument("--name", default="", help="worker name in the queue (default host:pid:id)")
    s = sub.add_parser("status", help="phases, tasks by state, workers, module versions")
    s.add_argument("run_dir", help="the run's run_dir")
    s.add_argument("--json", action="store_true", help="print the report as JSON")


def dipaco_main(args: argparse.Namespace) -> int:
    if args.dipaco_command == "status":
        from megatron_ext.dipaco.queue.status import run_status

        return run_status(args.run_dir, args.json)
    from megatron_ext.config import load_recipe
    from megatron_ext.dipaco.recipe import TRAINER
    from megatron_ext.errors import ConfigError

    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.trainer != TRAINER.name:  # `megatron-ext dipaco` serves its own trainer only
        raise ConfigError(f"{args.recipe} is a trainer={recipe.trainer} recipe, not {TRAINER.name}")
    from torch import distributed as dist

    from megatron_ext.dipaco.queue.task_queue import TaskFailedError
    from megatron_ext.dipaco.run.worker import run_worker
    from megatron_ext.dipaco.trainer import start_worker_process
    from megatron_ext.errors import TrainingDivergedError
    from megatron_ext.run.distributed import destroy_process_groups
    from megatron_ext.run.stopping import RunStopped

    start_worker_process(recipe)
    try:
        report = run_worker(recipe, name=args.name, max_tasks=args.max_tasks)
    except (TaskFailedError, TrainingDivergedError) as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except RunStopped as stop:
        if dist.get_rank() == 0:
            again = ["megatron-ext", "dipaco", "worker", args.recipe, *args.overrides]
            print(stop.message(shlex.join(again)), flush=True)
        return 0
    finally:
        destroy_process_groups()
    if report.follower:
        print(f"follower rank done: trained {len(report.completed)} tasks along", flush=True)
        return 0
    print(
        f"worker done: {len(report.completed)} tasks completed, {len(report.rejected)} "
        f"rejected, {len(report.lost)} dropped, {len(report.failed)} given back",
        flush=True,
    )
    return 0


#: The ``megatron_ext.commands`` entry point ``dipaco`` (setup.py).
COMMAND = Command(
    name="dipaco",
    usage="worker|status ...",
    help="join a DiPaCo run as a worker; a run's state",
    description="DiPaCo: work on a run's task queue, or show a run's state.",
    add_arguments=add_arguments,
    run=dipaco_main,
)
