"""``megatron-ext docs results [--results docs/results] [--check]``: render the results pages from
the benchmarks' JSON (:mod:`megatron_ext.docs.render`), or with ``--check`` say which page on disk
differs from what the JSON renders (exit 1). Registered as the ``docs`` command."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_ext.commands import Command
from megatron_ext.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``results`` action and its options."""
    sub = parser.add_subparsers(dest="docs_command", metavar="ACTION", required=True)
    r = sub.add_parser(
        "results",
        help="render docs/results/*/*.md (tables, provenance, plots) from the benchmarks' JSON",
    )
    r.add_argument("--results", default="docs/results", help="the results folder tree")
    r.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 when a rendered page differs from the one on disk",
    )


def check(root: Path) -> list[Path]:
    """The pages under ``root`` whose file differs from what their JSON renders (or is
    missing)."""
    from megatron_ext.docs.render import render_all

    return [
        path
        for path, text in render_all(root).items()
        if not path.is_file() or path.read_text() != text
    ]


def write(root: Path) -> list[Path]:
    """Render every page under ``root`` and write the ones that changed; returns those."""
    from megatron_ext.atomic import atomic_path
    from megatron_ext.docs.render import render_all

    changed = []
    for path, text in render_all(root).items():
        if path.is_file() and path.read_text() == text:
            continue
        with atomic_path(path) as tmp:
            tmp.write_text(text)
        changed.append(path)
    return changed


def docs_main(args: argparse.Namespace) -> int:
    """Run ``megatron-ext docs ACTION``; returns the exit code."""
    if args.docs_command != "results":
        raise ConfigError(f"unknown docs action {args.docs_command!r}; use results")
    root = Path(args.results)
    if args.check:
        stale = check(root)
        for path in stale:
            print(f"out of date: {path} (run `megatron-ext docs results`)")
        if not stale:
            print(f"{root}: every results page is up to date")
        return 1 if stale else 0
    changed = write(root)
    for path in changed:
        print(f"wrote {path}")
    print(f"{root}: {len(changed)} page(s) rewritten")
    return 0


#: The ``megatron_ext.commands`` entry point ``docs`` (setup.py).
COMMAND = Command(
    name="docs",
    usage="results ...",
    help="render the results pages from the benchmarks' JSON",
    add_arguments=add_arguments,
    run=docs_main,
)
