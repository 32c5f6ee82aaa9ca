"""The GPT trainer's recipe sections: ``model``, ``data``, ``training`` and ``parallel`` (its
``optimizer`` section is :mod:`megatron_ext.config.optimizer`'s, built from the optimizer
registry). ``model`` and ``parallel`` are defined beside the model builder that reads them
(:mod:`megatron_ext.megatron.sections`) and exported here with the others.

The GPT trainer owns them (:mod:`megatron_ext.gpt.recipe` registers them); SOMA and DiPaCo
read some of their fields and say which (``TrainerSpec.reads``). Field names follow
megatron-core where a counterpart exists (``TransformerConfig``, ``OptimizerConfig``,
``DistributedDataParallelConfig``, ``OptimizerParamScheduler``); each field may carry
validation metadata (:func:`megatron_ext.config.fields.spec`), and a closed set of values is
its ``Literal`` type, owned by the module that implements it.

No torch import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from megatron_ext.config.fields import spec
from megatron_ext.data.kinds import TokenizerKind
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.sections import ModelConfig, ParallelConfig
from megatron_ext.run.precision import Precision
from megatron_ext.schedules.lr import DecayStyle, WsdDecayStyle

__all__ = ["BatchRampConfig", "DataConfig", "ModelConfig", "ParallelConfig", "TrainingConfig"]


@dataclass
class DataConfig:
    """Where tokens come from."""

    path: str = spec("", help="indexed-dataset prefix (<path>.bin/.idx)")
    source: list[str] = spec(
        [],
        help="text inputs built into `path` when it is missing; "
        "'python-stdlib' = the installed stdlib's docstrings",
    )
    tokenizer: TokenizerKind = spec("byte")
    tokenizer_model: str = spec(
        "", help="SentencePiece .model file, or a Hugging Face tokenizer's folder"
    )
    split: str = spec("98,2,0", help="train,valid,test weights")

    def __post_init__(self) -> None:
        # megatron-core reads up to three comma-separated weights (missing ones are 0); checked
        # here so a typo stops before launch, not in the ranks' dataset builder
        parts = self.split.split(",")
        try:
            weights = [float(w) for w in parts]
        except ValueError:
            weights = []
        if not 1 <= len(parts) <= 3 or len(weights) != len(parts) or min(weights, default=-1) < 0:
            raise ConfigError(
                f"data.split={self.split!r}: give up to three non-negative train,valid,test "
                "weights, e.g. 98,2,0"
            )
        if sum(weights) <= 0:
            raise ConfigError(f"data.split={self.split!r}: the weights sum to 0")


@dataclass
class BatchRampConfig:
    """A doubling global-batch ramp (:class:`megatron_ext.schedules.batch.DoublingRamp`)."""

    start: int = spec(0, ge=0, help="first global batch B0 (sequences); 0 = no ramp")
    double_every: int = spec(0, ge=0, help="optimizer steps between doublings, up to the target")
    warmup: Literal["ramp", "first_stage", "recipe"] = spec(
        "ramp",
        help="LR warmup ends where the ramp ends, at its first doubling, or at "
        "training.lr_warmup_steps",
    )


@dataclass
class TrainingConfig:
    """Loop length, batch and the LR schedule (``OptimizerParamScheduler`` names)."""

    # Megatron's linear ramp (megatron-core 0.19 ignores it): refused with the new fields' names.
    RENAMED: ClassVar[dict[str, list[str]]] = {
        "rampup_batch_size": ["batch_ramp", "step_batch_size_schedule"]
    }
    #: fields that moved out of the section (the recipe's core holds the one seed)
    MOVED: ClassVar[dict[str, str]] = {"seed": "seed"}

    steps: int = spec(100, ge=1, help="run length in optimizer steps (set by train_tokens)")
    train_tokens: int | None = spec(
        None, ge=1, help="run length in tokens: the first step count that reaches it"
    )
    micro_batch_size: int = spec(4, ge=1)
    global_batch_size: int = spec(8, ge=1, help="the target batch (sequences) of a ramp")
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)
    step_batch_size_schedule: str = spec(
        "", help="megatron-core's 'THRESHOLD:BATCH ...' (K/M/B/T suffixes); '' = none"
    )
    step_batch_size_schedule_unit: Literal["tokens", "samples"] = spec("tokens")
    batch_lr_scaling: Literal["sqrt", "none"] = spec(
        "sqrt", help="lr x sqrt(B / target B) at every batch stage"
    )
    seq_length: int = spec(128, ge=1)
    precision: Precision = spec(
        "fp32", help="megatron_ext.run.precision maps each to megatron-core"
    )
    num_layers_at_start_in_bf16: int = spec(
        0, ge=0, help="FP8/FP4: first transformer layers kept in BF16"
    )
    num_layers_at_end_in_bf16: int = spec(0, ge=0, help="FP8/FP4: last layers kept in BF16")
    lr_warmup_steps: int = spec(0, ge=0)
    lr_decay_style: DecayStyle = spec("cosine")
    lr_decay_steps: int | None = spec(None, ge=1, help="None = steps")
    lr_wsd_decay_steps: int | None = spec(None, ge=1, help="WSD: length of the final decay")
    # Megatron-LM's --lr-warmup-samples / --lr-decay-samples: positions in sequences, exact
    # where they end inside a step (its scheduler counts consumed samples)
    lr_warmup_samples: int | None = spec(
        None, ge=1, help="warmup length in sequences (instead of lr_warmup_steps)"
    )
    lr_decay_samples: int | None = spec(
        None, ge=1, help="decay end in sequences (instead of lr_decay_steps)"
    )
    lr_warmup_fraction: float | None = spec(
        None,
        gt=0.0,
        lt=1.0,
        help="Megatron-LM's --lr-warmup-fraction: the warmup as a fraction of the decay "
        "(instead of lr_warmup_steps)",
    )
    lr_wsd_decay_samples: int | None = spec(
        None, ge=1, help="WSD: the final decay in sequences (instead of lr_wsd_decay_steps)"
    )
    lr_wsd_decay_style: WsdDecayStyle = spec("minus_sqrt")
    eval_interval: int = spec(
        0, ge=0, help="validation loss every N steps (and after the last); 0 = after the last only"
    )
    eval_iters: int = spec(
        0, ge=0, help="global batches of the validation split; 0 = no validation"
    )
    # Stopping early, cleanly: save a checkpoint, exit 0 (megatron_ext.run.stopping)
    exit_interval: int | None = spec(
        None, ge=1, help="save and exit after a step divisible by N (Megatron-LM's name)"
    )
    exit_duration_in_mins: float | None = spec(
        None, gt=0, help="save and exit after N minutes of this run (Megatron-LM's name)"
    )
    exit_signals: list[str] = spec(
        ["SIGTERM", "SIGUSR1"],
        help="signals on which every rank finishes its step, saves and exits 0; [] = none",
    )
