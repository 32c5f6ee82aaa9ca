"""Batch-size schedules (megatron_ext.schedules.batch/plan/table): megatron-core 0.19's step
schedule string read as megatron-core reads it, the doubling ramp, consumed tokens of every
step, the √B learning rate and the LR positions on tokens (WSD ends on the last token, exact
counts), the checks before launch, and the dry run's table and PNG.

The references below are written here from the definitions (per-step sums), not from the
stage walk of :mod:`megatron_ext.schedules.batch`; megatron-core's
``StepBatchsizeNumMicroBatchesCalculator`` and ``OptimizerParamScheduler`` are the oracles of
its semantics.
"""

from __future__ import annotations

import copy
import itertools
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.recipe import GPTRecipe
from megatron_ext.gpt.sections import BatchRampConfig, TrainingConfig
from megatron_ext.schedules.batch import (
    DoublingRamp,
    StepSchedule,
    parse_count,
    parse_step_schedule,
    resolve_stages,
)
from megatron_ext.schedules.plan import lr_schedule, run_steps, training_schedule
from megatron_ext.schedules.table import format_stage_table, stage_rows

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")


GPT_READS = (
    "trainer=gpt reads model, optimizer, data, training, parallel, "
    "and run_dir, seed, logging, checkpoint, launch"
)


def _recipe(**training) -> GPTRecipe:
    ramp = training.pop("batch_ramp", None)
    t = TrainingConfig(**training)
    if ramp is not None:
        t.batch_ramp = BatchRampConfig(**ramp)
    return GPTRecipe(optimizer=OptimizerConfig(lr=1e-2, min_lr=1e-3), training=t)


# --------------------------------------------------------------------------- the string


def _megatron_calculator(text: str, seq_length: int | None, mbs: int = 1, dp: int = 1):
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    return StepBatchsizeNumMicroBatchesCalculator(
        micro_batch_size=mbs,
        data_parallel_size=dp,
        decrease_batch_size_if_needed=False,
        rank=1,  # no logging
        schedule=text,
        seq_length=seq_length,
    )


