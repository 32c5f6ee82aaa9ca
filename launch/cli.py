"""``megatron-ext``: one command whose sub-commands are declared where they live.

``launch`` is defined here; every other sub-command (``train``, ``data``, ``bench``, ``soma``,
...) is declared in its package's ``cli.py`` and registered as an entry point
(:mod:`megatron_ext.commands`).
Errors that are the user's (a bad recipe, override or flag) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence

from megatron_ext.commands import Command, add_recipe_arguments, commands
from megatron_ext.errors import ConfigError

HEADER = """\
megatron-ext: matrix optimizers, a layer-wise distributed optimizer, recipes and alternate
trainers on top of megatron-core.
"""
FOOTER = "RECIPE is a YAML file or the name of a shipped recipe (e.g. tiny_cpu_gpt)."


def _launch_arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_arguments(p)
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks per node (default: GPU count, or launch.nproc_per_node_cpu on CPU)",
    )
    p.add_argument("--nnodes", type=int, default=None, help="number of nodes (default: SLURM or 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous")
    p.add_argument("--rdzv-id", default=None, help="rendezvous job id (default: SLURM job id)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the exact command and environment (and, on a GPU host, the memory plan), "
        "run nothing",
    )
    p.add_argument(
        "--no-fit-check",
        action="store_true",
        help="launch even when the plan says a rank's memory exceeds the GPU's",
    )


def _launch(args: argparse.Namespace) -> int:
    from megatron_ext.launch.launcher import launch_main

    return launch_main(args)


#: The ``megatron_ext.commands`` entry point ``launch`` (setup.py).
COMMAND = Command(
    name="launch",
    usage="RECIPE [key=value ...]",
    help="run a recipe on this node / cluster (torchrun)",
    description="Validate RECIPE, then run `megatron-ext train` on every rank with "
    "torchrun: --standalone on one node; multi-node from --nnodes/--node-rank/"
    "--rdzv-endpoint or from the SLURM environment.",
    add_arguments=_launch_arguments,
    run=_launch,
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of every registered command."""
    registered = commands()
    lines = [f"  megatron-ext {c.name:<6} {c.usage:<24} {c.help}" for c in registered.values()]
    parser = argparse.ArgumentParser(
        prog="megatron-ext",
        description="\n".join([HEADER, *lines, "", FOOTER]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for command in registered.values():
        p = sub.add_parser(
            command.name, help=command.help, description=command.description or command.help
        )
        command.add_arguments(p)
    return parser


def whole_lines() -> None:
    """Make stdout and stderr write each line with one ``write()``, flushed at its newline.

    The launcher runs its ranks with ``PYTHONUNBUFFERED`` (lines reach a pipe or a SLURM file
    as they are printed), and unbuffered, ``print`` writes a line's text and its newline with
    separate calls: the ranks share one pipe, so another rank's line could land in between
    (seen: two ranks' lines spliced into one). Line-buffered, a line stays whole."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def main(argv: Sequence[str] | None = None) -> int:
    whole_lines()
    args = build_parser().parse_args(argv)
    args.command_argv = list(sys.argv[1:] if argv is None else argv)  # as given (bench's meta)
    try:
        return commands()[args.command].run(args)
    except ConfigError as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
