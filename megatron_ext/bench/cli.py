"""``megatron-ext bench NAME``: the registered command over every benchmark module.

Every benchmark also takes ``--quick``: the settings of its module's ``QUICK`` (tiny sizes, one
or two timed steps), for a smoke run in seconds to a few minutes on a laptop CPU; the figures
are then not the benchmark's, only proof that every path of it runs. An option given on the
command line with a value other than its default wins over ``QUICK``.
"""

from __future__ import annotations

import argparse
from typing import Any

from megatron_ext.bench import benchmarks
from megatron_ext.commands import Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One sub-command per benchmark module, with that module's options and ``--quick``."""
    found = benchmarks()
    sub = parser.add_subparsers(
        dest="bench_name", metavar="NAME", required=True, help=", ".join(found)
    )
    for name, module in found.items():
        p = sub.add_parser(
            name,
            help=module.DESCRIPTION,
            description=module.DESCRIPTION,
            epilog=f"smoke run: {module.EXAMPLE}",
        )
        module.add_arguments(p)
        quick = ", ".join(f"--{k.replace('_', '-')} {_shown(v)}" for k, v in module.QUICK.items())
        p.add_argument(
            "--quick",
            action="store_true",
            help=f"tiny settings for a smoke run ({quick}); options given with another value "
            "than their default win; the figures are then no benchmark",
        )
        p.set_defaults(bench_defaults={key: p.get_default(key) for key in module.QUICK})


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def apply_quick(args: argparse.Namespace, quick: dict[str, Any]) -> list[str]:
    """Set ``quick``'s values on ``args`` where the command line left the default; returns the
    options set, as ``--name value``."""
    applied = []
    for key, value in quick.items():
        if getattr(args, key) == args.bench_defaults[key]:
            setattr(args, key, value)
            applied.append(f"--{key.replace('_', '-')} {_shown(value)}")
    return applied


def _run(args: argparse.Namespace) -> int:
    from megatron_ext.bench.common import begin_run

    module = benchmarks()[args.bench_name]
    if hasattr(args, "recipe") and hasattr(args, "overrides"):
        from megatron_ext.config import read_recipe

        read_recipe(args.recipe, args.overrides)  # a typo stops here, before any run starts
    # every JSON this run writes carries it as meta; argv: what main() was given (in-process)
    begin_run(args.bench_name, module.ANCHOR, getattr(args, "command_argv", None))
    if args.quick:
        applied = apply_quick(args, module.QUICK)
        print(f"[{args.bench_name}] --quick: {' '.join(applied) or 'nothing left to set'}")
    return module.run(args)


#: The ``megatron_ext.commands`` entry point ``bench`` (setup.py).
COMMAND = Command(
    name="bench",
    usage="NAME ...",
    help="benchmarks: figures and JSON, never pass/fail",
    description="Benchmarks (print figures and JSON). Each takes --quick for a smoke run.",
    add_arguments=add_arguments,
    run=_run,
)
