"""Benchmarks behind ``megatron-ext bench NAME``: they print figures and JSON, never pass/fail.

Each benchmark module defines ``DESCRIPTION``, ``add_arguments(parser)`` and ``run(args) -> int``.
Module top levels must not import torch (``megatron-ext --help`` stays fast); import it in ``run``.
"""

from __future__ import annotations

import argparse
import importlib

BENCHMARKS: dict[str, str] = {
    "optimizers": "megatron_ext.bench.optimizers",
    "layerwise": "megatron_ext.bench.layerwise",
    "soma": "megatron_ext.bench.soma",
}


def add_bench_parsers(sub: argparse._SubParsersAction) -> None:
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.DESCRIPTION, description=module.DESCRIPTION)
        module.add_arguments(p)


def run_bench(args: argparse.Namespace) -> int:
    return importlib.import_module(BENCHMARKS[args.bench_name]).run(args)
