"""The recipe's core: the trainer-neutral fields every trainer's typed recipe extends.

A recipe is ``trainer``, ``run_dir``, ``seed`` and the run sections every trainer reads
(``logging``, ``checkpoint``, ``launch``): :class:`Recipe`. Each trainer declares its own recipe
as a subclass whose further fields are its sections (:mod:`megatron_ext.config.trainers`): the
ones it owns (GPT: ``model``, ``optimizer``, ``data``, ``training``, ``parallel``,
:mod:`megatron_ext.gpt.sections`; SOMA: ``soma``) and the ones of another trainer it reads
(SOMA: ``data.source``, the stop fields of ``training``). Every section is a dataclass, a typed
attribute (``recipe.training``); fields carry validation metadata (:func:`.fields.spec`) or a
``Literal`` type, read by :mod:`megatron_ext.config.load`. Cross-field rules are the trainer's
(its ``check``).

This module must not import torch: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_ext.config.fields import spec
from megatron_ext.errors import ConfigError

__all__ = ["CORE", "CheckpointConfig", "LaunchConfig", "LoggingConfig", "Recipe", "recipe_dict"]


@dataclass
class LoggingConfig:
    log_interval: int = spec(1, ge=1)
    tensorboard: bool = True
    progress_bar: Literal["auto", "on", "off"] = spec("auto")


@dataclass
class CheckpointConfig:
    save_interval: int = spec(0, ge=0, help="0 = only at the end")
    save_at_end: bool = True
    load: str = spec(
        "auto",
        help="'auto' = resume from run_dir/checkpoints if present; "
        "'none'; or a checkpoint directory (a step_000000 one gives only its weights)",
    )
    save_initial: bool = spec(False, help="also write step_000000 before the first step")
    keep_last: int = spec(2, ge=1, help="intact checkpoints kept (older ones are deleted)")
    verify: Literal["checksums", "sizes"] = spec(
        "checksums",
        help="before loading: each file's size and CRC-32 against manifest.json, or sizes only",
    )


@dataclass
class LaunchConfig:
    nproc_per_node_cpu: int = spec(2, ge=1, help="ranks per node on a CPU-only host")
    master_port: int = spec(29500, ge=1, le=65535)
    threads_per_rank: int = spec(0, ge=0, help="torch threads per rank; 0 = cores / ranks")
    # Multi-node: how long a lost peer or a partitioned network may go unnoticed. Without
    # them a partition holds every rank in a collective (and every torchrun at its store)
    # for torch's defaults, 10 minutes and more.
    collective_timeout_s: float = spec(
        0.0,
        ge=0,
        help="seconds a collective may wait for a peer before the rank fails (the process "
        "groups' timeout); 0 = the trainer's default (GPT, DiPaCo 600, SOMA 1800)",
    )
    rdzv_timeout_s: int = spec(
        600,
        ge=1,
        help="multi-node: seconds torchrun waits for every node to join the rendezvous, and "
        "for any one call to the rendezvous store on node 0 (torchrun's join_timeout, "
        "read_timeout)",
    )
    max_restarts: int = spec(
        0,
        ge=0,
        help="torchrun's elastic restarts: after a rank fails, restart every node's ranks "
        "up to N times (they resume from the last checkpoint, checkpoint.load=auto)",
    )


@dataclass(kw_only=True)
class Recipe:
    """A whole run: the trainer-neutral core every trainer's recipe extends.

    Each trainer declares its recipe as a subclass (``GPTRecipe`` in
    :mod:`megatron_ext.gpt.recipe`, ``SomaRecipe``, ``DipacoRecipe``) whose further fields are
    its sections, typed (``recipe.training`` is a ``TrainingConfig``), and registers it
    (:class:`~megatron_ext.config.trainers.TrainerSpec` ``recipe``). The loader builds the
    subclass the recipe's ``trainer:`` names (:func:`megatron_ext.config.load.read_recipe`)."""

    trainer: str = spec("gpt", help="a registered trainer (megatron_ext.config.trainers)")
    run_dir: str = spec("runs/default", help="logs, plots, checkpoints, summary.json")
    seed: int = spec(
        1234, ge=0, help="the run's one seed: initialisation, data order, probes, routing"
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)

    def __post_init__(self) -> None:
        from megatron_ext.config.trainers import get_trainer  # the registry reads this module

        expected = get_trainer(self.trainer).recipe
        if type(self) is not expected:
            raise ConfigError(
                f"a trainer={self.trainer} recipe is a {expected.__name__}, not a "
                f"{type(self).__name__}: build {expected.__name__}(...) (or read the recipe "
                "with megatron_ext.config.load.read_recipe)"
            )

    @property
    def sections(self) -> dict[str, Any]:
        """The trainer's sections by name (``"training"`` -> its ``TrainingConfig``): the
        fields a trainer's recipe adds to this core (read-only: a copy)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in CORE
        }

    def section[T](self, kind: type[T]) -> T:
        """This recipe's section of type ``kind``, e.g. ``recipe.section(SomaConfig)``."""
        for value in self.sections.values():
            if isinstance(value, kind):
                return value
        raise KeyError(f"a trainer={self.trainer} recipe has no {kind.__name__} section")

    def check(self, world_size: int | None = None) -> None:
        """The trainer's cross-field rules (its registered ``check``); raises ``ConfigError``.
        ``world_size`` adds the layout checks. Reads the recipe, changes nothing."""
        from megatron_ext.config.trainers import get_trainer  # the registry reads this module

        get_trainer(self.trainer).check(self, world_size)


#: The fields of the trainer-neutral core (every other field of a recipe is a trainer's section).
CORE = tuple(f.name for f in dataclasses.fields(Recipe))


def recipe_dict(recipe: Recipe) -> dict[str, Any]:
    """The recipe as plain data in the layout checkpoint manifests and DiPaCo's run
    fingerprint have always hashed: the core fields, then ``sections`` by name, the optimizer's
    options flat (``muon_momentum``) as a recipe writes them."""
    out = {
        name: dataclasses.asdict(v)
        if dataclasses.is_dataclass(v) and not isinstance(v, type)
        else v
        for name in CORE
        for v in [getattr(recipe, name)]
    }
    sections: dict[str, Any] = {}
    for name, value in recipe.sections.items():
        flat = getattr(value, "flat", None)
        sections[name] = flat() if callable(flat) else dataclasses.asdict(value)
    out["sections"] = sections
    return out