@pytest.mark.parametrize(
    ("text", "unit"),
    [
        ("0:16 64K:32", "tokens"),
        ("0:8 1k:16, 3.5K:32", "tokens"),
        ("0:4,100:8,250:12 700:24", "samples"),
        ("  700:24 0:4 250:12 100:8 ", "samples"),  # unsorted: megatron-core sorts
        ("0:8 4000:8 9000:16", "tokens"),  # a threshold that keeps the batch: no new stage
        ("0:1K 0.5M:2k", "tokens"),  # suffixed batches too
    ],
)
def test_step_schedule_reads_as_megatron_core(text: str, unit: str) -> None:
    """The parsed thresholds, and every step's batch and micro-batch count over a run, equal
    megatron-core's calculator driven as Megatron-LM drives it (update with the consumed samples
    before each step)."""
    seq, mbs, dp, steps = 64, 2, 2, 400
    theirs = _megatron_calculator(text, seq if unit == "tokens" else None, mbs, dp)
    ours = parse_step_schedule(text, seq, unit)
    assert ours == theirs.schedule
    stages = resolve_stages(StepSchedule(tuple(ours)), steps)
    recipe = _recipe(steps=steps, seq_length=seq, step_batch_size_schedule=text)
    recipe.training.step_batch_size_schedule_unit = unit
    schedule = training_schedule(recipe.training, recipe.optimizer)
    assert schedule.stages == stages and schedule.target_batch == theirs.global_batch_size
    consumed = 0
    for step in range(steps):
        theirs.update(consumed, consistency_check=False)
        assert schedule.samples_before(step) == consumed, step
        assert schedule.global_batch(step) == theirs.get_current_global_batch_size(), step
        assert schedule.num_microbatches(step, mbs, dp) == theirs.get(), step
        consumed += theirs.get_current_global_batch_size()
    assert schedule.samples_before(steps) == consumed
    assert all(b.global_batch != a.global_batch for a, b in itertools.pairwise(stages))


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("64:4 128:8", "first threshold must be 0"),
        ("0:4 0:8", "strictly increasing"),
        ("0:4 32:8", "strictly increasing"),  # 32 tokens // 64 = sample 0 again
        ("0:4 x", "not THRESHOLD:BATCH"),
        ("0:4 1e:8", "not a number"),
        ("0:0", "must be >= 1"),
    ],
)
def test_bad_step_schedules_are_refused_like_megatron_core(text: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_step_schedule(text, 64)
    if match != "first threshold must be 0":  # megatron-core asserts the rest too
        with pytest.raises((AssertionError, ValueError)):
            _megatron_calculator(text, 64)


def test_counts_take_megatron_cores_suffixes() -> None:
    assert [parse_count(x) for x in ("250B", "1.5k", "2T", "3M", "17")] == [
        250 * 10**9,
        1500,
        2 * 10**12,
        3 * 10**6,
        17,
    ]


# --------------------------------------------------------------------------- the ramp


def _ramp_batches(start: int, every: int, target: int, steps: int) -> list[int]:
    """The reference: double every ``every`` steps, capped at ``target``."""
    out, batch = [], start
    for step in range(steps):
        if step and step % every == 0:
            batch = min(2 * batch, target)
        out.append(batch)
    return out


@pytest.mark.parametrize(("start", "target"), [(4, 32), (4, 24), (32, 32), (3, 32)])
def test_doubling_ramp_stages_and_tokens(start: int, target: int) -> None:
    every, steps, seq = 7, 60, 16
    recipe = _recipe(
        steps=steps,
        seq_length=seq,
        global_batch_size=target,
        batch_ramp={"start": start, "double_every": every},
    )
    schedule = training_schedule(recipe.training, recipe.optimizer)
    want = _ramp_batches(start, every, target, steps)
    assert [schedule.global_batch(s) for s in range(steps)] == want
    assert [schedule.tokens_before(s) for s in range(steps + 1)] == [
        sum(want[:s]) * seq for s in range(steps + 1)
    ]
    firsts = [s for s in range(steps) if s == 0 or want[s] != want[s - 1]]
    assert [st.first_step for st in schedule.run_stages()] == firsts
    ramp = DoublingRamp(start, every, target)
    assert ramp.horizon == (firsts[-1] if len(firsts) > 1 else 0)


def test_ramp_refuses_a_start_above_the_target() -> None:
    with pytest.raises(ConfigError, match=r"batch_ramp.start=64 must be between 1 and"):
        recipe = _recipe(global_batch_size=32, batch_ramp={"start": 64, "double_every": 5})
        training_schedule(recipe.training, recipe.optimizer)
    with pytest.raises(ConfigError, match="double_every must be >= 1"):
        recipe = _recipe(global_batch_size=32, batch_ramp={"start": 4})
        training_schedule(recipe.training, recipe.optimizer)


# --------------------------------------------------------------------------- LR on tokens


def _token_lr(tokens: int, *, max_lr, min_lr, warmup, window_start, end) -> float:
    """WSD (minus_sqrt) on tokens, written from the definition."""
    if warmup and tokens <= warmup:
        return max_lr * tokens / warmup
    if tokens <= window_start:
        return max_lr
    if tokens > end:
        return min_lr
    w = (tokens - window_start) / (end - window_start)
    return min_lr + (1 - math.sqrt(w)) * (max_lr - min_lr)


def test_wsd_decay_ends_on_the_last_token_under_a_ramp() -> None:
    """Ramp 4 -> 32 doubling every 10 steps, 100 steps of 32 tokens, warmup tied to the ramp,
    WSD over the last 20 steps: every position counted in tokens here, step by step."""
    seq, steps = 32, 100
    recipe = _recipe(
        steps=steps,
        seq_length=seq,
        global_batch_size=32,
        batch_ramp={"start": 4, "double_every": 10},
        lr_decay_style="WSD",
        lr_wsd_decay_steps=20,
    )
    schedule = training_schedule(recipe.training, recipe.optimizer)
    batches = _ramp_batches(4, 10, 32, steps)  # 4, 8, 16 for 10 steps each, then 32
    tokens = [sum(batches[:s]) * seq for s in range(steps + 1)]
    assert tokens[-1] == (10 * 4 + 10 * 8 + 10 * 16 + 70 * 32) * seq == 80_640
    assert schedule.total_tokens == 80_640
    assert schedule.lr.warmup_steps == tokens[30] == 8_960  # the ramp's end
    assert schedule.lr.decay_steps - schedule.lr.wsd_decay_steps == tokens[80] == 60_160
    assert schedule.lr.decay_steps == 80_640  # the decay ends on the run's last token
    assert schedule.lr.lr_at(schedule.total_tokens) == pytest.approx(1e-3, rel=1e-15)
    for step in range(steps):
        want = _token_lr(
            tokens[step], max_lr=1e-2, min_lr=1e-3, warmup=8_960, window_start=60_160, end=80_640
        ) * math.sqrt(batches[step] / 32)
        assert schedule.lr_at(step) == pytest.approx(want, rel=1e-13), step
    # The known failure of step-count schedules: megatron-core's scheduler set up as
    # Megatron-LM does for train_iters (positions = iterations x global_batch_size samples,
    # advanced by each step's batch) has not finished the decay when the ramp's run ends.
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Opt:
        def __init__(self) -> None:
            self.param_groups: list[dict] = [{}]

    opt = Opt()

    theirs = OptimizerParamScheduler(
        opt,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=30 * 32,
        lr_decay_steps=steps * 32,
        lr_decay_style="WSD",
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=steps * 32,
        wd_incr_style="constant",
        wsd_decay_steps=20 * 32,
        lr_wsd_decay_style="minus_sqrt",
    )
    for batch in batches:
        theirs.step(batch)
    assert opt.param_groups[0]["lr"] > 3e-3  # far from min_lr (1e-3) after the last step


@pytest.mark.parametrize(
    ("style", "wsd"), [("constant", None), ("linear", None), ("cosine", None), ("WSD", 30)]
)
def test_a_constant_batch_keeps_the_step_schedule_bit_for_bit(style: str, wsd) -> None:
    recipe = _recipe(
        steps=120,
        global_batch_size=24,
        seq_length=96,
        lr_warmup_steps=12,
        lr_decay_style=style,
        lr_wsd_decay_steps=wsd,
    )
    steps, tokens = (
        lr_schedule(recipe.training, recipe.optimizer),
        training_schedule(recipe.training, recipe.optimizer),
    )
    assert all(tokens.lr_at(s) == steps.lr_at(s) for s in range(130))


def test_sqrt_factor_at_every_stage_and_off_switch() -> None:
    ramp = {"start": 2, "double_every": 3, "warmup": "recipe"}
    recipe = _recipe(steps=20, global_batch_size=16, lr_decay_style="constant", batch_ramp=ramp)
    on = training_schedule(recipe.training, recipe.optimizer)
    assert [on.lr_at(s) for s in (0, 3, 6, 9)] == [
        1e-2 * math.sqrt(2 / 16),
        1e-2 * math.sqrt(8 / 16 / 2),
        1e-2 * math.sqrt(8 / 16),
        1e-2,
    ]
    off = _recipe(steps=20, global_batch_size=16, lr_decay_style="constant", batch_ramp=ramp)
    off.training.batch_lr_scaling = "none"
    assert {training_schedule(off.training, off.optimizer).lr_at(s) for s in range(20)} == {1e-2}


def test_first_stage_warmup_and_step_positions_map_through_the_table() -> None:
    recipe = _recipe(
        steps=40,
        seq_length=10,
        global_batch_size=8,
        batch_ramp={"start": 2, "double_every": 4, "warmup": "first_stage"},
        lr_decay_style="cosine",
        lr_decay_steps=50,  # past the run: the table extends at the target batch
    )
    schedule = training_schedule(recipe.training, recipe.optimizer)
    assert schedule.lr.warmup_steps == 4 * 2 * 10
    assert schedule.lr.decay_steps == (4 * 2 + 4 * 4 + 42 * 8) * 10
    assert schedule.total_tokens == (4 * 2 + 4 * 4 + 32 * 8) * 10


def test_train_tokens_sets_the_step_count() -> None:
    ramp = {"start": 2, "double_every": 4, "warmup": "recipe"}
    recipe = _recipe(seq_length=10, global_batch_size=8, batch_ramp=ramp)
    recipe.training.train_tokens = 1_000  # 80 + 160 = 240 after 8 steps, then 80 per step
    assert run_steps(recipe.training) == 8 + math.ceil((1_000 - 240) / 80)
    recipe.training.train_tokens = 80
    assert run_steps(recipe.training) == 4  # exactly the first stage
    recipe.data.path = "unused"
    before = copy.deepcopy(recipe)
    recipe.check()
    assert recipe == before  # validation reads the recipe, it does not fill it in
    assert (
        training_schedule(recipe.training, recipe.optimizer).steps == 4
    )  # the step count comes from the plan


@pytest.mark.parametrize(
    ("training", "match"),
    [
        (
            {"batch_ramp": {"start": 2, "double_every": 4}, "lr_warmup_steps": 5},
            r"batch_ramp.warmup=ramp sets the warmup .* training.lr_warmup_steps=0",
        ),
        (
            {"batch_ramp": {"start": 2, "double_every": 4}, "step_batch_size_schedule": "0:4"},
            "keep one",
        ),
        (
            {
                "steps": 30,
                "batch_ramp": {"start": 1, "double_every": 8},
                "lr_decay_style": "WSD",
                "lr_wsd_decay_steps": 10,
            },
            r"warmup ends at step 24 .* after the WSD decay window starts at step 20",
        ),
    ],
)
def test_inconsistent_ramps_are_refused(training: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        recipe = _recipe(global_batch_size=8, **training)
        training_schedule(recipe.training, recipe.optimizer)


# --------------------------------------------------------------------------- before launch


def _recipe_file(tmp_path: Path, **training) -> str:
    raw = {
        "trainer": "gpt",
        "run_dir": str(tmp_path / "run"),
        "data": {"path": "/data/tokens", "source": ["python-stdlib"]},
        "model": {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4},
        "training": {"micro_batch_size": 2, "global_batch_size": 32, "steps": 100, **training},
        "launch": {"nproc_per_node_cpu": 2},
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _dry_run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MEGATRON_EXT), "launch", *args, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )


def test_dry_run_prints_the_stage_table_and_writes_the_png(tmp_path: Path) -> None:
    """The stage table on stderr; the plot only where ``--schedule-png`` asks (a dry run writes
    nothing else: not even the run directory)."""
    recipe = _recipe_file(
        tmp_path, seq_length=64, lr_warmup_steps=10, lr_decay_style="WSD", lr_wsd_decay_steps=20
    )
    png = tmp_path / "plots" / "schedule.png"
    proc = _dry_run(
        recipe, "training.step_batch_size_schedule=0:8 16K:16 64K:32", "--schedule-png", str(png)
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1].split()[1:3] == ["-m", "torch.distributed.run"]
    reads, *lines = proc.stderr.splitlines()
    assert reads == GPT_READS  # what the trainer reads, first
    assert lines[0].startswith("batch schedule: 100 steps, 107,520 tokens, target global batch 32")
    # 16K tokens = 250 samples: 32 steps of 8 (256 samples); 64K = 1000: +47 of 16 (1008),
    # then 21 of 32: 1680 samples of 64 tokens
    rows = [line.split() for line in lines[2:5]]
    assert [r[:6] for r in rows] == [
        ["0", "0", "0", "8", "2", "512"],
        ["1", "32", "16,384", "16", "4", "1,024"],
        ["2", "79", "64,512", "32", "8", "2,048"],
    ]
    assert float(rows[1][6]) == pytest.approx(3e-4 * math.sqrt(16 / 32), rel=1e-3)
    assert "the run's last token" in lines[5] and "107,520" in lines[5]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "run").exists()


