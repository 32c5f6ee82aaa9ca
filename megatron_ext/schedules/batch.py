"""Global-batch schedules: which global batch each optimizer step uses, as a table of stages.

Two ways to write one, both resolved into the same :class:`Stage` table:

- **doubling ramp** (:class:`DoublingRamp`, ``training.batch_ramp``): start at ``B₀``, double
  every ``S`` optimizer steps, capped at the target batch ``B`` (``training.global_batch_size``);
  the ramp's horizon is ``S`` times the number of doublings.
- **megatron-core 0.19's string** (:class:`StepSchedule` from :func:`parse_step_schedule`,
  ``training.step_batch_size_schedule``), read as ``StepBatchsizeNumMicroBatchesCalculator``
  reads it: entries ``THRESHOLD:BATCH`` separated by spaces or commas, both numbers with an
  optional ``K``/``M``/``B``/``T`` suffix (×10³, 10⁶, 10⁹, 10¹², case-insensitive, parsed as
  ``int(float(number) * multiplier)``); token thresholds become sample thresholds by floor
  division by the sequence length (Megatron-LM always passes ``seq_length``, so its thresholds
  are tokens; ``samples`` keeps them as samples, megatron-core's ``seq_length=None``); entries
  are sorted by threshold, the first must be 0 and the thresholds strictly increasing. The
  batch of a step is the one of the last entry whose threshold is ``<=`` the samples consumed
  *before* that step (megatron-core's ``update_num_microbatches(consumed_samples)`` before each
  step), so a stage starts at the first step at or past its threshold; the target batch is the
  last entry's (megatron-core's ``global_batch_size``).

Units: batches in sequences (samples), positions in optimizer steps and samples; tokens are
samples × ``seq_length``. No torch import: the launcher prints the table before any rank exists.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import Literal

from megatron_ext.errors import ConfigError

__all__ = [
    "BatchRule",
    "ConstantBatch",
    "DoublingRamp",
    "Stage",
    "StepSchedule",
    "ThresholdUnit",
    "parse_count",
    "parse_step_schedule",
    "resolve_stages",
]

ThresholdUnit = Literal["tokens", "samples"]
_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}
FIELD = "training.step_batch_size_schedule"


@dataclass(frozen=True)
class Stage:
    """One constant-batch stretch of a run.

    Attributes:
        first_step: optimizer steps completed before the stage's first step.
        first_sample: samples (sequences) consumed before it.
        global_batch: sequences per optimizer step in the stage.
    """

    first_step: int
    first_sample: int
    global_batch: int


def parse_count(text: str, what: str = FIELD) -> int:
    """A count with an optional K/M/B/T suffix, as megatron-core parses one (``"250B"`` ->
    250_000_000_000, ``"1.5k"`` -> 1500); a ConfigError naming ``what`` otherwise."""
    value = text.strip().upper()
    multiplier = _SUFFIXES.get(value[-1:], 1)
    if multiplier != 1:
        value = value[:-1]
    try:
        return int(float(value) * multiplier)
    except (ValueError, OverflowError):
        raise ConfigError(
            f"{what}: {text.strip()!r} is not a number with an optional K/M/B/T suffix"
        ) from None


def parse_step_schedule(
    text: str, seq_length: int, unit: ThresholdUnit = "tokens"
) -> list[tuple[int, int]]:
    """``"0:256 250B:512"`` -> ``[(threshold_samples, batch), ...]`` sorted by threshold."""
    entries = text.strip().replace(",", " ").split()
    if not entries:
        raise ConfigError(f"{FIELD} is empty: write THRESHOLD:BATCH entries, e.g. '0:256 250B:512'")
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise ConfigError(
                f"{FIELD}: entry {entry!r} is not THRESHOLD:BATCH (e.g. '0:256 250B:512')"
            )
        threshold_text, batch_text = entry.split(":", 1)
        threshold = parse_count(threshold_text)
        if unit == "tokens":
            threshold //= seq_length
        schedule.append((threshold, parse_count(batch_text)))
    schedule.sort(key=lambda pair: pair[0])
    if schedule[0][0] != 0:
        raise ConfigError(
            f"{FIELD}: the first threshold must be 0 (the batch the run starts with), "
            f"got {schedule[0][0]} {unit}"
        )
    for (before, _), (after, _) in itertools.pairwise(schedule):
        if after <= before:
            raise ConfigError(
                f"{FIELD}: thresholds must be strictly increasing, got {before} then {after} "
                f"samples" + (f" (tokens // seq_length {seq_length})" if unit == "tokens" else "")
            )
    for threshold, batch in schedule:
        if batch <= 0:
            raise ConfigError(f"{FIELD}: the batch at threshold {threshold} must be >= 1")
    return schedule


@dataclass(frozen=True)
class ConstantBatch:
    """Every step at ``target`` sequences (no ramp)."""

    target: int

    def batch(self, step: int, consumed: int) -> int:
        return self.target

    def steps_to_change(self, step: int, consumed: int) -> int | None:
        return None


@dataclass(frozen=True)
class DoublingRamp:
    """``min(start · 2^(step // double_every), target)`` sequences at step ``step``."""

    start: int
    double_every: int  # optimizer steps
    target: int

    def __post_init__(self) -> None:
        if not 1 <= self.start <= self.target:
            raise ConfigError(
                f"training.batch_ramp.start={self.start} must be between 1 and the target "
                f"training.global_batch_size={self.target}"
            )
        if self.double_every < 1:
            raise ConfigError("training.batch_ramp.double_every must be >= 1 (optimizer steps)")

    @property
    def doublings(self) -> int:
        """Doublings until the target (the last one capped at it)."""
        n = 0
        while self.start << n < self.target:
            n += 1
        return n

    @property
    def horizon(self) -> int:
        """Optimizer steps before the first step at the target batch."""
        return self.doublings * self.double_every

    def batch(self, step: int, consumed: int) -> int:
        k = step // self.double_every
        return self.target if k >= self.doublings else min(self.start << k, self.target)

    def steps_to_change(self, step: int, consumed: int) -> int | None:
        if step >= self.horizon:
            return None
        return (step // self.double_every + 1) * self.double_every - step


@dataclass(frozen=True)
class StepSchedule:
    """megatron-core's step schedule: ``entries`` as :func:`parse_step_schedule` returns."""

    entries: tuple[tuple[int, int], ...]  # (threshold in samples, batch), sorted

    @property
    def target(self) -> int:
        """The last entry's batch (megatron-core's ``global_batch_size``)."""
        return self.entries[-1][1]

    def batch(self, step: int, consumed: int) -> int:
        thresholds = [t for t, _ in self.entries]
        return self.entries[bisect.bisect_right(thresholds, consumed) - 1][1]

    def steps_to_change(self, step: int, consumed: int) -> int | None:
        later = [t for t, _ in self.entries if t > consumed]
        if not later:
            return None
        return -(-(later[0] - consumed) // self.batch(step, consumed))  # ceil


BatchRule = ConstantBatch | DoublingRamp | StepSchedule


def resolve_stages(rule: BatchRule, steps: int) -> tuple[Stage, ...]:
    """The stages of the first ``steps`` optimizer steps under ``rule`` (at least one).

    Walks stage by stage: within a stage the batch is constant, so the next possible change is
    the next doubling, or the first step that starts at or past the next threshold.
    """
    stages = [Stage(0, 0, rule.batch(0, 0))]
    step, consumed = 0, 0
    while True:
        until = rule.steps_to_change(step, consumed)
        if until is None or step + until >= steps:
            return tuple(stages)
        consumed += until * stages[-1].global_batch
        step += until
        batch = rule.batch(step, consumed)
        if batch != stages[-1].global_batch:  # a threshold may repeat the current batch
            stages.append(Stage(step, consumed, batch))
