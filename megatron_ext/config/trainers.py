"""The trainer registry: what ``trainer: NAME`` in a recipe means.

A trainer declares itself in its own package, in a torch-free module (``megatron_ext/soma/
recipe.py``), and registers that object as an entry point of the group
``megatron_ext.trainers`` (``soma = megatron_ext.soma.recipe:TRAINER`` in ``setup.py``, or in
another distribution's metadata: :mod:`megatron_ext.registry`)::

    @dataclass(kw_only=True)
    class SomaRecipe(Recipe):                      # its typed recipe: the core + its sections
        trainer: str = "soma"
        soma: SomaConfig = field(default_factory=SomaConfig)   # owned
        data: DataConfig = field(default_factory=DataConfig)   # read (GPT's)

    TRAINER = TrainerSpec(
        name="soma",
        train="megatron_ext.soma.trainer:train",   # imported only on the ranks that train
        check=check_soma,                          # cross-field rules; raise ConfigError
        recipe=SomaRecipe,
        reads={"data": ("source",)},               # what it reads of other trainers' sections
    )

The recipe schema reads the registry (a recipe holds its trainer's sections, its ``check`` is
``Recipe.check``), and so does the launcher through it: a trainer that is not registered fails
at validation, before any process starts. The per-rank entry point
imports ``train`` and calls it with the validated recipe.

The registry loads the entry points on first use. Nothing here imports torch: the launcher
validates recipes before any rank exists.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from megatron_ext.config.schema import CORE, Recipe
from megatron_ext.registry import Registry

__all__ = [
    "TRAINERS",
    "PlanKind",
    "TrainerSpec",
    "get_trainer",
    "recipe_sections",
    "register_trainer",
    "trainer_sections",
    "trainers",
]


#: How ``megatron-ext plan`` plans a trainer's recipe: ``"memory"``, memory, bytes and step time
#: per rank of the megatron-core GPT model its ``model``/``training``/``parallel``/``optimizer``
#: sections describe (:mod:`megatron_ext.planner.plan`); ``"outer"``, the bytes one outer round
#: moves through the run's store, from its ``dipaco`` section (:mod:`megatron_ext.planner.outer`).
PlanKind = Literal["memory", "outer"]


@dataclass(frozen=True, kw_only=True)
class TrainerSpec:
    """A trainer as the recipe and the entry point see it.

    ``train``: ``"module:function"``, the per-rank entry ``function(recipe)``. ``check(recipe,
    world_size)``: the trainer's cross-field rules (``world_size`` None: the rules that need no
    job size); raises ``ConfigError``. ``recipe``: its typed recipe, a ``kw_only`` subclass of
    :class:`~megatron_ext.config.schema.Recipe` whose further fields are its sections (each a
    dataclass, with a default) and whose ``trainer`` defaults to ``name``. ``reads``: which of
    those sections are another trainer's, each mapped to the fields it reads (None: all of
    them); a recipe that sets any other field of them, or a section the trainer does not read,
    is refused before launch (:mod:`megatron_ext.config.reads`); the rest it owns
    (:attr:`sections`). The run sections (``run_dir``, ``logging``, ``checkpoint``,
    ``launch``) belong to every trainer.

    Capabilities, what the commands that serve several trainers ask of one (they read these,
    never the trainer's name; a recipe of a trainer without one is refused in one line):
    ``plan``, how ``megatron-ext plan`` plans it (:data:`PlanKind`; None: no plan, and no fit
    check at launch); ``token_schedule``, its loop follows
    :func:`megatron_ext.schedules.plan.training_schedule` (LR and batch ramp on consumed
    tokens: the dry run's stage table, ``bench ramp``); ``converts_hf``, its checkpoints hold
    the megatron-core GPT model of its ``model`` section, which ``convert mcore-to-hf``
    writes as a Hugging Face model; ``trains_tokenizer``, it trains its SentencePiece
    ``data.tokenizer_model`` from ``data.source`` when that file is missing (so the launch
    does not ask for it).
    """

    name: str
    train: str
    check: Callable[[Any, int | None], None]  # (its recipe, world size)
    recipe: type[Recipe]
    reads: Mapping[str, tuple[str, ...] | None] = field(default_factory=dict)
    plan: PlanKind | None = None
    token_schedule: bool = False
    converts_hf: bool = False
    trains_tokenizer: bool = False

    def __post_init__(self) -> None:
        if self.train.count(":") != 1:
            raise ValueError(f"trainer {self.name!r}: train={self.train!r} is not module:function")
        if self.plan is not None and self.plan not in get_args(PlanKind):
            raise ValueError(
                f"trainer {self.name!r}: plan={self.plan!r} is not one of {get_args(PlanKind)}"
            )
        if not (isinstance(self.recipe, type) and issubclass(self.recipe, Recipe)):
            raise ValueError(f"trainer {self.name!r}: recipe must be a subclass of Recipe")
        default = next(f.default for f in dataclasses.fields(self.recipe) if f.name == "trainer")
        if default != self.name:
            raise ValueError(
                f"trainer {self.name!r}: {self.recipe.__name__}.trainer defaults to {default!r}"
            )
        missing = sorted(set(self.reads) - set(self.all_sections))
        if missing:
            raise ValueError(f"trainer {self.name!r} reads {missing}: not fields of its recipe")

    @property
    def all_sections(self) -> dict[str, type]:
        """Every section of its recipe, owned and read: name -> the dataclass."""
        hints = typing.get_type_hints(self.recipe)
        return {
            f.name: hints[f.name] for f in dataclasses.fields(self.recipe) if f.name not in CORE
        }

    @property
    def sections(self) -> dict[str, type]:
        """The sections it owns (not :attr:`reads`): name -> the dataclass."""
        return {n: t for n, t in self.all_sections.items() if n not in self.reads}

    def load_train(self) -> Callable[[Any], Any]:
        """Import the trainer's entry function (this is where torch gets imported)."""
        module, function = self.train.split(":")
        return getattr(importlib.import_module(module), function)


#: ``trainer: NAME`` -> its spec; the group ``megatron_ext.trainers``.
TRAINERS: Registry[TrainerSpec] = Registry(
    "trainer",
    "megatron_ext.trainers",
    of=TrainerSpec,
    key="trainer",
    shipped={name: f"megatron_ext.{name}.recipe:TRAINER" for name in ("dipaco", "gpt", "soma")},
)


def register_trainer(spec: TrainerSpec) -> TrainerSpec:
    """Add ``spec`` in-process (a test, a script); an installed package declares an entry point."""
    return TRAINERS.register(spec)


def trainers() -> Mapping[str, TrainerSpec]:
    """Every registered trainer by name (read-only view)."""
    return TRAINERS.items()


def get_trainer(name: str) -> TrainerSpec:
    """The trainer registered as ``name``; a ConfigError naming the registered ones if none."""
    return TRAINERS.get(name)


def trainer_sections() -> dict[str, type]:
    """Every registered trainer's own sections: name -> the dataclass it is parsed into."""
    owned: dict[str, type] = {}
    for spec in trainers().values():
        for name, config in spec.sections.items():
            if owned.setdefault(name, config) is not config:
                raise ValueError(f"recipe section {name!r} is owned by two trainers")
    return owned


def recipe_sections(spec: TrainerSpec) -> dict[str, type]:
    """The sections a ``spec.name`` recipe holds: its own and the ones it reads of others (each
    the class its owner parses it into)."""
    owned = trainer_sections()
    for name, kind in spec.all_sections.items():
        if name in spec.reads and owned.get(name) is not kind:
            raise ValueError(
                f"trainer {spec.name!r} reads {name!r}, which no trainer owns as {kind.__name__}"
            )
    return spec.all_sections
