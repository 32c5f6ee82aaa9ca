"""The GPT trainer end to end on 2 gloo ranks: exact resume, atomic checkpoints, NaN stop.

Each run is a real ``megatron-ext train`` under torchrun on a tiny recipe and a small corpus
written here, so every check goes through megatron-core's model, DDP, schedule and
dist_checkpointing.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from tests.conftest import DIST, run_torchrun

TEXT = "\n\n".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i % 7} times, "
    f"while megatron trains a tiny model on byte {i % 13}."
    for i in range(400)
)


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("train")
    corpus = root / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    recipe = {
        "trainer": "gpt",
        "model": {
            "num_layers": 2,
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_query_groups": 2,
            "ffn_hidden_size": 128,
        },
        "optimizer": {"name": "adamw", "lr": 3e-3, "min_lr": 3e-4},
        "data": {"path": str(root / "data" / "corpus"), "source": [str(corpus)]},
        "training": {
            "steps": 8,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "seq_length": 32,
            "lr_warmup_steps": 2,
            "lr_decay_style": "WSD",
            "lr_wsd_decay_steps": 3,
            "lr_decay_steps": 8,
        },
        "logging": {"log_interval": 1, "tensorboard": False, "progress_bar": "off"},
        "checkpoint": {"save_interval": 2, "keep_last": 5},
        "launch": {"nproc_per_node_cpu": 2, "threads_per_rank": 1},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def _train(
    recipe: Path,
    run_dir: Path,
    *overrides: str,
    script: Path | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
):
    args = [str(recipe), f"run_dir={run_dir}", *overrides]
    if script is None:
        return run_torchrun(
            "megatron_ext.launch.cli", 2, "train", *args, module=True, env=env, check=check
        )
    return run_torchrun(script, 2, *args, env=env, check=check)


def _train_one_rank(recipe: Path, run_dir: Path, *overrides: str) -> None:
    run_torchrun(
        "megatron_ext.launch.cli",
        1,
        "train",
        str(recipe),
        f"run_dir={run_dir}",
        *overrides,
        module=True,
    )


def _metric(run_dir: Path, key: str) -> list[float]:
    rows = [json.loads(row) for row in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row[key] for row in rows if key in row]


def _losses(run_dir: Path) -> list[float]:
    return json.loads((run_dir / "summary.json").read_text())["losses"]


@pytest.mark.parametrize(
    ("save_interval", "save_at_end", "saved"),
    [(2, True, [2, 4, 6, 7]), (0, True, [7]), (3, False, [3, 6]), (0, False, [])],
)
def test_the_checkpointer_decides_when_to_save(save_interval, save_at_end, saved):
    from megatron_ext.config.schema import CheckpointConfig
    from megatron_ext.gpt.checkpoint import Checkpointer

    config = CheckpointConfig(save_interval=save_interval, save_at_end=save_at_end)
    checkpointer = Checkpointer(Path("unused"), config)
    assert [s for s in range(1, 8) if checkpointer.should_save(s, last_step=7)] == saved


@pytest.fixture(scope="module")
def straight(recipe_file, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    _train(recipe_file, run_dir)
    return run_dir


def test_straight_run_learns_and_writes_artifacts(straight):
    losses = _losses(straight)
    assert len(losses) == 8
    # At initialisation (std 0.02) the logits are near zero: loss ≈ ln(padded vocabulary), the
    # byte tokenizer's 258 ids padded to 384. Catches a mis-scaled loss report.
    assert abs(losses[0] - math.log(384)) < 0.05, losses[0]
    assert losses[-1] < losses[0] - 0.5, losses
    for name in ("metrics.jsonl", "loss.png", "summary.json", "checkpoints/latest"):
        assert (straight / name).is_file(), name
    rows = [json.loads(line) for line in (straight / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    assert [r["loss"] for r in rows] == losses
    assert (straight / "checkpoints" / "latest").read_text().strip() == "step_000008"


def test_resume_is_exact(recipe_file, straight, tmp_path):
    _train(recipe_file, tmp_path, "training.steps=4")
    first = _losses(tmp_path)
    _train(recipe_file, tmp_path)  # checkpoint.load=auto picks up step 4
    second = _losses(tmp_path)
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == 4
    # Bit-identical: same arithmetic, same data order, same RNG and optimizer state.
    assert first + second == _losses(straight)


def test_crash_mid_checkpoint_keeps_previous_loadable(recipe_file, straight, tmp_path):
    proc = _train(
        recipe_file,
        tmp_path,
        script=DIST / "crash_in_save.py",
        env={"CRASH_AT_STEP": "4"},
        check=False,
    )
    assert proc.returncode != 0
    ckpts = tmp_path / "checkpoints"
    assert (ckpts / ".step_000004.tmp").is_dir(), "the crash should hit mid-save"
    assert not (ckpts / "step_000004").exists()
    assert (ckpts / "latest").read_text().strip() == "step_000002"
    _train(recipe_file, tmp_path)  # resumes from step 2, cleans the leftover
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == 2
    assert _losses(tmp_path) == _losses(straight)[2:]
    assert not (ckpts / ".step_000004.tmp").exists()


def test_nan_loss_stops_with_message_and_no_checkpoint(recipe_file, tmp_path):
    # A huge LR without clipping blows the weights up after the first update.
    proc = _train(
        recipe_file,
        tmp_path,
        "optimizer.lr=1e30",
        "optimizer.min_lr=0",
        "optimizer.clip_grad=0",
        "checkpoint.save_interval=1",
        check=False,
    )
    assert proc.returncode != 0
    err = proc.stderr
    assert "megatron-ext: error: step " in err and "training loss is" in err, err[-3000:]
    bad_step = int(err.split("megatron-ext: error: step ")[1].split(":")[0])
    assert bad_step >= 2
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))
    assert saved and saved[-1] == f"step_{bad_step - 1:06d}", saved
    assert "Traceback" not in err.split("megatron-ext: error:")[1].split("\n")[0]


def test_validation_is_averaged_over_ranks_and_leaves_training_alone(
    recipe_file, straight, tmp_path
):
    """``training.eval_interval``/``eval_iters``: the validation loss after steps 4 and 8 is the
    same at DP=2 and DP=1 (the same validation samples, averaged over the data-parallel ranks;
    fp32 tolerance), and evaluating does not change training (losses bit-identical to the run
    without validation)."""
    evals = ("training.eval_interval=4", "training.eval_iters=2", "checkpoint.save_interval=0")
    two, one = tmp_path / "dp2", tmp_path / "dp1"
    _train(recipe_file, two, *evals)
    _train_one_rank(recipe_file, one, *evals)
    assert _losses(two) == _losses(straight)
    rows = [json.loads(r) for r in (two / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    assert [step for step, _ in val] == [4, 8]
    assert val[1][1] < val[0][1], val  # the model improves on held-out text
    val1 = _metric(one, "val_loss")
    for (_, a), b in zip(val, val1, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (val, val1)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["last_val_loss"] == val[-1][1]
    assert summary["val_losses"] == [list(v) for v in val]


def test_muon_layerwise_dp2_matches_dp1_and_resumes_exactly(recipe_file, tmp_path):
    """Muon through the layer-wise optimizer: DP=2 equals DP=1 on the same global batches (fp32
    tolerance: gradients are summed in another order), and 4 + resume + 4 steps equal 8."""
    muon = ("optimizer.name=muon", "checkpoint.save_interval=0")
    one, two, resumed = tmp_path / "dp1", tmp_path / "dp2", tmp_path / "resumed"
    _train_one_rank(recipe_file, one, *muon)
    _train(recipe_file, two, *muon)
    dp1, dp2 = _losses(one), _losses(two)
    # DDP's all-reduce was replaced by the reduce-scatter to the owners: per step rank 0 sent
    # the fp32 gradients rank 1 owns and received those it owns, together at most one copy of
    # the gradients (a ring all-reduce moves about two).
    summary = json.loads((two / "summary.json").read_text())
    sync, grad_bytes = summary["grad_sync_bytes"], 4 * summary["parameters"]
    assert sync is not None and sync["sent"] > 0 and sync["received"] > 0, sync
    assert sync["sent"] + sync["received"] <= summary["steps"] * grad_bytes, (sync, grad_bytes)
    assert dp2[-1] < dp2[0] - 0.5, dp2
    for a, b in zip(dp1, dp2, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (dp1, dp2)
    # At DP=2 each rank sums the squares of the gradients it owns and the sums are all-reduced:
    # the global norm must equal DP=1's, where one rank sees every gradient.
    norms1, norms2 = (_metric(d, "grad_norm") for d in (one, two))
    for a, b in zip(norms1, norms2, strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (norms1, norms2)
    _train(recipe_file, resumed, *muon, "training.steps=4")
    first = _losses(resumed)
    (step4,) = (resumed / "checkpoints").glob("step_*")
    _train(recipe_file, resumed, *muon)
    assert first + _losses(resumed) == dp2
    # The layer-wise state is keyed by parameter: the DP=2 checkpoint resumes at DP=1 (each
    # rank's owned momenta merge into one rank's), continuing DP=2's run to fp32 tolerance.
    elastic = tmp_path / "elastic_dp1"
    _train_one_rank(recipe_file, elastic, f"checkpoint.load={step4}", *muon)
    for a, b in zip(_losses(elastic), dp2[4:], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), (_losses(elastic), dp2)


def test_bf16_muon_layerwise_resumes_exactly_at_any_dp(recipe_file, tmp_path):
    """bf16 parameters with the layer-wise optimizer, whose fp32 masters live only on their
    owners (and travel in the checkpoint as the owners' entries): 4 + resume + 4 steps equal 8
    straight bit for bit at DP=2, and the step-4 checkpoint resumes at DP=1 on the DP=2 curve
    (fp32 gradient sums in another order; the bf16 parameters may round differently)."""
    bf16 = ("optimizer.name=muon", "training.precision=bf16", "checkpoint.save_interval=0")
    straight, resumed, elastic = tmp_path / "straight", tmp_path / "resumed", tmp_path / "dp1"
    _train(recipe_file, straight, *bf16)
    losses = _losses(straight)
    assert losses[-1] < losses[0] - 0.5, losses
    _train(recipe_file, resumed, *bf16, "training.steps=4")
    first = _losses(resumed)
    (step4,) = (resumed / "checkpoints").glob("step_*")
    _train(recipe_file, resumed, *bf16)
    assert first + _losses(resumed) == losses
    _train_one_rank(recipe_file, elastic, f"checkpoint.load={step4}", *bf16)
    for a, b in zip(_losses(elastic), losses[4:], strict=True):
        assert abs(a - b) <= 2e-3 * abs(a), (_losses(elastic), losses)


@pytest.mark.parametrize(
    "optimizer",
    [
        ("optimizer.name=adamw",),
        ("optimizer.name=muon", "optimizer.tp_mode=duplicated"),
        ("optimizer.name=muon", "optimizer.tp_mode=distributed"),
    ],
    ids=["adamw", "muon-duplicated", "muon-distributed"],
)
def test_tensor_parallel_matches_one_rank(recipe_file, tmp_path, optimizer):
    """megatron-core's TP=2 on gloo gives the single-rank losses on the same global batches, to
    fp32 tolerance; for Muon through the layer-wise optimizer this holds in the duplicated and
    distributed TP modes (full-matrix statistics). (PP=2 also trains, but its stages initialise
    from offset seeds, as in Megatron-LM, so its losses differ from a single rank's.)"""
    runs = {}
    for name, nproc, layout in (
        ("single", 1, ()),
        ("tp2", 2, ("parallel.tensor_model_parallel_size=2",)),
    ):
        run_dir = tmp_path / name
        run_torchrun(
            "megatron_ext.launch.cli",
            nproc,
            "train",
            str(recipe_file),
            f"run_dir={run_dir}",
            "checkpoint.save_interval=0",
            "training.steps=4",
            "model.make_vocab_size_divisible_by=256",
            *optimizer,
            *layout,
            module=True,
        )
        runs[name] = _losses(run_dir)
    assert runs["single"][-1] < runs["single"][0] - 0.1
    for a, b in zip(runs["single"], runs["tp2"], strict=True):
        assert abs(a - b) <= 1e-4 * abs(a), runs


def test_blockwise_tensor_parallel_muon_is_not_tp1(recipe_file, tmp_path):
    """The blockwise mode orthogonalises each shard alone: documented as not equivalent, and it
    is not (the losses leave TP=1's by far more than fp32 rounding)."""
    runs = {}
    for name, nproc, extra in (
        ("single", 1, ()),
        ("blockwise", 2, ("parallel.tensor_model_parallel_size=2", "optimizer.tp_mode=blockwise")),
    ):
        run_torchrun(
            "megatron_ext.launch.cli",
            nproc,
            "train",
            str(recipe_file),
            f"run_dir={tmp_path / name}",
            "checkpoint.save_interval=0",
            "training.steps=8",
            "model.make_vocab_size_divisible_by=256",
            "optimizer.name=muon",
            *extra,
            module=True,
        )
        runs[name] = _losses(tmp_path / name)
    assert runs["single"][0] == pytest.approx(runs["blockwise"][0], rel=1e-5)  # same start
    # 10x the 1e-4 tolerance the equivalent modes meet
    assert abs(runs["single"][-1] - runs["blockwise"][-1]) > 1e-3 * runs["single"][-1], runs


def test_replica_check_catches_a_one_bit_divergence(tmp_path):
    out = tmp_path / "replicas.json"
    run_torchrun(DIST / "replica_check.py", 2, str(out))
    message = json.loads(out.read_text())["message"]
    assert message is not None, "a one-bit difference between replicas went unnoticed"
    assert "1 parameter(s)" in message and "1.weight" in message, message


def test_muon_with_expert_parallelism_plans_experts_over_expert_dp(recipe_file, tmp_path):
    """MoE with EP=2 on 2 ranks: dense weights are planned over the data-parallel group (2
    ranks), each rank's experts over its expert-data-parallel group (itself). The run trains,
    and 4 + resume + 4 steps equal 8 straight bit for bit (the per-domain state round-trips)."""
    moe = (
        "optimizer.name=muon",
        "model.num_moe_experts=4",
        "model.moe_router_topk=2",
        "model.moe_ffn_hidden_size=32",
        "parallel.expert_model_parallel_size=2",
        "checkpoint.save_interval=0",
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(recipe_file, straight, *moe)
    losses = _losses(straight)
    assert losses[-1] < losses[0] - 0.5, losses
    _train(recipe_file, resumed, *moe, "training.steps=4")
    first = _losses(resumed)
    _train(recipe_file, resumed, *moe)
    assert first + _losses(resumed) == losses


def test_fp16_scales_skips_and_resumes_exactly(recipe_file, tmp_path):
    """Megatron-LM's ``--fp16`` on CPU: float16 parameters (Muon's fp32 masters), the loss
    scaled before backward, a step whose gradients overflow skipped without moving the LR
    schedule (Megatron-LM advances its scheduler on successful steps only), the scale after
    each step megatron-core's ``DynamicGradScaler`` fed the same overflows; 4 + resume + 4
    steps equal 8 straight bit for bit (the scale travels in the checkpoint)."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler

    from megatron_ext.config import load_recipe
    from megatron_ext.schedules.plan import training_schedule
    from tests.test_loss_scale import _megatron_core

    fp16 = (
        "optimizer.name=muon",
        "training.precision=fp16",
        "checkpoint.save_interval=0",
        "optimizer.initial_loss_scale=524288",  # 2**19: overflows at first, then it trains
        "optimizer.loss_scale_window=2",  # the scale also grows inside 8 steps
    )
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(recipe_file, straight, *fp16)
    losses, scales = _losses(straight), _metric(straight, "loss_scale")
    skipped = [g is None for g in _metric(straight, "grad_norm")]
    assert 0 < sum(skipped) < 6 and losses[-1] < losses[0] - 0.3, (skipped, losses)
    assert _metric(straight, "skipped_steps") == [sum(skipped[: i + 1]) for i in range(8)]
    theirs = _megatron_core(pytest.MonkeyPatch(), DynamicGradScaler, 2.0**19, 1.0, 2.0, 0.5, 2, 2)
    for flag, scale in zip(skipped, scales, strict=True):
        theirs.update(flag)
        assert scale == float(theirs.scale), (skipped, scales)
    assert max(scales) > min(scales[skipped.index(True) :])  # it fell and grew again
    schedule = training_schedule(*_sections(load_recipe(str(recipe_file), list(fp16))))
    lrs = [schedule.lr_at(i - sum(skipped[:i])) for i in range(8)]
    assert _metric(straight, "lr") == pytest.approx(lrs, rel=1e-12)
    _train(recipe_file, resumed, *fp16, "training.steps=4")
    first = _losses(resumed), _metric(resumed, "loss_scale")
    _train(recipe_file, resumed, *fp16)
    assert first[0] + _losses(resumed) == losses
    assert _metric(resumed, "loss_scale") == scales  # metrics.jsonl holds both launches


def _sections(recipe):
    return recipe.training, recipe.optimizer


def test_a_dynamic_scale_resumed_from_a_constant_scale_checkpoint_starts_anew(capsys) -> None:
    """A checkpoint of a constant-scale fp16 run holds only its skipped-step count: a run with
    the dynamic scale starts its scale anew (and says so) instead of failing on the missing
    fields; a dynamic checkpoint gives back its scale and count."""
    from types import SimpleNamespace

    from megatron_ext.gpt.trainer import resume_loss_scale
    from megatron_ext.megatron.loss_scale import LossScale

    scale = LossScale(initial_scale=1024.0)
    run = SimpleNamespace(optimizer=SimpleNamespace(loss_scale=scale), env=SimpleNamespace(rank=0))
    assert resume_loss_scale(run, {"step": 4, "loss_scale": {"skipped": 3}}) == 0
    assert float(scale.scale) == 1024.0 and "starts at 1024" in capsys.readouterr().out
    state = {"scale": 256.0, "growth_tracker": 5, "hysteresis_tracker": 1, "skipped": 2}
    assert resume_loss_scale(run, {"step": 4, "loss_scale": state}) == 2
    assert (float(scale.scale), scale.growth_tracker) == (256.0, 5)
