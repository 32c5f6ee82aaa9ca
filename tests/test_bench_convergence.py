"""``megatron-ext bench convergence``: the figures it derives from each run (the real run of two
optimizers through the launcher is its smoke test, tests/test_smoke.py::check_convergence)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron_ext.bench.convergence import parse_variants, summarize
from megatron_ext.errors import ConfigError


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
