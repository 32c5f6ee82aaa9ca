"""The MoE recipes: olmoe_1b_7b and qwen3_30b_a3b validate at cluster scale (not run) with
each optimizer; moe_tiny_cpu trains on 2 CPU ranks with expert parallelism 2."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_ext.config.load import read_recipe
from megatron_ext.run.metrics import read_jsonl
from tests.conftest import DIST, run_torchrun

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


@pytest.fixture(scope="module")
def ep2_run(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """moe_tiny_cpu, 20 steps on 2 ranks with expert parallelism 2, validation after the last
    step, a checkpoint at the end; an independent float64 reference watches every router
    (tests/dist/moe_load_check.py)."""
    tmp = tmp_path_factory.mktemp("moe_tiny")
    overrides = [
        f"run_dir={tmp / 'run'}",
        f"data.path={tmp / 'data' / 'stdlib'}",
        "training.steps=20",
        "training.eval_iters=1",
    ]
    proc = run_torchrun(DIST / "moe_load_check.py", 2, str(tmp / "ref"), "moe_tiny_cpu", *overrides)
    return SimpleNamespace(
        run_dir=tmp / "run", ref_dir=tmp / "ref", stdout=proc.stdout, overrides=overrides
    )


def test_moe_tiny_cpu_trains_on_two_ranks_with_expert_parallelism(ep2_run) -> None:
    """The loss falls, and every step's logged expert load equals the float64 recomputation
    (top-k of the router logits, Switch aux loss and z loss per micro-batch on each rank)."""
    recipe = read_recipe("moe_tiny_cpu")
    assert recipe.parallel.expert_model_parallel_size == 2
    run_dir, ref_dir = ep2_run.run_dir, ep2_run.ref_dir
    losses = json.loads((run_dir / "summary.json").read_text())["losses"]
    assert len(losses) == 20 and losses[-1] < losses[0] - 0.3, losses

    m, t = recipe.model, recipe.training
    k, experts = m.moe_router_topk, m.num_moe_experts
    tokens = t.global_batch_size * t.seq_length
    refs = [json.loads((ref_dir / f"ref.rank{r}.json").read_text()) for r in range(2)]
    records = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 21))
    for rec in records:
        step = str(rec["step"])
        assert rec["moe_expert_batch"] == tokens * k / experts
        for layer in range(1, m.num_layers + 1):
            key = f"layer_{layer}"
            ranks = [ref[step][str(layer)] for ref in refs]
            counts = [sum(c) for c in zip(*(r["counts"] for r in ranks), strict=True)]
            assert sum(counts) == tokens * k  # every token in k slots, summed over both ranks
            assert ranks[0]["counts"] != counts  # each rank saw only its share
            assert rec["moe_tokens_per_expert_max"][key] == max(counts)
            assert rec["moe_tokens_per_expert_mean"][key] == tokens * k / experts
            assert rec["moe_load_imbalance"][key] == pytest.approx(
                max(counts) / (tokens * k / experts), rel=1e-12
            )
            # megatron-core's tracker (fp32) against the float64 reference: mean over the
            # micro-batches of both ranks
            for name, ref_key in (("moe_load_balancing_loss", "aux"), ("moe_z_loss", "z")):
                values = [v for r in ranks for v in r[ref_key]]
                assert len(values) == 2 * t.global_batch_size // (2 * t.micro_batch_size)
                assert rec[name][key] == pytest.approx(sum(values) / len(values), rel=1e-5)
        layers = rec["moe_load_imbalance"].values()
        assert rec["moe_load_imbalance_max"] == max(layers)
        mean_aux = sum(rec["moe_load_balancing_loss"].values()) / m.num_layers
        assert rec["moe_load_balancing_loss_mean"] == pytest.approx(mean_aux, rel=1e-6)
    last = records[-1]
    line = (
        f"moe imb {last['moe_load_imbalance_max']:.2f} "
        f"aux {last['moe_load_balancing_loss_mean']:.4g} z {last['moe_z_loss_mean']:.4g}"
    )
    assert line in ep2_run.stdout


def test_a_trainer_checkpoint_converts_to_hf(ep2_run, tmp_path: Path) -> None:
    """``convert mcore-to-hf`` of the EP=2 run's last checkpoint (olmoe preset, --recipe):
    the HF model's loss on the validation batch equals the trainer's own validation loss
    after that step (2 ranks, experts split between them)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from megatron_ext.convert.cli import convert_main
    from megatron_ext.data import build_tokenizer
    from megatron_ext.gpt.setup import build_data
    from megatron_ext.schedules.plan import training_schedule
    from tests.test_convert_continue import hf_batch_loss

    ckpt, out = ep2_run.run_dir / "checkpoints" / "step_000020", tmp_path / "hf"
    recipe_args = ["moe_tiny_cpu", *ep2_run.overrides]
    args = argparse.Namespace(
        convert_command="mcore-to-hf", mcore_ckpt=ckpt, out=out, recipe=recipe_args
    )
    assert convert_main(args) == 0
    hf = AutoModelForCausalLM.from_pretrained(out).eval()
    assert hf.config.model_type == "olmoe" and hf.config.num_experts == 8
    recipe = read_recipe(recipe_args[0], recipe_args[1:])
    t = recipe.training
    _, valid = build_data(
        recipe, build_tokenizer("byte", ""), training_schedule(recipe.training, recipe.optimizer)
    )
    # the evaluator's batch: samples 0..B-1, one micro-batch of 4 per rank, mean over them
    mbs = [[valid[i] for i in range(j, j + t.micro_batch_size)] for j in (0, t.micro_batch_size)]
    expected = sum(hf_batch_loss(hf, mb) for mb in mbs) / len(mbs)
    (val,) = [
        r["val_loss"] for r in read_jsonl(ep2_run.run_dir / "metrics.jsonl") if "val_loss" in r
    ]
    print(f"trainer validation loss {val:.7f}, converted HF model {expected:.7f}")
    assert val == pytest.approx(expected, rel=1e-5, abs=1e-5)
