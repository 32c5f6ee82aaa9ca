"""The ``megatron-ext`` sub-commands: each is declared in its own module.

A package declares a command in its ``cli.py`` (``megatron_ext/data/cli.py``)::

    COMMAND = Command(
        name="data",
        usage="build|tokenizer ...",
        help="build indexed datasets, train tokenizers",
        add_arguments=add_arguments,   # (argparse.ArgumentParser) -> None
        run=data_main,                 # (argparse.Namespace) -> exit code
    )

and registers it as an entry point of the group ``megatron_ext.commands`` (``data =
megatron_ext.data.cli:COMMAND`` in ``setup.py``, or in another distribution's metadata:
:mod:`megatron_ext.registry`). The command line (``launch/cli.py``, which declares ``launch``)
builds its parser and dispatches from this registry, in declaration order.
A command module's top level must not import torch (``megatron-ext --help`` stays fast, and the
launcher stays torch-free); import it in ``run``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from megatron_ext.registry import Registry

__all__ = [
    "COMMANDS",
    "Command",
    "add_recipe_arguments",
    "commands",
    "fraction",
    "positive_float",
    "positive_int",
    "register_command",
]


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


#: ``megatron-ext NAME`` -> its command; the group ``megatron_ext.commands``.
COMMANDS: Registry[Command] = Registry(
    "command",
    "megatron_ext.commands",
    of=Command,
    shipped={  # alphabetical, as `megatron-ext --help` lists them
        "bench": "megatron_ext.bench.cli:COMMAND",
        "ckpt": "megatron_ext.ckpt.cli:COMMAND",
        "convert": "megatron_ext.convert.cli:CONVERT",
        "data": "megatron_ext.data.cli:COMMAND",
        "dipaco": "megatron_ext.dipaco.cli:COMMAND",
        "docs": "megatron_ext.docs.cli:COMMAND",
        "launch": "megatron_ext.launch.cli:COMMAND",
        "plan": "megatron_ext.planner.cli:COMMAND",
        "recipe": "megatron_ext.megatron.recipe_cli:COMMAND",
        "soma": "megatron_ext.soma.cli:COMMAND",
        "tools": "megatron_ext.convert.cli:TOOLS",
        "train": "megatron_ext.run.cli:COMMAND",
    },
)


def register_command(command: Command) -> Command:
    """Add ``command`` in-process (a test, a script); a package declares an entry point."""
    return COMMANDS.register(command)


def commands() -> Mapping[str, Command]:
    """Every registered command by name, in declaration order (read-only view)."""
    return COMMANDS.items()


def add_recipe_arguments(parser: argparse.ArgumentParser) -> None:
    """``RECIPE [key=value ...]``, as every command that runs or reads a recipe takes them."""
    parser.add_argument("recipe", help="recipe YAML file, or a shipped recipe name (tiny_cpu_gpt)")
    parser.add_argument(
        "overrides",
        nargs="*",
        default=[],
        metavar="key=value",
        help="override recipe fields, e.g. optimizer.lr=3e-4 training.steps=20",
    )


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer of at least 1 (a count: steps, threads, tokens, ...)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer: give 1 or more")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a number above 0 (a temperature, a bandwidth, ...)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} is not a positive number: give more than 0")
    return value


def fraction(text: str) -> float:
    """An argparse ``type``: a number in [0, 1] (a fraction, a cosine threshold)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid float value: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1]")
    return value
