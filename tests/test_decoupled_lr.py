"""``optimizer.decoupled_lr``: megatron-core's decoupled LR in the GPT trainer and the recipe.

The runs are the GPT trainer's own (``tests/dist/decoupled_lr_check.py``, one gloo launch of
2 ranks, the tiny GPT with AdamW and with Muon); the reference is megatron-core's
``_get_param_groups`` + ``get_standard_config_overrides`` over the same model and its
``OptimizerParamScheduler`` from the same LRs and positions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.config import load_recipe
from megatron_ext.errors import ConfigError
from tests.conftest import DIST, run_torchrun

SCRIPT = DIST / "decoupled_lr_check.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("decoupled")
    run_torchrun(SCRIPT, 2, str(out))
    return json.loads(Path(out, "decoupled.json").read_text())


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_embedding_and_output_lr_is_megatron_cores_param_group_lr(runs, optimizer) -> None:
    """Which parameters get the decoupled LR, and their LR (and the rest's) at every step,
    equal megatron-core's param groups under its scheduler (warmup, WSD decay, the decoupled
    floor at the last step)."""
    ours, theirs = runs[optimizer]["ours"], runs[optimizer]["theirs"]
    assert theirs["names"] == ["embedding.word_embeddings.weight", "output_layer.weight"]
    assert ours["names"] == theirs["names"]  # the trainer's masters, over every rank
    for step, (mine, ref) in enumerate(zip(ours["decoupled"], theirs["decoupled"], strict=True)):
        assert len(ref) == 1 and mine == pytest.approx(ref[0], rel=1e-12, abs=0.0), step
    for step, (mine, ref) in enumerate(zip(ours["other"], theirs["other"], strict=True)):
        assert len(ref) == 1 and mine == pytest.approx(ref[0], rel=1e-12, abs=0.0), step
    assert ours["decoupled"] != ours["other"]  # not the run's LR
    assert ours["decoupled"][-1] == pytest.approx(5e-5, rel=1e-12)  # its own floor
    assert all(math.isfinite(loss) for loss in ours["losses"])


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["optimizer.decoupled_min_lr=1e-5"], "optimizer.decoupled_lr, which is not set"),
        (
            ["optimizer.decoupled_lr=1e-4", "optimizer.min_lr=2e-4"],
            "optimizer.min_lr=0.0002 exceeds optimizer.decoupled_lr=0.0001",
        ),
        (
            ["optimizer.decoupled_lr=1e-4", "optimizer.decoupled_min_lr=2e-4"],
            "optimizer.decoupled_min_lr=0.0002 exceeds",
        ),
        (["optimizer.decoupled_lr=0"], "decoupled_lr"),
    ],
)
def test_bad_decoupled_lr_is_one_config_error(overrides, match) -> None:
    with pytest.raises(ConfigError, match=match):
        load_recipe("tiny_cpu_gpt", overrides)
