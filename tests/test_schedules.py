"""LR schedules against closed forms written here (float64 numpy) and against megatron-core.

The reference below is written from the formulas (piecewise over a whole array of steps), not
from ``megatron_ext.schedules.lr``; megatron-core's ``OptimizerParamScheduler`` is the second,
independent oracle.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.recipe import GPTRecipe
from megatron_ext.gpt.sections import TrainingConfig
from megatron_ext.schedules import LRSchedule
from megatron_ext.schedules.plan import lr_schedule

MAX_LR, MIN_LR = 3e-3, 3e-4
WARMUP, DECAY, WINDOW = 10, 100, 30


def reference_lr(
    steps: np.ndarray,
    *,
    max_lr: float,
    min_lr: float,
    warmup: int,
    decay: int,
    style: str,
    window: int | None = None,
    wsd_style: str = "",
) -> np.ndarray:
    """Closed form, vectorised over ``steps`` (float64)."""
    s = steps.astype(np.float64)
    r = np.clip((s - warmup) / (decay - warmup), 0.0, 1.0)
    if style == "constant":
        coeff = np.ones_like(s)
    elif style == "linear":
        coeff = 1.0 - r
    elif style == "cosine":
        coeff = (1.0 + np.cos(np.pi * r)) / 2.0
    else:  # WSD: stable until the window [decay - window, decay], then wsd_style inside it
        w = np.clip((s - (decay - window)) / window, 0.0, 1.0)
        coeff = {
            "minus_sqrt": 1.0 - np.sqrt(w),
            "linear": 1.0 - w,
            "cosine": (1.0 + np.cos(np.pi * w)) / 2.0,
            "exponential": 2.0 * np.power(0.5, w) - 1.0,
        }[wsd_style]
    lr = min_lr + coeff * (max_lr - min_lr)
    if style != "constant":
        lr = np.where(s > decay, min_lr, lr)
    if warmup > 0:
        lr = np.where(s <= warmup, max_lr * s / warmup, lr)
    return lr


STYLES = [
    ("constant", None),
    ("linear", None),
    ("cosine", None),
    ("WSD", "minus_sqrt"),
    ("WSD", "linear"),
    ("WSD", "cosine"),
    ("WSD", "exponential"),
]


def _schedule(
    style: str, wsd_style: str | None, warmup: int = WARMUP, init_lr: float = 0.0
) -> LRSchedule:
    return LRSchedule(
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        warmup_steps=warmup,
        decay_steps=DECAY,
        decay_style=style,
        wsd_decay_steps=WINDOW if style == "WSD" else None,
        wsd_decay_style=wsd_style or "minus_sqrt",
        init_lr=init_lr,
    )


@pytest.mark.parametrize("warmup", [0, WARMUP])
@pytest.mark.parametrize(("style", "wsd_style"), STYLES)
def test_matches_closed_form(style: str, wsd_style: str | None, warmup: int) -> None:
    schedule = _schedule(style, wsd_style, warmup)
    steps = np.arange(DECAY + 20)
    got = np.array([schedule.lr_at(int(s)) for s in steps])
    want = reference_lr(
        steps,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        warmup=warmup,
        decay=DECAY,
        style=style,
        window=WINDOW,
        wsd_style=wsd_style or "",
    )
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=0.0)


@pytest.mark.parametrize(("style", "wsd_style"), STYLES)
def test_warmup_boundaries(style: str, wsd_style: str | None) -> None:
    schedule = _schedule(style, wsd_style)
    assert schedule.lr_at(0) == 0.0
    assert schedule.lr_at(1) == pytest.approx(MAX_LR / WARMUP, rel=1e-15)
    assert schedule.lr_at(WARMUP) == MAX_LR
    no_warmup = _schedule(style, wsd_style, warmup=0)
    assert no_warmup.lr_at(0) == MAX_LR


@pytest.mark.parametrize(("style", "wsd_style"), STYLES[1:])
def test_decaying_styles_end_at_min_lr(style: str, wsd_style: str | None) -> None:
    schedule = _schedule(style, wsd_style)
    assert schedule.lr_at(DECAY) == pytest.approx(MIN_LR, rel=1e-12)
    assert schedule.lr_at(DECAY + 1) == MIN_LR
    assert schedule.lr_at(10 * DECAY) == MIN_LR


def test_constant_ignores_decay_steps() -> None:
    schedule = _schedule("constant", None)
    assert schedule.lr_at(DECAY + 1) == MAX_LR
    assert schedule.lr_at(10 * DECAY) == MAX_LR


def test_cosine_midpoint() -> None:
    mid = WARMUP + (DECAY - WARMUP) // 2
    assert _schedule("cosine", None).lr_at(mid) == pytest.approx((MAX_LR + MIN_LR) / 2, rel=1e-12)


@pytest.mark.parametrize(
    ("wsd_style", "coeff_at_quarter"),
    [
        ("minus_sqrt", 0.5),  # 1 - sqrt(1/4)
        ("linear", 0.75),
        ("cosine", (1.0 + math.cos(math.pi / 4)) / 2.0),
        ("exponential", 2.0 * 0.5**0.25 - 1.0),
    ],
)
def test_wsd_window(wsd_style: str, coeff_at_quarter: float) -> None:
    window = 40  # divisible by 4, so a quarter of the window is a whole step
    start = DECAY - window
    schedule = LRSchedule(
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        warmup_steps=WARMUP,
        decay_steps=DECAY,
        decay_style="WSD",
        wsd_decay_steps=window,
        wsd_decay_style=wsd_style,
    )
    # stable phase: max_lr from the end of warmup to the start of the window, inclusive
    assert all(schedule.lr_at(s) == MAX_LR for s in range(WARMUP, start + 1))
    assert schedule.lr_at(start + 1) < MAX_LR
    want = MIN_LR + coeff_at_quarter * (MAX_LR - MIN_LR)
    assert schedule.lr_at(start + window // 4) == pytest.approx(want, rel=1e-12)
    assert schedule.lr_at(DECAY) == pytest.approx(MIN_LR, rel=1e-12)


class _DummyOptimizer:
    """All megatron-core's scheduler touches: ``param_groups``."""

    def __init__(self) -> None:
        self.param_groups: list[dict] = [{}]


