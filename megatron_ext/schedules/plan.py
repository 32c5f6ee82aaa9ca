"""The GPT run's schedule: every step's global batch, consumed tokens and learning rate.

:func:`training_schedule` turns a recipe's ``training`` and ``optimizer`` sections (the only ones
it reads; every function here takes the sections, not the recipe) into a
:class:`TrainingSchedule`, the one object the GPT loop, its report, the launcher's dry run and
the checkpoint's loop state read:

- the **stage table** (:mod:`.batch`): ``training.batch_ramp`` or
  ``training.step_batch_size_schedule`` or one constant stage; the run is ``training.steps``
  optimizer steps (``training.train_tokens``, when set, gives that count: the first step count
  whose consumed tokens reach it), and step ``n`` starts after exactly
  ``tokens_before(n)`` tokens, summed over the stages;
- the **learning rate on consumed tokens**: megatron-core's warmup/decay shapes
  (:class:`~.lr.LRSchedule`) with every position in tokens, so under a ramp the decay ends on
  the run's last token. A position the recipe gives in steps (``lr_warmup_steps``,
  ``lr_decay_steps``, ``lr_wsd_decay_steps``) is the token count at that step of the stage
  table: the warmup covers exactly its first steps, the WSD window exactly the last ones, at any
  batch. ``training.batch_ramp.warmup`` ties the warmup to the ramp instead: ``ramp`` ends it on
  the first token at the target batch, ``first_stage`` at the first doubling;
- the **batch-size factor** ``η(B) = η_target · √(B / B_target)`` (``training.batch_lr_scaling:
  sqrt``) applied at every stage as a switch, on top of the token schedule, for every optimizer
  (one learning rate serves all of them: their updates are matched to AdamW's update RMS).

With a constant batch every token position is ``steps × batch × seq_length`` and every rate is
the step schedule's, bit for bit (the same integer ratios, divided once).

No torch import: the launcher prints the table before any rank exists.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_ext.errors import ConfigError
from megatron_ext.schedules.batch import (
    BatchRule,
    ConstantBatch,
    DoublingRamp,
    Stage,
    StepSchedule,
    parse_step_schedule,
    resolve_stages,
)
from megatron_ext.schedules.lr import LRSchedule

if TYPE_CHECKING:
    from megatron_ext.config.optimizer import OptimizerConfig

#: A recipe's ``training`` section (``megatron_ext.gpt.sections.TrainingConfig``, its batch, run
#: length and LR fields): the trainers that own it sit above this layer, so it is not named here.
TrainingSection = Any

__all__ = [
    "TrainingSchedule",
    "batch_rule",
    "lr_positions",
    "run_steps",
    "samples_at",
    "steps_for_samples",
    "training_schedule",
]


@dataclass(frozen=True)
class TrainingSchedule:
    """Batch, tokens and learning rate of every optimizer step of one run.

    Attributes:
        stages: the stage table up to ``horizon`` steps (the run, or the LR decay's end when it
            lies beyond the run), first stage at step 0.
        steps: the run's length in optimizer steps.
        seq_length: tokens per sequence.
        target_batch: ``B_target`` of the √B factor (sequences).
        lr: the learning rate at ``B_target`` as a function of consumed tokens.
        sqrt_lr: whether ``η(B) = η_target · √(B / B_target)`` applies.
        decoupled_lr: the word embeddings' and output layer's LR (``optimizer.decoupled_lr``,
            megatron-core's decoupled LR: ``lr``'s positions and style, its own peak and
            floor), or ``None`` when they follow ``lr``.
    """

    stages: tuple[Stage, ...]
    steps: int
    seq_length: int
    target_batch: int
    lr: LRSchedule
    sqrt_lr: bool = True
    decoupled_lr: LRSchedule | None = None

    def stage_index(self, step: int) -> int:
        """Index of the stage that optimizer step ``step`` (0-based) belongs to."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return bisect.bisect_right([s.first_step for s in self.stages], step) - 1

    def global_batch(self, step: int) -> int:
        """Sequences in optimizer step ``step`` (0-based)."""
        return self.stages[self.stage_index(step)].global_batch

    def samples_before(self, step: int) -> int:
        """Sequences consumed by the ``step`` steps before step ``step``."""
        if step == 0:
            return 0
        stage = self.stages[self.stage_index(step - 1)]
        return stage.first_sample + (step - stage.first_step) * stage.global_batch

    def tokens_before(self, step: int) -> int:
        """Tokens consumed by the ``step`` steps before step ``step``."""
        return self.samples_before(step) * self.seq_length

    @property
    def total_tokens(self) -> int:
        """Tokens of the whole run: the position of its last token."""
        return self.tokens_before(self.steps)

    def lr_factor(self, batch: int) -> float:
        """``√(batch / B_target)`` (1 without the √B rule)."""
        if not self.sqrt_lr or batch == self.target_batch:
            return 1.0
        return math.sqrt(batch / self.target_batch)

    def lr_at(self, step: int, decoupled: bool = False) -> float:
        """Learning rate of optimizer step ``step`` (0-based; after ``step`` completed steps):
        the token schedule at the tokens consumed before it, times the stage's √B factor.
        ``decoupled``: that of the decoupled-LR parameters (the run's LR without one)."""
        schedule = self.decoupled_lr if decoupled and self.decoupled_lr else self.lr
        rate = schedule.lr_at(self.tokens_before(step))
        factor = self.lr_factor(self.global_batch(step))
        return rate if factor == 1.0 else rate * factor

    def num_microbatches(self, step: int, micro_batch_size: int, dp_size: int) -> int:
        """Micro-batches per data-parallel rank in step ``step`` (the stage's batch split)."""
        return self.global_batch(step) // (micro_batch_size * dp_size)

    def check_resume(self, step: int, consumed_samples: int) -> None:
        """A checkpoint written after ``step`` steps and ``consumed_samples`` sequences must
        sit on this schedule (else its data position and LR would not continue the run)."""
        if self.samples_before(step) != consumed_samples:
            raise ConfigError(
                f"the checkpoint at step {step} consumed {consumed_samples:,} samples, but this "
                f"recipe's batch schedule consumes {self.samples_before(step):,} by then: the "
                f"batch schedule (training.global_batch_size, batch_ramp, "
                f"step_batch_size_schedule) changed since it was saved; restore it, or start a "
                f"new run_dir"
            )

    def run_stages(self) -> tuple[Stage, ...]:
        """The stages that hold at least one step of the run."""
        return tuple(s for s in self.stages if s.first_step < self.steps)


