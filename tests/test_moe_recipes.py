"""The MoE recipes: olmoe_1b_7b and qwen3_30b_a3b validate at cluster scale (not run) with
each optimizer; moe_tiny_cpu trains on 2 CPU ranks with expert parallelism 2."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from megatron_ext.config.load import read_recipe
from tests.conftest import run_torchrun

OPTIMIZERS = ["adamw", "muon", "kl_soap"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize(
    ("name", "world", "preset", "eps"),
    [("olmoe_1b_7b", 64, "olmoe", 1e-5), ("qwen3_30b_a3b", 128, "qwen3_moe", 1e-6)],
)
def test_cluster_recipes_validate(
    name: str, world: int, preset: str, eps: float, optimizer: str
) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the family's epsilon: no warning
        recipe = read_recipe(name, [f"optimizer.name={optimizer}"])
    recipe.check(world_size=world)
    m = recipe.model
    assert m.moe_preset == preset and m.layernorm_epsilon == eps
    assert m.num_moe_experts % recipe.parallel.expert_model_parallel_size == 0
    assert recipe.optimizer.name == optimizer


def test_moe_tiny_cpu_trains_on_two_ranks_with_expert_parallelism(tmp_path: Path) -> None:
    recipe = read_recipe("moe_tiny_cpu")
    assert recipe.parallel.expert_model_parallel_size == 2
    run_dir = tmp_path / "run"
    run_torchrun(
        "megatron_ext.launch.cli",
        2,
        "train",
        "moe_tiny_cpu",
        f"run_dir={run_dir}",
        f"data.path={tmp_path / 'data' / 'stdlib'}",
        "training.steps=20",
        module=True,
    )
    losses = json.loads((run_dir / "summary.json").read_text())["losses"]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.3, losses
