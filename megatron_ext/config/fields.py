"""Recipe fields with validation metadata (read by :mod:`megatron_ext.config.load`).

No torch import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any

__all__ = ["spec"]


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
    """A dataclass field with validation metadata."""
    meta = {"ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices, "help": help}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)