def batch_rule(t: TrainingSection) -> BatchRule:
    """The ``training`` section's batch rule: its ramp, its step schedule, or its constant
    batch."""
    ramp, text = t.batch_ramp, t.step_batch_size_schedule.strip()
    if ramp.start and text:
        raise ConfigError(
            "training.batch_ramp and training.step_batch_size_schedule both set a batch "
            "schedule: keep one"
        )
    if ramp.start:
        return DoublingRamp(ramp.start, ramp.double_every, t.global_batch_size)
    if text:
        unit = t.step_batch_size_schedule_unit
        return StepSchedule(tuple(parse_step_schedule(text, t.seq_length, unit)))
    return ConstantBatch(t.global_batch_size)


def run_steps(t: TrainingSection) -> int:
    """The run's optimizer steps: ``training.steps``, or the first count of steps whose
    consumed tokens reach ``training.train_tokens`` (the last step may pass it; as Megatron-LM
    counts ``--train-samples`` under a step schedule)."""
    if t.train_tokens is None:
        return t.steps
    return steps_for_samples(t, -(-t.train_tokens // t.seq_length))[0]


def steps_for_samples(t: TrainingSection, samples: int) -> tuple[int, bool]:
    """The first step count whose consumed samples reach ``samples`` (sequences) under the
    ``training`` section's batch rule, and whether it consumes exactly ``samples``."""
    rule = batch_rule(t)
    step, consumed = 0, 0
    while consumed < samples:
        batch = rule.batch(step, consumed)
        until = rule.steps_to_change(step, consumed)
        need = -(-(samples - consumed) // batch)
        take = need if until is None else min(until, need)
        step, consumed = step + take, consumed + take * batch
    return step, consumed == samples


def samples_at(t: TrainingSection, step: int) -> int:
    """Samples (sequences) consumed by the first ``step`` steps under the ``training``
    section's batch rule."""
    stages = resolve_stages(batch_rule(t), max(step, 1))
    stage = [s for s in stages if s.first_step < max(step, 1)][-1]
    return stage.first_sample + (step - stage.first_step) * stage.global_batch


def lr_schedule(t: TrainingSection, o: OptimizerConfig) -> LRSchedule:
    """The learning-rate schedule in optimizer steps that ``training`` and ``optimizer``
    describe (``training.lr_decay_steps`` None: the run's length, :func:`run_steps`); a
    ``ConfigError`` when it is inconsistent. The GPT trainer positions its LR on tokens
    (:func:`training_schedule`); DiPaCo's inner loop uses this one."""
    if (t.lr_warmup_samples, t.lr_decay_samples, t.lr_wsd_decay_samples, t.lr_warmup_fraction) != (
        None,
        None,
        None,
        None,
    ):
        raise ConfigError(
            "training.lr_*_samples position the LR in sequences: this "
            "trainer's schedule is in steps; use training.lr_warmup_steps / lr_decay_steps"
        )
    return LRSchedule(
        max_lr=o.lr,
        min_lr=o.min_lr,
        warmup_steps=t.lr_warmup_steps,
        decay_steps=run_steps(t) if t.lr_decay_steps is None else t.lr_decay_steps,
        decay_style=t.lr_decay_style,
        wsd_decay_steps=t.lr_wsd_decay_steps,
        wsd_decay_style=t.lr_wsd_decay_style,
        init_lr=t.lr_warmup_init,
    )


def training_schedule(t: TrainingSection, o: OptimizerConfig) -> TrainingSchedule:
    """The schedule of a recipe's ``training`` and ``optimizer`` sections, its length from
    :func:`run_steps` (``training.steps``, or the steps that reach ``training.train_tokens``);
    ConfigError when its positions do not fit, named in the recipe's fields."""
    rule = batch_rule(t)
    steps = run_steps(t)
    decay_steps, warmup_step = lr_positions(t)
    stages = resolve_stages(rule, max(steps, decay_steps))
    probe = TrainingSchedule(stages, steps, t.seq_length, rule.target, _placeholder())

    tokens = probe.tokens_before
    # a position in samples is exact (it may end inside a step); one in steps is that step's
    warmup_tokens: float = tokens(warmup_step)
    if t.lr_warmup_samples is not None:
        warmup_tokens = t.lr_warmup_samples * t.seq_length
    decay_tokens = tokens(decay_steps)
    if t.lr_decay_samples is not None:
        decay_tokens = t.lr_decay_samples * t.seq_length
    if t.lr_warmup_fraction is not None:  # Megatron-LM's: of the decay, not a whole step
        warmup_tokens = t.lr_warmup_fraction * decay_tokens
    wsd = None
    window = t.lr_wsd_decay_steps
    if t.lr_wsd_decay_samples is not None:  # the steps it covers, for the check below
        if window is not None:
            raise ConfigError(
                "training.lr_wsd_decay_steps and training.lr_wsd_decay_samples both set the WSD "
                "window: keep one"
            )
        end = decay_tokens // t.seq_length
        window = decay_steps - steps_for_samples(t, max(0, end - t.lr_wsd_decay_samples))[0]
    if t.lr_decay_style == "WSD" and window is not None:
        window_start = decay_steps - window
        if warmup_step > window_start:
            raise ConfigError(
                f"the warmup ends at step {warmup_step} (token {tokens(warmup_step):,}), after "
                f"the WSD decay window starts at step {window_start} (token "
                f"{tokens(window_start):,}): shorten the warmup or training.lr_wsd_decay_steps, "
                f"or run at least {warmup_step + window} steps"
            )
        wsd = decay_tokens - tokens(window_start)
        if t.lr_wsd_decay_samples is not None:
            wsd = t.lr_wsd_decay_samples * t.seq_length
    if warmup_step >= decay_steps:
        raise ConfigError(
            f"the warmup ends at step {warmup_step}, not before the decay ends at step "
            f"{decay_steps}: shorten the warmup (training.lr_warmup_steps or "
            f"training.batch_ramp.warmup), or run at least {warmup_step + 1} steps"
        )
    lr = LRSchedule(
        max_lr=o.lr,
        min_lr=o.min_lr,
        warmup_steps=warmup_tokens,
        decay_steps=decay_tokens,
        decay_style=t.lr_decay_style,
        wsd_decay_steps=wsd,
        wsd_decay_style=t.lr_wsd_decay_style,
        init_lr=t.lr_warmup_init,
    )
    sqrt_lr = t.batch_lr_scaling == "sqrt"
    decoupled = None
    if o.decoupled_lr is not None:  # megatron-core: the group's own max_lr / min_lr
        floor = o.min_lr if o.decoupled_min_lr is None else o.decoupled_min_lr
        decoupled = dataclasses.replace(lr, max_lr=o.decoupled_lr, min_lr=floor)
    return TrainingSchedule(stages, steps, t.seq_length, rule.target, lr, sqrt_lr, decoupled)


def lr_positions(t: TrainingSection) -> tuple[int, int]:
    """(the step the decay ends at, the step the warmup ends at): the ``training`` section's
    steps, or the first step whose consumed samples reach its sample counts
    (``lr_decay_samples``, ``lr_warmup_samples``); ConfigError when a position is given both
    ways."""
    if t.lr_warmup_fraction is not None and (t.lr_warmup_steps or t.lr_warmup_samples):
        raise ConfigError(
            f"training.lr_warmup_fraction={t.lr_warmup_fraction} and training.lr_warmup_steps/"
            "lr_warmup_samples both set the warmup: keep one"
        )
    for name in ("warmup", "decay"):
        given = getattr(t, f"lr_{name}_steps"), getattr(t, f"lr_{name}_samples")
        if given[1] is not None and given[0]:
            raise ConfigError(
                f"training.lr_{name}_steps={given[0]} and training.lr_{name}_samples={given[1]} "
                f"both set the {name}: keep one"
            )
    decay = run_steps(t) if t.lr_decay_steps is None else t.lr_decay_steps
    if t.lr_decay_samples is not None:
        decay = steps_for_samples(t, t.lr_decay_samples)[0]
    warmup = _warmup_step(t, batch_rule(t))
    if t.lr_warmup_samples is not None:
        warmup = steps_for_samples(t, t.lr_warmup_samples)[0]
    if t.lr_warmup_fraction is not None:
        decay_samples = t.lr_decay_samples or samples_at(t, decay)
        warmup = steps_for_samples(t, math.ceil(t.lr_warmup_fraction * decay_samples))[0]
    return decay, warmup


def _warmup_step(t: TrainingSection, rule: BatchRule) -> int:
    """Where the warmup ends, in steps: the ``training`` section's, or tied to the ramp."""
    tie = t.batch_ramp.warmup
    if not isinstance(rule, DoublingRamp) or tie == "recipe":
        return t.lr_warmup_steps
    if t.lr_warmup_steps:
        raise ConfigError(
            f"training.batch_ramp.warmup={tie} sets the warmup from the ramp, but "
            f"training.lr_warmup_steps={t.lr_warmup_steps} sets it too: set "
            f"training.lr_warmup_steps=0, or training.batch_ramp.warmup=recipe"
        )
    return rule.horizon if tie == "ramp" else min(rule.double_every, rule.horizon)


def _placeholder() -> LRSchedule:
    """An LR schedule for the probe that only converts steps to tokens."""
    return LRSchedule(max_lr=1.0, min_lr=0.0, warmup_steps=0, decay_steps=1)