@pytest.mark.parametrize("init_lr", [0.0, MAX_LR / 7])  # Megatron-LM's --lr-warmup-init
@pytest.mark.parametrize("warmup", [0, WARMUP])
@pytest.mark.parametrize(("style", "wsd_style"), STYLES)
def test_matches_megatron_core(
    style: str, wsd_style: str | None, warmup: int, init_lr: float
) -> None:
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    optimizer = _DummyOptimizer()
    theirs = OptimizerParamScheduler(
        optimizer,
        init_lr=init_lr,
        max_lr=MAX_LR,
        min_lr=MIN_LR,
        lr_warmup_steps=warmup,
        lr_decay_steps=DECAY,
        lr_decay_style=style,
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=DECAY,
        wd_incr_style="constant",
        wsd_decay_steps=WINDOW if style == "WSD" else None,
        lr_wsd_decay_style=wsd_style,
    )
    ours = _schedule(style, wsd_style, warmup, init_lr)
    if warmup:  # the warmup starts where megatron-core's does (the comparison can fail)
        assert ours.lr_at(0) == init_lr
    for step in range(DECAY + 20):
        # megatron-core's constructor applies step 0; each step(1) then advances by one
        assert ours.lr_at(step) == pytest.approx(
            optimizer.param_groups[0]["lr"], rel=1e-12, abs=0.0
        ), f"step {step}"
        theirs.step(1)


def test_recipe_builds_its_schedule_from_schema_names() -> None:
    training = TrainingConfig(
        steps=200,
        lr_warmup_steps=20,
        lr_decay_style="WSD",
        lr_wsd_decay_steps=50,
        lr_wsd_decay_style="cosine",
    )
    recipe = GPTRecipe(optimizer=OptimizerConfig(lr=1e-3, min_lr=1e-5), training=training)
    schedule = lr_schedule(recipe.training, recipe.optimizer)
    assert schedule == LRSchedule(
        max_lr=1e-3,
        min_lr=1e-5,
        warmup_steps=20,
        decay_steps=200,
        decay_style="WSD",
        wsd_decay_steps=50,
        wsd_decay_style="cosine",
    )
    training.lr_decay_steps = 120
    default = GPTRecipe(training=training)
    assert lr_schedule(training, default.optimizer).decay_steps == 120


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decay_style": "WSD"}, "lr_wsd_decay_steps"),
        (
            {"decay_style": "WSD", "wsd_decay_steps": DECAY - WARMUP + 1},
            rf"training\.lr_wsd_decay_steps={DECAY - WARMUP + 1}\) must fit between .* "
            rf"run at least {DECAY + 1} steps",
        ),
        (
            {"warmup_steps": DECAY},
            rf"training\.lr_warmup_steps={DECAY} must be below .* run at least {DECAY + 1} steps",
        ),
        ({"min_lr": 2 * MAX_LR}, "min_lr"),
        ({"decay_style": "step"}, "lr_decay_style"),
        (
            {"decay_style": "WSD", "wsd_decay_steps": 5, "wsd_decay_style": "sqrt"},
            "lr_wsd_decay_style",
        ),
    ],
)
def test_invalid_parameters(kwargs: dict, match: str) -> None:
    params = {
        "max_lr": MAX_LR,
        "min_lr": MIN_LR,
        "warmup_steps": WARMUP,
        "decay_steps": DECAY,
        **kwargs,
    }
    with pytest.raises(ConfigError, match=match):
        LRSchedule(**params)


def test_negative_step() -> None:
    with pytest.raises(ValueError, match="step must be >= 0"):
        _schedule("cosine", None).lr_at(-1)