def test_a_stage_that_does_not_split_stops_before_launch(tmp_path: Path) -> None:
    recipe = _recipe_file(tmp_path, batch_ramp={"start": 2, "double_every": 10})
    proc = _dry_run(recipe)
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line == (
        "megatron-ext: error: batch stage 0 (from step 0, token 0): global batch 2 is not "
        "divisible by micro_batch_size*dp = 2*2 = 4: make every stage's batch a multiple of 4, "
        "or lower training.micro_batch_size"
    )
    assert _dry_run(recipe, "training.batch_ramp.start=4").returncode == 0


def test_megatrons_rampup_batch_size_is_refused_with_the_new_fields(tmp_path: Path) -> None:
    proc = _dry_run(_recipe_file(tmp_path), "training.rampup_batch_size=[16, 8, 300000]")
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "megatron-ext: error: training.rampup_batch_size was renamed: use "
        "training.batch_ramp or training.step_batch_size_schedule"
    )


def test_the_table_rows_come_from_the_schedule() -> None:
    recipe = _recipe(
        steps=12, seq_length=4, global_batch_size=8, batch_ramp={"start": 2, "double_every": 3}
    )
    schedule = training_schedule(recipe.training, recipe.optimizer)
    assert stage_rows(schedule, 1, 2) == [
        (0, 0, 0, 2, 1, 8, 0.0),
        (1, 3, 24, 4, 2, 16, schedule.lr_at(3)),
        (2, 6, 72, 8, 4, 32, schedule.lr_at(6)),
    ]
    assert "warmup ends at token 72" in format_stage_table(schedule, 1, 2)


def test_a_checkpoint_from_another_batch_schedule_is_refused() -> None:
    ramp = {"start": 4, "double_every": 6, "warmup": "recipe"}
    recipe = _recipe(steps=8, global_batch_size=8, batch_ramp=ramp)
    schedule = training_schedule(recipe.training, recipe.optimizer)
    schedule.check_resume(8, 6 * 4 + 2 * 8)  # its own checkpoint
    with pytest.raises(ConfigError, match=r"step 8 consumed 64 samples, but .* consumes 40 by"):
        schedule.check_resume(8, 8 * 8)  # saved without the ramp
