"""``megatron-ext bench paper optimizers``: its arms are built as the SOAP/Muon paper defines them
(in-process, from the recipes the launcher would load), and its spike count does what its
definition says on curves with planted spikes.

- batch sweep: every arm consumes the same tokens (``base_steps·B·seq``, written out here), its
  warmup and WSD window sit on the same tokens; ``const`` arms keep the 1× LR and one batch,
  ``ramp`` arms double from the 1× batch every ``ramp_double_every`` steps to k·B with the warmup
  tied to the ramp and η(B) = η₁·√(B/B₁) at every stage (Sec. 3.2 Eq. 3, Sec. 5.3);
- stability arms: the stale arm builds a KL-SOAP whose refresh runs every 10 steps from factors
  without the current gradient (``stale_refresh``; its semantics are tested against the reference
  in tests/test_optim_kl_soap.py), the per-step arms refresh every step; factor updates and
  refresh modes as named.
"""

from __future__ import annotations

import math
import random

import pytest

from megatron_ext.bench.paper._optimizers_arms import (
    CLAIM_SWEEP_ARMS,
    GRAD_SPIKE_RISE,
    LOSS_SPIKE_RISE,
    MULTS,
    OPTIMIZERS,
    RECIPE,
    SCALES,
    Arm,
    arm_overrides,
    arms,
    final_loss,
    lr_name,
    smoothed_tokens_to,
    spike_onsets,
)
from megatron_ext.config.load import load_recipe
from megatron_ext.schedules.plan import training_schedule


def _schedule(scale_name: str, arm: Arm):
    scale = SCALES[scale_name]
    recipe = load_recipe(RECIPE, arm_overrides(scale, arm, seed=1))
    return recipe, training_schedule(recipe.training, recipe.optimizer)


@pytest.mark.parametrize("size", ["quick", "full"])
def test_every_arm_consumes_the_same_tokens_on_the_same_schedule(size: str) -> None:
    scale = SCALES[size]
    tokens = scale.base_steps * scale.base_batch * scale.seq_length  # the 1× run's
    all_arms = arms(scale)
    sweep = [a.name for a in all_arms if a.name.startswith("sweep.")]
    lr_sweep = [a for a in all_arms if a.name.startswith("lr.")]
    # the 1× point of every optimizer at each LR of the grid (the batch sweep's 1× is one of them)
    assert {(a.optimizer, a.lr_mult, a.mult) for a in lr_sweep} == {
        (o, m, 1) for o in OPTIMIZERS for m in scale.lr_grid
    }
    if scale.grid == "all":  # 2× and 4× with and without the ramp, per optimizer
        assert len(sweep) == len(OPTIMIZERS) * 2 * (len(MULTS) - 1) == 16
    else:  # the arms a claim reads
        assert set(sweep) == CLAIM_SWEEP_ARMS and len(sweep) == 8
    assert len(all_arms) == len(lr_sweep) + len(sweep) + 8  # 4 stability arms at 2 LRs
    for arm in all_arms:
        recipe, sched = _schedule(size, arm)
        assert sched.total_tokens == tokens, arm.name
        assert recipe.training.global_batch_size == arm.mult * scale.base_batch, arm.name
        assert recipe.optimizer.name == arm.optimizer and recipe.seed == 1
        assert recipe.data.source == ["python-docs"]
        # the WSD window is the last wsd_decay_steps·B·seq tokens at every batch
        wsd = sched.lr.wsd_decay_steps
        assert wsd == scale.wsd_decay_steps * scale.base_batch * scale.seq_length, arm.name
        if not arm.ramp:  # the warmup covers the same tokens as the 1× run's
            assert sched.lr.warmup_steps == scale.warmup_steps * scale.base_batch * (
                scale.seq_length
            ), arm.name


