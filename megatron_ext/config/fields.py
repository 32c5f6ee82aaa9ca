"""Recipe fields with validation metadata (read by :mod:`megatron_ext.config.load`).

No torch import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

import typing
from dataclasses import field
from typing import Any, Literal

__all__ = ["literal_options", "spec"]


def spec(
    default: Any,
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple[Any, ...] | None = None,
    help: str = "",
) -> Any:
    """A dataclass field with validation metadata. A closed set of values is the field's type,
    ``Literal[...]`` (an alias owned by the module that implements the values, e.g.
    ``schedules.lr.DecayStyle``), not ``choices``: ``choices`` is for sets known only at run
    time (the registered MoE presets)."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "help": help}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def literal_options(tp: Any) -> tuple[Any, ...] | None:
    """The values a ``Literal[...]`` annotation allows (also inside ``X | None``); None when
    ``tp`` is not one."""
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    for arg in typing.get_args(tp):
        if typing.get_origin(arg) is Literal:
            return typing.get_args(arg)
    return None
