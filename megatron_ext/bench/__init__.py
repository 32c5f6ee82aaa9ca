"""Benchmarks behind ``megatron-ext bench NAME``: they print figures and JSON, never pass/fail.

A benchmark is a module that defines ``DESCRIPTION`` (one line), ``EXAMPLE`` (its smoke-run
command line), ``QUICK`` (the ``--quick`` settings), ``JSON_KEYS`` (the keys of the JSON report
it writes, ``meta`` among them: :func:`megatron_ext.bench.common.write_json` stamps it),
``ANCHOR`` (in words, the baseline its ratios and deltas are measured against, in the same run),
``add_arguments(parser)`` and ``run(args) -> int``. It is registered as an entry
point of the group ``megatron_ext.benchmarks`` naming the module (``soma =
megatron_ext.bench.soma`` in ``setup.py``, or in another distribution's metadata:
:mod:`megatron_ext.registry`); the entry's name is the benchmark's. Modules here whose name
starts with ``_``, and ``common``, are helpers. Module top levels must not import torch
(``megatron-ext --help`` stays fast); import it in ``run``.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

from megatron_ext.registry import Registry

__all__ = ["BENCHMARKS", "INTERFACE", "benchmarks"]

#: What a benchmark module defines.
INTERFACE = ("DESCRIPTION", "EXAMPLE", "QUICK", "JSON_KEYS", "ANCHOR", "add_arguments", "run")


def _check_benchmark(module: ModuleType) -> None:
    missing = [name for name in INTERFACE if not hasattr(module, name)]
    if missing:
        raise TypeError(f"benchmark module {module.__name__} lacks {', '.join(missing)}")


#: ``megatron-ext bench NAME`` -> its module; the group ``megatron_ext.benchmarks``.
BENCHMARKS: Registry[ModuleType] = Registry(
    "benchmark",
    "megatron_ext.benchmarks",
    of=ModuleType,
    named=False,
    check=_check_benchmark,
    shipped={
        name: f"megatron_ext.bench.{name}"
        for name in (
            "convergence",
            "dipaco",
            "layerwise",
            "optimizers",
            "paper",
            "plan",
            "precision",
            "ramp",
            "soma",
        )
    },
)


def benchmarks() -> Mapping[str, ModuleType]:
    """Every registered benchmark module by name, in declaration order (read-only view)."""
    return BENCHMARKS.items()