@pytest.mark.parametrize("size", ["quick", "full"])
def test_const_arms_keep_one_batch_and_the_chosen_lr(size: str) -> None:
    scale = SCALES[size]
    best = {o: scale.lr_grid[i % len(scale.lr_grid)] for i, o in enumerate(OPTIMIZERS)}
    for arm in arms(scale, best):
        if arm.ramp or arm.name.startswith("stab"):
            continue
        recipe, sched = _schedule(size, arm)
        assert {s.global_batch for s in sched.run_stages()} == {arm.mult * scale.base_batch}
        assert sched.steps == scale.base_steps // arm.mult
        # the LR sweep at its grid point; the batch sweep at the optimizer's chosen LR
        lr = scale.lr * (arm.lr_mult if arm.name.startswith("lr.") else best[arm.optimizer])
        assert arm.name.startswith("lr.") or arm.lr_mult == best[arm.optimizer]
        assert recipe.optimizer.lr == pytest.approx(lr, rel=1e-12) and not sched.sqrt_lr
        stable = scale.warmup_steps // arm.mult  # the first step after the warmup
        assert sched.lr_at(stable) == pytest.approx(lr, rel=1e-12), arm.name
        # validation after the last step only, on the same sequences at every batch
        assert recipe.training.eval_interval == 0
        assert recipe.training.eval_iters * recipe.training.global_batch_size == (
            scale.val_sequences
        )


@pytest.mark.parametrize("size", ["quick", "full"])
def test_ramp_arms_double_from_the_baseline_batch_with_sqrt_b_lr(size: str) -> None:
    scale = SCALES[size]
    ramp_arms = [a for a in arms(scale) if a.ramp]
    if scale.grid == "all":
        assert {(a.optimizer, a.mult) for a in ramp_arms} == {
            (o, k) for o in OPTIMIZERS for k in (2, 4)
        }
    for arm in ramp_arms:
        recipe, sched = _schedule(size, arm)
        k, b1, every = arm.mult, scale.base_batch, scale.ramp_double_every
        # stages: B₁, 2B₁, ... up to k·B₁, each (but the last) ramp_double_every steps long
        stages = sched.run_stages()
        assert [s.global_batch for s in stages] == [b1 * 2**i for i in range(int(math.log2(k)) + 1)]
        assert [s.first_step for s in stages] == [i * every for i in range(len(stages))]
        assert recipe.optimizer.lr == pytest.approx(scale.lr * math.sqrt(k), rel=1e-12)
        assert sched.sqrt_lr
        # warmup tied to the ramp: it ends on the first token at the target batch
        assert sched.lr.warmup_steps == sched.tokens_before(stages[-1].first_step)
        # at every stage η = η₁·√(B/B₁) times the token schedule's shape
        for s in stages:
            step = s.first_step + 1
            shape = sched.lr.lr_at(sched.tokens_before(step)) / recipe.optimizer.lr
            expected = scale.lr * math.sqrt(s.global_batch / b1) * shape
            assert sched.lr_at(step) == pytest.approx(expected, rel=1e-12), (arm.name, s)
        # after the ramp and the warmup, before the WSD window: √k × the 1× LR
        last = stages[-1].first_step + 1
        assert sched.lr_at(last) == pytest.approx(scale.lr * math.sqrt(k), rel=1e-12)


def _optimizer_group(arm: Arm) -> dict:
    import torch

    recipe, _ = _schedule("quick", arm)
    spec = recipe.optimizer.spec
    opt = spec.optimizer_class()(
        [torch.nn.Parameter(torch.zeros(4, 3))], **spec.kwargs(recipe.optimizer)
    )
    return opt.param_groups[0]


def test_stability_arms_set_the_refresh_and_factors_the_paper_compares() -> None:
    scale = SCALES["quick"]
    stab = {a.name: a for a in arms(scale) if a.name.startswith("stab.")}
    assert set(stab) == {
        "stab.soap_stale",
        "stab.soap_per_step",
        "stab.kl_soap_qr",
        "stab.kl_soap_eigh",
    }
    # the same four arms at the reference LR (both settings are reported)
    stab1x = {a.name: a for a in arms(scale) if a.name.startswith("stab1x.")}
    assert {n.replace("stab1x.", "stab.") for n in stab1x} == set(stab)
    for arm in stab.values():
        recipe, _ = _schedule("quick", arm)
        assert arm.optimizer == "kl_soap" and arm.mult == scale.spike_mult
        assert recipe.optimizer.lr == pytest.approx(scale.lr * scale.spike_lr_mult)
    full = SCALES["full"]
    for arm in arms(full):
        if arm.name.startswith("stab"):
            recipe, _ = _schedule("full", arm)
            mult = 1.0 if arm.name.startswith("stab1x.") else full.spike_lr_mult
            assert recipe.optimizer.lr == pytest.approx(full.lr * mult), arm.name
    # KL-SOAP at the spike setting is the sweep's 4× run when the setting is 4× at 1× LR: one run
    same = arm_overrides(scale, stab["stab.kl_soap_qr"], 1) == arm_overrides(
        scale, next(a for a in arms(scale) if a.name == "sweep.kl_soap.4x.const"), 1
    )
    assert same == (scale.spike_mult == 4 and scale.spike_lr_mult == 1)
    want = {  # refresh_every, stale_refresh, factor_update, refresh_mode
        "stab.soap_stale": (10, True, "shampoo", "qr"),
        "stab.soap_per_step": (1, False, "shampoo", "qr"),
        "stab.kl_soap_qr": (1, False, "kl", "qr"),
        "stab.kl_soap_eigh": (1, False, "kl", "eigh"),
    }
    for name, (every, stale, factors, mode) in want.items():
        g = _optimizer_group(stab[name])
        got = (g["refresh_every"], g["stale_refresh"], g["factor_update"], g["refresh_mode"])
        assert got == (every, stale, factors, mode), name


