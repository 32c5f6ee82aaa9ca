"""The DiPaCo trainer end to end on a small corpus, with real processes and an SQLite queue:

- ``megatron-ext launch`` (2 ranks = 2 workers) and one ``megatron-ext dipaco worker`` process
  train the same recipe; the final global modules (and their outer momenta) are bit-identical;
- the run writes summary.json (routed perplexities once per sequence and every W tokens, the
  base model's, each path's early-stopping choice) and metrics.jsonl; ``dipaco status`` reports
  the run complete with every module at its last version;
- bad input found at start (a base checkpoint that does not match the model) is one line,
  exit 2, and nothing written.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_ext.config import load_recipe
from megatron_ext.dipaco.layout import ModuleId
from megatron_ext.dipaco.plan import outer_id
from megatron_ext.dipaco.queue import TaskQueue
from megatron_ext.dipaco.recipe import path_layout, queue_url
from megatron_ext.dipaco.store import attempt_dir, load_tensors

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def small_overrides(data: Path, run_dir: Path) -> list[str]:
    """dipaco_tiny shrunk to seconds: 2x2 paths of a 4-block width-32 GPT, 2 phases of 3 steps."""
    return [
        f"run_dir={run_dir}",
        f"data.path={data}/docs",
        f"data.source=[{data}/docs.txt]",
        f"data.tokenizer_model={data}/sp.model",
        "dipaco.tokenizer_vocab_size=400",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.ffn_hidden_size=64",
        "training.seq_length=32",
        "training.micro_batch_size=2",
        "training.global_batch_size=4",
        "training.steps=8",
        "training.lr_warmup_steps=1",
        "dipaco.tau=3",
        "dipaco.phases=2",
        "dipaco.route_tokens=8",
        "dipaco.eval_every_tokens=[8]",
        "dipaco.eval_documents=24",
        "dipaco.lease_seconds=30",
        "dipaco.heartbeat_seconds=2",
        "dipaco.poll_seconds=0.1",
    ]


def run(args: list[str], timeout: int = 400) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MEGATRON_EXT), *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


def final_modules(recipe_overrides: list[str]) -> dict[str, dict]:
    """Each module's last version (parameters and momentum), read from the accepted attempts."""
    recipe = load_recipe("dipaco_tiny", recipe_overrides)
    layout = path_layout(recipe)
    queue = TaskQueue(queue_url(recipe), lease_seconds=1, max_attempts=1, worker="test")
    phases = recipe.sections["dipaco"].phases
    out = {}
    for m in layout.modules:
        task = outer_id(phases - 1, m)
        out[m.name] = load_tensors(
            attempt_dir(recipe.run_dir, task, queue.token(task)) / "module.pt"
        )
    queue.close()
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """600 paragraphs of the Python Language Reference as a .txt corpus."""
    from megatron_ext.data.corpus import python_docs_documents

    folder = tmp_path_factory.mktemp("dipaco_data")
    docs = [d for d in python_docs_documents() if len(d) > 80][:600]
    (folder / "docs.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return folder


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


def test_one_worker_gives_the_same_modules_bit_for_bit(data: Path, launched, tmp_path) -> None:
    overrides = small_overrides(data, tmp_path / "run")
    proc = run(["dipaco", "worker", "dipaco_tiny", *overrides, "--name", "solo"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    ours, theirs = final_modules(overrides), final_modules(launched)
    assert set(ours) == {
        m.name for m in [ModuleId(0, 0), ModuleId(0, 1), ModuleId(1, 0), ModuleId(1, 1)]
    }
    for name, module in ours.items():
        for part in ("params", "momentum"):
            for key, tensor in module[part].items():
                assert torch.equal(tensor, theirs[name][part][key]), (name, part, key)


def test_a_base_checkpoint_that_does_not_match_is_one_line_exit_2(
    data: Path, launched, tmp_path
) -> None:
    bad = tmp_path / "base.pt"
    torch.save({"embedding.word_embeddings.weight": torch.zeros(3, 3)}, bad)
    run_dir = tmp_path / "run"
    overrides = [*small_overrides(data, run_dir), f"dipaco.base_checkpoint={bad}"]
    proc = run(["dipaco", "worker", "dipaco_tiny", *overrides], timeout=200)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("megatron-ext: error")]
    assert len(lines) == 1 and "does not match the model" in lines[0], proc.stderr[-3000:]
    assert not run_dir.exists()
