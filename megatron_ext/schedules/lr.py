"""Learning-rate schedules: linear warmup, then constant, linear, cosine or WSD decay.

The definitions are megatron-core's ``OptimizerParamScheduler.get_lr`` (0.19), restated as a pure
function of the step so that a checkpoint only needs the step to restore the schedule:

- **warmup** (``0 <= step <= warmup_steps``, only when ``warmup_steps > 0``):
  ``lr = init_lr + (max_lr - init_lr) * step / warmup_steps``, megatron-core's
  ``OptimizerParamScheduler``; ``init_lr`` is Megatron-LM's ``--lr-warmup-init``
  (``training.lr_warmup_init``, default 0); it reaches ``max_lr`` exactly at
  ``step == warmup_steps``.
- **constant**: ``max_lr`` after warmup, forever (``min_lr`` and ``decay_steps`` are unused).
- past ``decay_steps``: ``min_lr``.
- otherwise ``lr = min_lr + coeff * (max_lr - min_lr)`` with the decay progress
  ``r = (step - warmup_steps) / (decay_steps - warmup_steps)`` in [0, 1] and

  - ``linear``: ``coeff = 1 - r``
  - ``cosine``: ``coeff = (1 + cos(π r)) / 2``
  - ``WSD`` (warmup–stable–decay): ``coeff = 1`` up to the start of the final decay window
    ``decay_steps - wsd_decay_steps``; inside the window, with ``w`` the progress through it
    (``0`` at its start, ``1`` at ``decay_steps``), ``coeff`` is

    - ``minus_sqrt``: ``1 - sqrt(w)``
    - ``linear``: ``1 - w``
    - ``cosine``: ``(1 + cos(π w)) / 2``
    - ``exponential``: ``2 · 0.5^w - 1``

Positions are integers in one unit: optimizer steps here (``lr_at(s)`` is the rate used by the
update that follows ``s`` completed steps; megatron-core's scheduler holds ``num_steps = s`` at
that point), consumed tokens in the GPT trainer's :class:`~.plan.TrainingSchedule`. Every rate
is a function of integer ratios only, so the same schedule in steps and in tokens at a constant
batch gives the same floats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from megatron_ext.errors import ConfigError

DecayStyle = Literal["constant", "linear", "cosine", "WSD"]
WsdDecayStyle = Literal["minus_sqrt", "linear", "cosine", "exponential"]


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate as a function of the optimizer step (stateless, torch-free).

    Args:
        max_lr: peak learning rate, reached at the end of warmup.
        min_lr: floor the decay ends at (``0 <= min_lr <= max_lr``).
        warmup_steps: length of the linear warmup from ``init_lr``; 0 = start at ``max_lr``.
        decay_steps: step at which the decay reaches ``min_lr`` (``> warmup_steps``).
        decay_style: shape of the decay after warmup.
        wsd_decay_steps: WSD only: length of the final decay window, which ends at
            ``decay_steps`` and must fit after warmup.
        wsd_decay_style: WSD only: shape of the decay inside that window.
        init_lr: where the warmup starts (megatron-core's ``init_lr``; ``>= 0``).
    """

    max_lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int
    decay_style: DecayStyle = "cosine"
    wsd_decay_steps: int | None = None
    wsd_decay_style: WsdDecayStyle = "minus_sqrt"
    init_lr: float = 0.0

    def __post_init__(self) -> None:
        # Messages use the recipe's field names: that is where these numbers come from.
        if self.decay_style not in get_args(DecayStyle):
            raise ConfigError(
                f"training.lr_decay_style={self.decay_style!r} is not one of "
                f"{', '.join(get_args(DecayStyle))}"
            )
        if self.wsd_decay_style not in get_args(WsdDecayStyle):
            raise ConfigError(
                f"training.lr_wsd_decay_style={self.wsd_decay_style!r} is not one of "
                f"{', '.join(get_args(WsdDecayStyle))}"
            )
        if not 0.0 <= self.min_lr <= self.max_lr:
            raise ConfigError(
                f"optimizer.min_lr={self.min_lr} must lie in [0, optimizer.lr={self.max_lr}]: "
                "lower optimizer.min_lr"
            )
        if not 0 <= self.warmup_steps < self.decay_steps:
            raise ConfigError(
                f"training.lr_warmup_steps={self.warmup_steps} must be below the step where the "
                f"decay ends, {self.decay_steps} (training.lr_decay_steps; training.steps when "
                f"unset): lower training.lr_warmup_steps, or run at least "
                f"{self.warmup_steps + 1} steps"
            )
        if self.decay_style == "WSD":
            room = self.decay_steps - self.warmup_steps
            if self.wsd_decay_steps is None or not 1 <= self.wsd_decay_steps <= room:
                fit = self.warmup_steps + (self.wsd_decay_steps or 1)
                raise ConfigError(
                    f"training.lr_decay_style=WSD: the final decay window "
                    f"(training.lr_wsd_decay_steps={self.wsd_decay_steps}) must fit between the "
                    f"warmup's end (training.lr_warmup_steps={self.warmup_steps}) and the "
                    f"decay's end ({self.decay_steps}: training.lr_decay_steps; training.steps "
                    f"when unset), which leaves {room}: shorten either, or run at least "
                    f"{fit} steps"
                )

    def lr_at(self, step: int) -> float:
        """Learning rate for the update after ``step`` completed optimizer steps (``step >= 0``)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self.warmup_steps > 0 and step <= self.warmup_steps:
            # The fraction first (megatron-core multiplies first; <= 1 ulp apart): positions in
            # other units (tokens = steps x batch x seq) then give this rate bit for bit.
            # init_lr = 0 (the default) gives max_lr * fraction exactly (0.0 + x == x)
            return self.init_lr + (self.max_lr - self.init_lr) * (step / self.warmup_steps)
        if self.decay_style == "constant":
            return self.max_lr
        if step > self.decay_steps:
            return self.min_lr
        return self.min_lr + self._decay_coeff(step) * (self.max_lr - self.min_lr)

    def _decay_coeff(self, step: int) -> float:
        """Fraction of ``max_lr - min_lr`` left at ``warmup_steps <= step <= decay_steps``."""
        if self.decay_style == "WSD":
            assert self.wsd_decay_steps is not None  # checked in __post_init__
            window_start = self.decay_steps - self.wsd_decay_steps
            if step <= window_start:
                return 1.0
            return _wsd_coeff(self.wsd_decay_style, (step - window_start) / self.wsd_decay_steps)
        progress = (step - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        if self.decay_style == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine


def _wsd_coeff(style: WsdDecayStyle, progress: float) -> float:
    """WSD's final-decay coefficient at ``progress`` ∈ [0, 1] through the window."""
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(progress)
    if style == "linear":
        return 1.0 - progress
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 2.0 * 0.5**progress - 1.0  # exponential: 1 at the start, 0 at the end
