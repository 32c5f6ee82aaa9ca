"""``megatron-ext bench NAME``: the registered command over every benchmark module."""

from __future__ import annotations

import argparse

from megatron_ext.bench import benchmarks
from megatron_ext.run.commands import Command, register_command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-command per benchmark module, with that module's options."""
    found = benchmarks()
    sub = parser.add_subparsers(
        dest="bench_name", metavar="NAME", required=True, help=", ".join(found)
    )
    for name, module in found.items():
        p = sub.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION)
        module.add_arguments(p)


def _run(args: argparse.Namespace) -> int:
    return benchmarks()[args.bench_name].run(args)


register_command(
    Command(
        name="bench",
        usage="NAME ...",
        help="benchmarks: figures and JSON, never pass/fail",
        description="Benchmarks (print figures and JSON).",
        add_arguments=add_arguments,
        run=_run,
    )
)
