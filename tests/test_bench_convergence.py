"""``megatron-ext bench convergence``: the figures it derives from each run, and one real run of
two optimizers through the launcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.bench.convergence import parse_variants, summarize
from megatron_ext.errors import ConfigError
from tests.test_training import TEXT


def _write_metrics(run_dir: Path, losses: list[float], val: dict[int, float]) -> None:
    run_dir.mkdir(parents=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for i, loss in enumerate(losses, start=1):
            row = {"step": i, "consumed_tokens": 100 * i, "loss": loss, "grad_norm": float(i)}
            row |= {"step_time_s": 2.0 if i == 1 else 1.0, "optimizer_s": 0.25}
            f.write(json.dumps(row) + "\n")
            if i in val:
                f.write(json.dumps({"step": i, "consumed_tokens": 100 * i, "val_loss": val[i]}))
                f.write("\n")


def test_summary_figures_are_means_of_the_last_k(tmp_path: Path) -> None:
    _write_metrics(tmp_path / "r", [5.0, 4.0, 3.0, 2.0], {2: 3.5, 4: 2.5})
    s = summarize(tmp_path / "r", last=2)
    assert s["train_loss"] == 2.5  # mean of 3.0 and 2.0
    assert s["val_loss"] == 2.5  # the evaluation after the last step
    assert s["step_time_s"] == 1.0  # median, the first (start-up) step left out
    assert s["optimizer_share"] == 0.25
    assert s["max_grad_norm"] == 4.0
    assert s["tokens"] == 400


def test_unknown_variants_are_refused() -> None:
    assert list(parse_variants("muon,kl_soap+ns")) == ["muon", "kl_soap+ns"]
    with pytest.raises(ConfigError, match=r"unknown variant.*'sgd'.*known: adamw"):
        parse_variants("muon,sgd")


def test_two_optimizers_through_the_launcher(tmp_path: Path) -> None:
    """A real run: each variant trains the same tokens; the JSON and the PNG are written; the
    losses in the JSON are those of the runs' own metrics."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT, encoding="utf-8")
    overrides = [
        f"data.path={tmp_path / 'data' / 'corpus'}",
        f"data.source=[{corpus}]",
        "model.num_layers=1",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.num_query_groups=1",
        "model.ffn_hidden_size=64",
        "training.steps=6",
        "training.seq_length=32",
        "training.micro_batch_size=2",
        "training.global_batch_size=4",
        "training.lr_warmup_steps=1",
        "training.lr_wsd_decay_steps=2",
        "training.eval_interval=3",
        "training.eval_iters=1",
        "optimizer.lr=3e-3",
        "logging.tensorboard=false",
    ]
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "megatron_ext.launch.cli", "bench", "convergence"]
    cmd += ["tiny_cpu_gpt", *overrides, "--optimizers", "adamw,muon", "--last", "3"]
    cmd += ["--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "optimizer" in done.stdout and "muon" in done.stdout
    payload = json.loads((out / "convergence.json").read_text())
    assert set(payload["results"]) == {"adamw", "muon"}
    assert (out / "convergence.png").stat().st_size > 10_000
    for name, r in payload["results"].items():
        rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        losses = [x["loss"] for x in rows if "loss" in x]
        assert r["train_loss"] == pytest.approx(sum(losses[-3:]) / 3)
        assert r["tokens"] == 6 * 4 * 32
        assert r["val_loss"] is not None and 0 < r["optimizer_share"] < 1
    summaries = {n: json.loads((out / n / "summary.json").read_text()) for n in ("adamw", "muon")}
    assert summaries["adamw"]["optimizer"] == "adamw" and summaries["muon"]["optimizer"] == "muon"
    # same data and schedule, different optimizers: the first step's loss is the same
    assert summaries["adamw"]["first_loss"] == summaries["muon"]["first_loss"]
