"""The ``megatron-ext`` sub-commands: each registers itself in its own module.

A package adds a command in its ``cli.py`` (``megatron_ext/data/cli.py``)::

    register_command(Command(
        name="data",
        usage="build|tokenizer ...",
        help="build indexed datasets, train tokenizers",
        add_arguments=add_arguments,   # (argparse.ArgumentParser) -> None
        run=data_main,                 # (argparse.Namespace) -> exit code
    ))

The command line (``launch/cli.py``, which registers ``launch`` itself) builds its parser and
dispatches from this registry; the packages' ``cli.py`` modules are found on first use.
A command module's top level must not import torch (``megatron-ext --help`` stays fast, and the
launcher stays torch-free); import it in ``run``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

__all__ = ["Command", "add_recipe_arguments", "commands", "register_command"]

COMMAND_MODULE = "cli"  # megatron_ext/<package>/cli.py registers commands

_COMMANDS: dict[str, Command] = {}
_discovered = False


@dataclass(frozen=True, kw_only=True)
class Command:
    """A sub-command: ``usage`` and ``help`` make its line in ``megatron-ext --help``;
    ``description`` (default ``help``) heads its own ``--help``."""

    name: str
    usage: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    description: str = ""


def register_command(command: Command) -> Command:
    """Add ``command``; a second command of the same name is a programming error.

    The same registration run twice is not: a module run as ``python -m`` and imported again
    under its own name registers from the same source line (compared by ``run``'s code)."""
    existing = _COMMANDS.get(command.name)
    if existing is not None and _where(existing.run) != _where(command.run):
        raise ValueError(f"command {command.name!r} is registered twice")
    _COMMANDS.setdefault(command.name, command)
    return command


def _where(fn: Callable[..., object]) -> tuple[str, int]:
    code = fn.__code__
    return code.co_filename, code.co_firstlineno


def commands() -> Mapping[str, Command]:
    """Every registered command by name, in registration order (read-only view)."""
    global _discovered
    if not _discovered:
        _discovered = True
        root = Path(__file__).resolve().parent  # the megatron_ext package
        for path in sorted(root.glob(f"*/{COMMAND_MODULE}.py")):
            importlib.import_module(f"megatron_ext.{path.parent.name}.{COMMAND_MODULE}")
    return MappingProxyType(_COMMANDS)


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """``RECIPE [key=value ...]``, as every command that runs or reads a recipe takes them."""
    parser.add_argument("recipe", help="recipe YAML file, or a shipped recipe name (tiny_cpu_gpt)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="override recipe fields, e.g. optimizer.lr=3e-4 training.steps=20",
    )