def test_spike_count_finds_the_planted_spikes() -> None:
    rng = random.Random(0)
    # a decaying loss with ±1% noise: no spike under a +5% rule
    base = [3.0 * math.exp(-t / 80) + 1.0 + 0.01 * rng.uniform(-1, 1) for t in range(200)]
    assert spike_onsets(base, LOSS_SPIKE_RISE) == []
    planted = list(base)
    for t in (40, 90, 150):
        planted[t] *= 1.2
    assert spike_onsets(planted, LOSS_SPIKE_RISE) == [40, 90, 150]
    # a spike lasting 3 steps is one onset; one inside the first window is not judged
    wide = list(base)
    for t in (60, 61, 62):
        wide[t] *= 1.3
    wide[5] *= 2
    assert spike_onsets(wide, LOSS_SPIKE_RISE) == [60]
    # +4% is below the loss rule; a gradient norm needs more than twice the median
    assert spike_onsets([1.0] * 30 + [1.04] + [1.0] * 5, LOSS_SPIKE_RISE) == []
    assert spike_onsets([1.0] * 30 + [2.0, 1.0, 2.01] + [1.0] * 5, GRAD_SPIKE_RISE) == [32]
    assert spike_onsets([1.0] * 25 + [float("nan")] * 3, LOSS_SPIKE_RISE) == [25]


def test_final_loss_spans_the_same_tokens_at_every_batch() -> None:
    # 1×: 10 steps of 10 tokens; 2×: 5 steps of 20; the last 20% of tokens is 2 steps vs 1 step
    assert final_loss([10 * (i + 1) for i in range(10)], list(range(10)), 0.2) == 8.5
    assert final_loss([20 * (i + 1) for i in range(5)], [0, 0, 0, 0, 7.0], 0.2) == 7.0


def test_smoothed_tokens_to_a_target_reads_the_same_token_window_at_every_batch() -> None:
    # 1×: 10 steps of 10 tokens, loss 10, 9, ..., 1; the window is the last 20 tokens (2 steps)
    tokens, loss = [10 * (i + 1) for i in range(10)], [10.0 - i for i in range(10)]
    assert smoothed_tokens_to(tokens, loss, 5.5, 0.2) == 60  # mean(6, 5) = 5.5 at 60 tokens
    assert smoothed_tokens_to(tokens, loss, 0.5, 0.2) == math.inf  # never within the run
    # 2×: 5 steps of 20 tokens: the same 20-token window is one step
    assert smoothed_tokens_to([20 * (i + 1) for i in range(5)], [9, 7, 5, 3, 1], 5, 0.2) == 60


def test_the_lr_is_chosen_on_mean_validation_loss_and_a_diverged_run_never_wins() -> None:
    from megatron_ext.bench.paper.optimizers import choose_lr

    scale = SCALES["quick"]
    lo, mid, hi = scale.lr_grid
    val = {lo: (3.0, 3.2), mid: (2.0, 2.4), hi: (1.0, float("nan"))}  # hi diverged in seed 2
    results = {
        lr_name(o, m): {str(s + 1): {"val_loss": v[s]} for s in range(2)}
        for o in OPTIMIZERS
        for m, v in val.items()
    }
    assert choose_lr(scale, results) == {o: mid for o in OPTIMIZERS}
    results[lr_name("muon", lo)] = {"1": {"val_loss": 1.5}, "2": {"val_loss": 1.6}}
    assert choose_lr(scale, results)["muon"] == lo
