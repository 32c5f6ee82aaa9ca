"""``megatron-ext``: one command whose sub-commands are declared where they live.

``launch`` is defined here; every other sub-command (``train``, ``data``, ``bench``, ``soma``,
...) is declared in its package's ``cli.py`` and registered as an entry point
(:mod:`megatron_ext.commands`).
Every command runs inside one error boundary (:mod:`.boundary`): a user's error (a bad recipe,
override, flag, file or path) prints one line and exits 2, an internal one keeps its traceback;
options and ``key=value`` overrides may come in any order; ``--verbose`` anywhere shows the
libraries' start-up noise (:mod:`megatron_ext.verbosity`), hidden by default.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Sequence

from megatron_ext.commands import Command, add_recipe_arguments, commands
from megatron_ext.launch.boundary import (
    OneLineParser,
    guarded,
    parse_command_line,
    take_verbose_flag,
)
from megatron_ext.verbosity import filter_native_stdout, quiet_libraries

HEADER = """\
megatron-ext: matrix optimizers, a layer-wise distributed optimizer, recipes and alternate
trainers on top of megatron-core.
"""
FOOTER = (
    "RECIPE is a YAML file or the name of a shipped recipe (e.g. tiny_cpu_gpt). --verbose (any "
    "command) shows the libraries' warnings and gloo's connection lines, hidden by default; "
    "--quiet (any command) hides the progress shown on a terminal."
)
#: commands whose processes may create gloo process groups (gloo prints a line per group)
_GLOO_COMMANDS = frozenset(
    {"train", "launch", "convert", "tools", "ckpt", "bench", "soma", "dipaco"}
)


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
        help="make every check the launch makes (recipe, data, tokenizer, vocabulary, run_dir, "
        "port), print the exact command and environment (and, on a GPU host, the memory plan); "
        "run and write nothing",
    )
    p.add_argument(
        "--schedule-png",
        metavar="PATH",
        default=None,
        help="with --dry-run: also plot the batch and LR schedule of a GPT recipe to PATH",
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
    parser = OneLineParser(
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
    """Run ``megatron-ext ARGV`` (default ``sys.argv[1:]``); returns the exit code. With
    ``argv`` None (the real command) gloo's connection lines are filtered from stdout too."""
    whole_lines()
    given = list(sys.argv[1:] if argv is None else argv)
    words = take_verbose_flag(given)
    quiet_libraries()
    try:
        args = parse_command_line(build_parser(), words)
    except SystemExit as exc:  # --help, or a one-line usage error: a code, also in-process
        return exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 2
    args.command_argv = given  # as given (bench's meta)
    if argv is None and args.command in _GLOO_COMMANDS and not getattr(args, "dry_run", False):
        filter_native_stdout()
    return guarded(lambda: commands()[args.command].run(args))


if __name__ == "__main__":
    sys.exit(main())
