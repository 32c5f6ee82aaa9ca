"""The trainer registry: what ``trainer: NAME`` in a recipe means.

A trainer registers itself in its own package, in a torch-free module named ``recipe.py``
(``megatron_ext/soma/recipe.py``)::

    register_trainer(TrainerSpec(
        name="soma",
        train="megatron_ext.soma.trainer:train",   # imported only on the ranks that train
        check=check_soma,                          # cross-field rules; raise ConfigError
        section="soma",                            # the recipe's `soma:` section ...
        config=SomaConfig,                         # ... parsed into this dataclass
    ))

The recipe schema reads the registry (each registered section is a recipe section, each
trainer's ``check`` runs in ``Recipe.check``), and so does the launcher through it: a trainer
that is not registered fails at validation, before any process starts. The per-rank entry point
imports ``train`` and calls it with the validated recipe.

The registry finds the ``recipe.py`` modules beside this package on first use. Nothing here
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

__all__ = ["TrainerSpec", "get_trainer", "register_trainer", "trainer_sections", "trainers"]

REGISTRATION_MODULE = "recipe"  # megatron_ext/<package>/recipe.py registers a trainer

_TRAINERS: dict[str, TrainerSpec] = {}
_discovered = False


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """A trainer as the recipe and the entry point see it.

    ``train``: ``"module:function"``, the per-rank entry ``function(recipe)``. ``check(recipe,
    world_size)``: the trainer's cross-field rules (``world_size`` None: the rules that need no
    job size); raises ``ConfigError``. ``section``/``config``: the recipe section the trainer
    owns and the dataclass it is parsed into (None: the trainer uses only shared sections).
    ``reads``: the shared sections (``model``, ``optimizer``, ``data``, ``training``,
    ``parallel``) the trainer reads, each mapped to the fields it reads (None: all of them); a
    recipe that sets any other field of a shared section, or another trainer's own section, is
    refused before launch (:mod:`megatron_ext.config.reads`). The run sections (``run_dir``,
    ``logging``, ``checkpoint``, ``launch``) belong to every trainer.
    """

    name: str
    train: str
    check: Callable[[Recipe, int | None], None]
    section: str | None = None
    config: type | None = None
    reads: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.section is None) != (self.config is None):
            raise ValueError(f"trainer {self.name!r}: give both section and config, or neither")
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
    """Recipe section name -> the dataclass it is parsed into, for every registered trainer."""
    return {
        spec.section: spec.config
        for spec in trainers().values()
        if spec.section is not None and spec.config is not None
    }


def _discover() -> None:
    """Import every ``megatron_ext/<package>/recipe.py`` (each registers its trainer), once."""
    global _discovered
    if _discovered:
        return
    _discovered = True
    root = Path(__file__).resolve().parents[1]
    for path in sorted(root.glob(f"*/{REGISTRATION_MODULE}.py")):
        importlib.import_module(f"megatron_ext.{path.parent.name}.{REGISTRATION_MODULE}")
