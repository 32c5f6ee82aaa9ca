"""The GPT trainer under a batch-size ramp, end to end on 2 gloo ranks: every step's batch,
consumed tokens and LR as the schedule says, and resume mid-ramp bit for bit (the stage
boundary inside the resumed half; the two ways of writing the ramp give the same run)."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest
import yaml

from megatron_ext.config import load_recipe
from megatron_ext.schedules.plan import training_schedule
from tests.test_training import TEXT, _losses, _train

# 6 steps of 4 sequences, then 2 of 8 (the recipe's target): 768 tokens of 32 before step 6.
RAMP = ("training.batch_ramp.start=4", "training.batch_ramp.double_every=6")
RAMP_AS_STRING = ("training.step_batch_size_schedule=0:4 768:8",)
SAME_WARMUP = ("training.batch_ramp.warmup=recipe",)
COMMON = ("optimizer.name=muon", "checkpoint.save_interval=0", "training.lr_wsd_decay_steps=2")


def _rows(run_dir: Path) -> list[dict]:
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory) -> Path:
    """test_training's tiny recipe: 8 steps of 8 sequences of 32 tokens, micro-batch 2."""
    root = tmp_path_factory.mktemp("ramp")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    recipe = {
        "trainer": "gpt",
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
        "optimizer": {"lr": 3e-3, "min_lr": 3e-4},
        "data": {"path": str(root / "data" / "corpus"), "source": [str(root / "corpus.txt")]},
        "training": {
            "steps": 8,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "seq_length": 32,
            "lr_warmup_steps": 2,
            "lr_decay_style": "WSD",
            "lr_decay_steps": 8,  # a 4-step run decays on the 8-step run's schedule
        },
        "logging": {"log_interval": 1, "tensorboard": False, "progress_bar": "off"},
        "launch": {"nproc_per_node_cpu": 2, "threads_per_rank": 1},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def ramped(recipe_file, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ramped")
    _train(recipe_file, run_dir, *COMMON, *RAMP, *SAME_WARMUP)
    return run_dir


def test_every_step_follows_the_stage_table(recipe_file, ramped) -> None:
    rows = _rows(ramped)
    batches = [4] * 6 + [8] * 2
    assert [r["global_batch"] for r in rows] == batches
    assert [r["tokens_per_step"] for r in rows] == [32 * b for b in batches]
    assert [r["consumed_tokens"] for r in rows] == [32 * c for c in itertools.accumulate(batches)]
    recipe = load_recipe(recipe_file, [*COMMON, *RAMP, *SAME_WARMUP])
    schedule = training_schedule(recipe.training, recipe.optimizer)
    assert [r["lr"] for r in rows] == [schedule.lr_at(s) for s in range(8)]
    # the sqrt(B) switch at the boundary: the stable LR at B=4 is lr * sqrt(4/8)
    assert rows[4]["lr"] == pytest.approx(3e-3 * math.sqrt(0.5), rel=1e-15)
    losses = _losses(ramped)
    assert losses[-1] < losses[0] - 0.5, losses


def test_resume_mid_ramp_is_exact(recipe_file, ramped, tmp_path) -> None:
    """4 steps + resume + 4 steps equal the 8 straight ones bit for bit, the batch doubling at
    step 7, inside the resumed half. The first half writes the ramp as megatron-core's string
    and the second as training.batch_ramp: the same stages, the same run."""
    _train(recipe_file, tmp_path, *COMMON, *RAMP_AS_STRING, "training.steps=4")
    first = _losses(tmp_path)
    assert [r["global_batch"] for r in _rows(tmp_path)] == [4] * 4
    _train(recipe_file, tmp_path, *COMMON, *RAMP, *SAME_WARMUP)
    assert first + _losses(tmp_path) == _losses(ramped)
    assert [r["global_batch"] for r in _rows(tmp_path)] == [4] * 6 + [8] * 2
    assert [r["lr"] for r in _rows(tmp_path)] == [r["lr"] for r in _rows(ramped)]
