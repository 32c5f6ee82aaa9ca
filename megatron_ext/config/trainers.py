"""The trainer registry: what ``trainer: NAME`` in a recipe means.

A trainer registers itself in its own package, in a torch-free module named ``recipe.py``
(``megatron_ext/soma/recipe.py``)::

    register_trainer(TrainerSpec(
        name="soma",
        train="megatron_ext.soma.trainer:train",   # imported only on the ranks that train
        check=check_soma,                          # cross-field rules; raise ConfigError
        sections={"soma": SomaConfig},             # the recipe sections it owns
        reads={"data": ("source",)},               # what it reads of other trainers' sections
    ))

The recipe schema reads the registry (a recipe holds its trainer's sections, its ``check`` is
``Recipe.check``), and so does the launcher through it: a trainer that is not registered fails
at validation, before any process starts. The per-rank entry point
imports ``train`` and calls it with the validated recipe.

The registry finds the packages' ``recipe.py`` modules on first use. Nothing here
imports torch: the launcher validates recipes before any rank exists.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from megatron_ext.errors import ConfigError

if TYPE_CHECKING:
    from megatron_ext.config.schema import Recipe

__all__ = [
    "TrainerSpec",
    "get_trainer",
    "recipe_sections",
    "register_trainer",
    "trainer_sections",
    "trainers",
]

REGISTRATION_MODULE = "recipe"  # megatron_ext/<package>/recipe.py registers a trainer

_TRAINERS: dict[str, TrainerSpec] = {}
_discovered = False


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """A trainer as the recipe and the entry point see it.

    ``train``: ``"module:function"``, the per-rank entry ``function(recipe)``. ``check(recipe,
    world_size)``: the trainer's cross-field rules (``world_size`` None: the rules that need no
    job size); raises ``ConfigError``. ``sections``: the recipe sections the trainer owns, by
    name, and the dataclass each is parsed into. ``reads``: the sections of other trainers it
    reads, each mapped to the fields it reads (None: all of them); a recipe that sets any other
    field of them, or a section the trainer does not read, is refused before launch
    (:mod:`megatron_ext.config.reads`). The run sections (``run_dir``, ``logging``,
    ``checkpoint``, ``launch``) belong to every trainer.
    """

    name: str
    train: str
    check: Callable[[Recipe, int | None], None]
    sections: Mapping[str, type] = field(default_factory=dict)
    reads: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if set(self.sections) & set(self.reads):
            raise ValueError(f"trainer {self.name!r}: a section is both owned and read")
        if self.train.count(":") != 1:
            raise ValueError(f"trainer {self.name!r}: train={self.train!r} is not module:function")

    def load_train(self) -> Callable[[Recipe], Any]:
        """Import the trainer's entry function (this is where torch gets imported)."""
        module, function = self.train.split(":")
        return getattr(importlib.import_module(module), function)


def register_trainer(spec: TrainerSpec) -> TrainerSpec:
    """Add ``spec`` to the registry; a second trainer of the same name is a programming error."""
    if _TRAINERS.get(spec.name, spec) != spec:
        raise ValueError(f"trainer {spec.name!r} is registered twice")
    _TRAINERS[spec.name] = spec
    return spec


def trainers() -> Mapping[str, TrainerSpec]:
    """Every registered trainer by name (read-only view)."""
    _discover()
    return MappingProxyType(_TRAINERS)


def get_trainer(name: str) -> TrainerSpec:
    """The trainer registered as ``name``; a ConfigError naming the registered ones if none."""
    registered = trainers()
    if name in registered:
        return registered[name]
    close = difflib.get_close_matches(name, list(registered), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"trainer={name!r} is not a registered trainer{hint}; registered trainers: "
        f"{', '.join(sorted(registered))}"
    )


def trainer_sections() -> dict[str, type]:
    """Every registered trainer's own sections: name -> the dataclass it is parsed into."""
    owned: dict[str, type] = {}
    for spec in trainers().values():
        for name, config in spec.sections.items():
            if owned.setdefault(name, config) is not config:
                raise ValueError(f"recipe section {name!r} is owned by two trainers")
    return owned


def recipe_sections(spec: TrainerSpec) -> dict[str, type]:
    """The sections a ``spec.name`` recipe holds: its own, then the ones it reads of others."""
    owned = trainer_sections()
    missing = [name for name in spec.reads if name not in owned]
    if missing:
        raise ValueError(f"trainer {spec.name!r} reads {missing}, which no trainer owns")
    return {**spec.sections, **{name: owned[name] for name in spec.reads}}


def _discover() -> None:
    """Import every ``megatron_ext/<package>/recipe.py`` (each registers its trainer), once."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.glob(f"*/{REGISTRATION_MODULE}.py")):
        importlib.import_module(f"megatron_ext.{path.parent.name}.{REGISTRATION_MODULE}")
