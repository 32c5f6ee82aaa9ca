"""Benchmarks behind ``megatron-ext bench NAME``: they print figures and JSON, never pass/fail.

A benchmark is a module of this package that defines ``DESCRIPTION``, ``add_arguments(parser)``
and ``run(args) -> int``; its name is the module's (``megatron_ext/bench/soma.py`` is
``megatron-ext bench soma``). Adding that module is the whole registration: :func:`benchmarks`
finds it. Modules whose name starts with ``_`` and modules without ``run`` (``common``) are
helpers. Module top levels must not import torch (``megatron-ext --help`` stays fast); import it
in ``run``.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType

__all__ = ["benchmarks"]


def benchmarks() -> dict[str, ModuleType]:
    """Every benchmark module by name, sorted."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_") or info.ispkg:
            continue
        module = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(module, "run"):
            found[info.name] = module
    return found
