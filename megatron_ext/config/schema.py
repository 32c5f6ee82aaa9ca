"""The recipe's core: the trainer-neutral sections, and the trainer's sections by name.

A recipe is ``trainer``, ``run_dir``, ``seed`` and the run sections every trainer reads
(``logging``, ``checkpoint``, ``launch``), plus the sections the selected trainer declares in its
registration (:mod:`megatron_ext.config.trainers`): the ones it owns (GPT: ``model``,
``optimizer``, ``data``, ``training``, ``parallel``, :mod:`megatron_ext.gpt.sections`; SOMA:
``soma``) and the ones of another trainer it reads (SOMA: ``data.source``, the stop fields of
``training``). Each is a dataclass, read as an attribute (``recipe.training``);
fields carry validation metadata (:func:`.fields.spec`) or a ``Literal`` type, read by
:mod:`megatron_ext.config.load`. Cross-field rules are the trainer's (its ``check``).

This module must not import torch: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from megatron_ext.config.fields import spec
from megatron_ext.config.trainers import get_trainer, recipe_sections

__all__ = ["CheckpointConfig", "LaunchConfig", "LoggingConfig", "Recipe"]


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


@dataclass
class Recipe:
    """A whole run: the object every trainer receives.

    ``sections``: the selected trainer's sections by name (``"training"`` ->
    ``TrainingConfig``), each also an attribute (``recipe.training``); built from their
    defaults when not given. A section the trainer does not read is not there."""

    trainer: str = spec("gpt", help="a registered trainer (megatron_ext.config.trainers)")
    run_dir: str = spec("runs/default", help="logs, plots, checkpoints, summary.json")
    seed: int = spec(
        1234, ge=0, help="the run's one seed: initialisation, data order, probes, routing"
    )
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    sections: dict[str, Any] = field(default_factory=dict, metadata={"trainer_sections": True})

    def __post_init__(self) -> None:
        for name, config in recipe_sections(get_trainer(self.trainer)).items():
            self.sections.setdefault(name, config())

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            return sections[name]
        if name.startswith("__") or sections is None:
            raise AttributeError(name)
        raise AttributeError(
            f"a trainer={self.__dict__.get('trainer')} recipe has no {name!r} section "
            f"(its sections: {', '.join(sections) or 'none'})"
        )

    def __setattr__(self, name: str, value: Any) -> None:
        sections = self.__dict__.get("sections")
        if sections is not None and name in sections:
            sections[name] = value
        else:
            object.__setattr__(self, name, value)

    def section[T](self, kind: type[T]) -> T:
        """This recipe's section of type ``kind``, e.g. ``recipe.section(SomaConfig)``."""
        for value in self.sections.values():
            if isinstance(value, kind):
                return value
        raise KeyError(f"a trainer={self.trainer} recipe has no {kind.__name__} section")

    def check(self, world_size: int | None = None) -> None:
        """The trainer's cross-field rules (its registered ``check``); raises ``ConfigError``.
        ``world_size`` adds the layout checks. Reads the recipe, changes nothing."""
        get_trainer(self.trainer).check(self, world_size)
