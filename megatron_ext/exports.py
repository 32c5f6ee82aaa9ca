"""A package's public names, loaded on first use (PEP 562).

A package lists what a user's script may call as ``_EXPORTS = {name: submodule}`` and takes
its module ``__getattr__`` and ``__dir__`` from :func:`lazy_exports`; ``from megatron_ext.soma
import fit_router`` then imports ``megatron_ext.soma.router`` and nothing else, so a torch-free
module stays torch-free to import and the launcher and CLI pay for no trainer.

An exported name must not equal a submodule's name (``tests/test_exports.py``): once that
submodule is imported, ``pkg.<name>`` is the module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def load_export(package: str, exports: Mapping[str, str], name: str) -> Any:
    """``package.<name>`` from the submodule ``exports[name]`` (relative to ``package``, e.g.
    ``"run.store"``); AttributeError, as for any missing attribute, when it is not exported."""
    module = exports.get(name)
    if module is None:
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{package}.{module}"), name)


def lazy_exports(
    package: str, exports: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """The module ``__getattr__`` and ``__dir__`` of ``package`` (its ``__name__``) for its
    ``_EXPORTS``: ``__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)``."""
    import sys

    def getattr_(name: str) -> Any:
        return load_export(package, exports, name)

    def dir_() -> list[str]:
        return sorted([*vars(sys.modules[package]), *exports])

    return getattr_, dir_
