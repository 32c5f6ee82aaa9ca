"""The DiPaCo trainer end to end on a small corpus, with real processes and an SQLite queue:

- ``megatron-ext launch`` (2 ranks = 2 workers) trains the recipe;
- the run writes summary.json (routed perplexities once per sequence and every W tokens, the
  base model's, each path's early-stopping choice) and metrics.jsonl; ``dipaco status`` reports
  the run complete with every module at its last version;
- the fault runs are in test_dipaco_faults.py;
- the base model can be an ordinary GPT run's checkpoint (its weights exactly); a base
  checkpoint that does not match the model is a ConfigError;
- a two-rank worker (``dipaco.ranks_per_worker=2``: its first rank claims, both train each
  path data-parallel) writes the same final modules as one-rank workers, bit for bit;
- ``bench dipaco``'s bytes per outer step (parameter-server accounting on both sides) are 1/τ
  of DDP's on the same tokens with every part shared, and less with path-specific parts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from megatron_ext.bench._dipaco_faults import max_abs_difference
from megatron_ext.bench._dipaco_measure import (
    comm_bytes,
    small_overrides,
    small_run,
    write_small_corpus,
)
from megatron_ext.config import load_recipe
from megatron_ext.dipaco.model.base import gpt_checkpoint_folder, load_base_checkpoint
from megatron_ext.dipaco.queue.task_queue import TaskQueue
from megatron_ext.dipaco.recipe import DipacoConfig, queue_url
from megatron_ext.dipaco.run.plan import train_id
from megatron_ext.dipaco.run.store import attempt_dir, load_tensors
from megatron_ext.errors import ConfigError
from tests.conftest import run_torchrun

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def run(args: list[str], timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MEGATRON_EXT), *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """600 paragraphs of the Python Language Reference as a .txt corpus."""
    return write_small_corpus(tmp_path_factory.mktemp("dipaco_data"))


@pytest.fixture(scope="module")
def launched(data: Path, tmp_path_factory) -> list[str]:
    """The run through the launcher: 2 gloo ranks, each a worker."""
    overrides = small_overrides(data, tmp_path_factory.mktemp("launched") / "run")
    proc = run(["launch", "dipaco_tiny", *overrides])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return overrides


def test_the_launched_run_completes_with_a_summary_and_status(launched: list[str]) -> None:
    run_dir = Path(launched[0].split("=", 1)[1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["trainer"] == "dipaco" and summary["num_paths"] == 4
    assert set(summary["perplexity"]) == {"base", "once", "w8"}
    assert all(v > 1 for v in summary["perplexity"].values())
    stops = summary["early_stopping"]
    assert [s["path"] for s in stops] == [0, 1, 2, 3]
    assert all(0 <= s["best_version"] <= 2 and len(s["val_loss"]) == 3 for s in stops)
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2 * 4 + 1  # one per train task, one for the evaluation
    proc = run(["dipaco", "status", str(run_dir), "--json"], timeout=120)
    assert proc.returncode == 0, proc.stderr
    status = json.loads(proc.stdout)
    assert status["complete"] and status["module_versions"] == dict.fromkeys(
        ["l0_e0", "l0_e1", "l1_e0", "l1_e1"], 2
    )
    assert {w["id"] for w in status["workers"]} == {"rank0", "rank1"}


def test_a_base_checkpoint_that_does_not_match_the_model_is_a_config_error(tmp_path) -> None:
    """Checked by every worker before it writes anything (the CLI then prints one line and
    exits 2, as for every ConfigError: see test_dipaco_recipe)."""
    reference = {
        "embedding.word_embeddings.weight": torch.zeros(8, 4),
        "output_layer.weight": torch.zeros(8, 4),
    }
    good = tmp_path / "good.pt"
    torch.save({"model": {k: torch.ones_like(v) for k, v in reference.items()}}, good)
    assert torch.equal(
        load_base_checkpoint(good, reference)["output_layer.weight"], torch.ones(8, 4)
    )
    cases = {
        "missing.pt": None,
        "short.pt": {"embedding.word_embeddings.weight": torch.zeros(8, 4)},
        "shape.pt": {k: torch.zeros(9, 4) for k in reference},
        "dtype.pt": {k: torch.zeros(8, 4, dtype=torch.float64) for k in reference},
        "junk.pt": "not a checkpoint",
    }
    messages = {
        "missing.pt": "does not exist",
        "short.pt": "lacks 1 parameters",
        "shape.pt": r"is \(9, 4\)",
        "dtype.pt": "torch.float64",
        "junk.pt": "unreadable",
    }
    for name, content in cases.items():
        path = tmp_path / name
        if name == "junk.pt":
            path.write_text(content)
        elif content is not None:
            torch.save(content, path)
        with pytest.raises(ConfigError, match=messages[name]):
            load_base_checkpoint(path, reference)


def test_bytes_per_outer_step_are_one_over_tau_of_ddp_and_less_with_own_parts(
    data: Path, launched, tmp_path
) -> None:
    """``bench dipaco``'s communication figures, counted from the runs' files (parameter-server
    accounting on both sides): with every part shared the outer step moves exactly 1/τ of
    DDP's bytes on the same tokens; with the embedding path-specific it moves less, by exactly
    the embedding's share of the model (measured independently: the embedding tensor of the
    base model), and the path-specific bytes move nowhere."""
    recipe = load_recipe("dipaco_tiny", launched)
    tau = recipe.section(DipacoConfig).tau
    shared = comm_bytes(recipe)
    assert shared["path_specific_param_bytes"] == 0
    assert shared["bytes_ratio_vs_ddp"] == pytest.approx(1 / tau, rel=1e-12)
    assert shared["ring"]["bytes_ratio_vs_ddp"] < 1 / tau
    # the run wrote every path's modules: up = down = the modules' bytes times their paths
    for m in shared["modules"].values():
        assert m["up_bytes"] == m["down_bytes"] == m["paths"] * m["module_bytes"] > 0

    overrides = [
        *small_overrides(data, tmp_path / "own"),
        "dipaco.level_parts=[0-1, 2-3 final_layernorm output_layer]",
        "dipaco.path_specific=embedding",
    ]
    small_run("dipaco_tiny", overrides)
    own_recipe = load_recipe("dipaco_tiny", overrides)
    own = comm_bytes(own_recipe)
    base = load_tensors(
        attempt_dir(own_recipe.run_dir, "base", _token(own_recipe, "base")) / "model.pt"
    )
    embedding = sum(
        t.numel() * t.element_size() for n, t in base.items() if n.startswith("embedding.")
    )
    model = sum(t.numel() * t.element_size() for t in base.values())
    assert own["path_specific_param_bytes"] == embedding > 0
    assert own["path_model_bytes"] == model
    assert own["bytes_ratio_vs_ddp"] < 1 / tau
    assert own["bytes_ratio_vs_ddp"] == pytest.approx((1 - embedding / model) / tau, rel=1e-12)


def _token(recipe, task: str) -> str:
    queue = TaskQueue(queue_url(recipe), lease_seconds=1, max_attempts=1, worker="test")
    try:
        return queue.token(task)
    finally:
        queue.close()


def _gpt_run(data: Path, recipe, root: Path) -> Path:
    """A tiny ordinary GPT-trainer run (1 gloo rank, 3 AdamW steps) of the DiPaCo recipe's
    model, on its tokenizer and dataset; returns its run_dir."""
    spec = {
        "trainer": "gpt",
        "model": dataclasses.asdict(recipe.model),
        "optimizer": {"name": "adamw", "lr": 3e-3, "min_lr": 3e-4},
        "data": {
            "path": f"{data}/docs",
            "tokenizer": "sentencepiece",
            "tokenizer_model": f"{data}/sp.model",
            "split": "98,2,0",
        },
        "training": {
            "steps": 3,
            "micro_batch_size": 2,
            "global_batch_size": 2,
            "seq_length": recipe.training.seq_length,
            "lr_warmup_steps": 1,
            "eval_iters": 0,
        },
        "seed": 7,
        "logging": {"tensorboard": False, "progress_bar": "off"},
    }
    root.mkdir(parents=True)
    (root / "gpt.yaml").write_text(yaml.safe_dump(spec), encoding="utf-8")
    run_torchrun(
        "megatron_ext.launch.cli",
        1,
        "train",
        str(root / "gpt.yaml"),
        f"run_dir={root / 'run'}",
        module=True,
    )
    return root / "run"


def _flat_checkpoint(folder: Path, out: Path) -> dict[str, torch.Tensor]:
    """The checkpoint's model tensors by GPTModel parameter name, read with
    torch.distributed.checkpoint's own converter (no megatron-core, no process group): the
    layers are stacked on a first axis there (``decoder.layers.<rest>``), and the local spec's
    layer norms are filed under Transformer Engine's fused names (megatron-core's
    ``sharded_state_dict_keys_map`` of a TransformerLayer)."""
    fused = {
        "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
        "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    }
    dcp_to_torch_save(folder, out)
    flat = torch.load(out, weights_only=False)
    params = {}
    for key, value in flat.items():
        if torch.is_tensor(value) and not key.startswith("optimizer."):
            if key.startswith("decoder.layers."):
                rest = key.removeprefix("decoder.layers.")
                rest = fused.get(rest, rest)
                for i, layer in enumerate(value):
                    params[f"decoder.layers.{i}.{rest}"] = layer
            else:
                params[key] = value
    return params


def test_the_base_model_can_be_a_gpt_trainer_checkpoint(data: Path, launched, tmp_path) -> None:
    """dipaco.base_checkpoint naming an ordinary GPT run's checkpoint (its checkpoints folder:
    the latest) gives base weights equal to that checkpoint's, bit for bit; a damaged one
    (a file that does not match its manifest) is a ConfigError; a GPT checkpoint of another
    model (another ffn width) stops the worker with one ConfigError line, exit 2, before
    anything is written."""
    recipe = load_recipe("dipaco_tiny", launched)
    gpt = _gpt_run(data, recipe, tmp_path / "gpt")
    step = gpt / "checkpoints" / "step_000003"
    assert (gpt / "checkpoints" / "latest").read_text().strip() == step.name
    expected = _flat_checkpoint(step, tmp_path / "flat.pt")
    damaged = tmp_path / "damaged" / step.name
    shutil.copytree(step, damaged)
    with open(damaged / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ConfigError, match=r"is damaged: __0_0.distcp"):
        gpt_checkpoint_folder(damaged)
    with pytest.raises(ConfigError, match="not a GPT checkpoint"):
        gpt_checkpoint_folder(tmp_path)

    overrides = [
        *small_overrides(data, tmp_path / "dipaco"),
        f"dipaco.base_checkpoint={gpt / 'checkpoints'}",
    ]
    proc = run(["dipaco", "worker", "dipaco_tiny", *overrides, "--max-tasks", "2"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    dipaco = load_recipe("dipaco_tiny", overrides)
    base = load_tensors(attempt_dir(dipaco.run_dir, "base", _token(dipaco, "base")) / "model.pt")
    assert set(base) == set(expected) and len(base) == 2 + 6 * 4 + 1
    for name, tensor in base.items():
        assert torch.equal(tensor, expected[name]), name
    # the GPT run trained: its weights are not the initialisation DiPaCo would start from
    first = load_tensors(attempt_dir(recipe.run_dir, "base", _token(recipe, "base")) / "model.pt")
    assert not torch.equal(base["output_layer.weight"], first["output_layer.weight"])

    bad = [
        *small_overrides(data, tmp_path / "bad"),
        f"dipaco.base_checkpoint={gpt / 'checkpoints'}",
        "model.ffn_hidden_size=96",  # the GPT run's is 64
    ]
    proc = run(["dipaco", "worker", "dipaco_tiny", *bad])
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    errors = [x for x in proc.stderr.splitlines() if x.startswith("megatron-ext: error:")]
    assert len(errors) == 1 and "does not match the model" in errors[0], proc.stderr[-2000:]
    assert "step_000003" in errors[0] and "dipaco.base_checkpoint" in errors[0]
    assert not (tmp_path / "bad").exists()


def test_a_two_rank_worker_writes_the_modules_of_a_one_rank_worker_bit_for_bit(
    data: Path, tmp_path
) -> None:
    """``dipaco.ranks_per_worker=2`` under the launcher (torchrun, 2 gloo ranks): one worker
    whose first rank claims every task and whose two ranks train each path data-parallel (4
    micro-batches per inner step, 2 per rank, gradients added in micro-batch order). Its final
    modules and outer momenta equal a one-rank worker's exactly. With 4 micro-batches the
    order matters: a plain sum of the ranks' partial sums, (g0 + g1) + (g2 + g3), is not the
    one-rank ((g0 + g1) + g2) + g3 in float32."""
    batch = ["training.global_batch_size=8"]  # micro-batches of 2: 4 per step
    one = [*small_overrides(data, tmp_path / "one"), *batch]
    small_run("dipaco_tiny", one)
    overrides = [*small_overrides(data, tmp_path / "two"), *batch, "dipaco.ranks_per_worker=2"]
    proc = run(["launch", "dipaco_tiny", *overrides])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    recipe = load_recipe("dipaco_tiny", overrides)
    queue = TaskQueue(queue_url(recipe), lease_seconds=1, max_attempts=1, worker="test")
    try:
        trains = [queue.result(train_id(t, p)) for t in range(2) for p in range(4)]
        claimers = {e[2] for e in queue.events() if e[4] == "claim"}
    finally:
        queue.close()
    assert [r["ranks"] for r in trains] == [2] * 8
    assert claimers == {"rank0"}  # the second rank never talks to the queue as a worker
    assert max_abs_difference(recipe, load_recipe("dipaco_tiny", one)) == 0.0
