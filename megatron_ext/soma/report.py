"""End-of-run report (rank 0): routed test loss, baselines, training curves.

Writes ``<run_dir>/summary.json`` (figures below), ``<run_dir>/soma/curves.csv`` (one row per
validation check of every expert and of the seed run) and ``<run_dir>/soma/curves.png``.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_ext.atomic import atomic_path, write_json
from megatron_ext.config.schema import Recipe
from megatron_ext.run.metrics import MetricsLogger
from megatron_ext.soma.corpus import SomaCorpus
from megatron_ext.soma.evaluate import routed_eval, unigram_entropy
from megatron_ext.soma.layout import BodyLayout, ExpertShape
from megatron_ext.soma.recipe import SomaConfig
from megatron_ext.soma.state import SEED_EXPERT, expert_path, load_file


def load_experts(run_dir: Path, n: int) -> list[torch.Tensor]:
    """(numel,) bodies of experts 0..n-1 from their checkpoints."""
    return [load_file(expert_path(run_dir, e))["state"]["theta"] for e in range(n)]


def evaluate_run(recipe: Recipe, corpus: SomaCorpus, emb: torch.Tensor, k: int) -> dict[str, Any]:
    """Routed top-k test loss, the seed body alone, and the unigram entropies (nats/byte)."""
    s = recipe.section(SomaConfig)
    run_dir = Path(recipe.run_dir)
    layout = BodyLayout.from_shape(
        ExpertShape(d_embed=s.d_embed, d_model=s.d_model, num_blocks=s.num_blocks)
    )
    experts = load_experts(run_dir, s.num_experts)
    test = corpus.test
    with torch.inference_mode():
        mix = routed_eval(
            test, corpus.router, experts, emb, layout, k, s.route_bytes, s.score_bytes
        )
        seed_theta = load_file(expert_path(run_dir, SEED_EXPERT))["state"]["theta"]
        seed = routed_eval(
            test,
            corpus.router,
            [seed_theta] * s.num_experts,
            emb,
            layout,
            1,
            s.route_bytes,
            s.score_bytes,
        )
    pool = np.concatenate([corpus.seed_shard.train, corpus.seed_shard.val])
    return {
        "trainer": "soma",
        "num_experts": s.num_experts,
        "k": k,
        "test_windows": mix.windows,
        "test_targets": mix.targets,
        "test_nats_per_byte": mix.nats_per_byte,
        "seed_only_test_nats_per_byte": seed.nats_per_byte,
        "unigram_entropy_train_nats_per_byte": unigram_entropy(corpus.windows[pool]),
        "unigram_entropy_test_nats_per_byte": unigram_entropy(test[:, s.route_bytes + 1 :]),
        "expert_load": mix.expert_load,
        "body_parameters": layout.numel,
    }


def write_curves(run_dir: Path, num_experts: int, log: MetricsLogger) -> Path:
    """curves.csv, and curves.png through the run's logger, from the history stored in every
    checkpoint (under FSO the other ranks' experts are only there)."""
    rows = []
    for e in [SEED_EXPERT, *range(num_experts)]:
        for h in load_file(expert_path(run_dir, e))["state"]["history"]:
            rows.append({"expert": "seed" if e == SEED_EXPERT else e, **h})
    out = run_dir / "soma" / "curves.csv"
    with atomic_path(out) as tmp, open(tmp, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(
            f, fieldnames=["expert", "update", "train_loss", "val_loss", "lr", "eps"]
        )
        w.writeheader()
        w.writerows(rows)
    series = {
        ("seed" if name == "seed" else f"expert {name}"): [
            (r["update"], r["val_loss"]) for r in rows if r["expert"] == name
        ]
        for name in dict.fromkeys(r["expert"] for r in rows)
    }
    log.plot(
        "soma/curves.png",
        series,
        xlabel="update (seed run, then each expert from 0)",
        ylabel="validation loss (nats/byte)",
    )
    return out


def write_run_report(
    recipe: Recipe, corpus: SomaCorpus, emb: torch.Tensor, log: MetricsLogger
) -> dict[str, Any]:
    """Rank 0: the routed evaluation into ``summary.json``, the curves, and the result line."""
    s, run_dir = recipe.section(SomaConfig), Path(recipe.run_dir)
    summary = evaluate_run(recipe, corpus, emb, s.topk())
    write_curves(run_dir, s.num_experts, log)
    write_json(run_dir / "summary.json", summary)
    log.info(
        f"test: routed top-{summary['k']} mixture {summary['test_nats_per_byte']:.4f} nats/byte "
        f"(seed body alone {summary['seed_only_test_nats_per_byte']:.4f}, unigram entropy "
        f"{summary['unigram_entropy_test_nats_per_byte']:.4f}) over {summary['test_windows']} "
        f"windows; wrote {run_dir / 'summary.json'}"
    )
    return summary
