"""End-of-run report (rank 0): routed test loss, baselines, training curves.

Writes ``<run_dir>/summary.json`` (figures below), ``<run_dir>/soma/curves.csv`` (one row per
validation check of every expert and of the seed run) and ``<run_dir>/soma/curves.png``.
"""

from __future__ import annotations

import csv
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_ext.atomic import atomic_path
from megatron_ext.config.schema import Recipe
from megatron_ext.soma.corpus import SomaCorpus
from megatron_ext.soma.evaluate import routed_eval, unigram_entropy
from megatron_ext.soma.layout import BodyLayout, ExpertShape
from megatron_ext.soma.state import SEED_EXPERT, expert_path, load_file
from megatron_ext.training.metrics import write_json_atomic


def load_experts(run_dir: Path, n: int) -> list[torch.Tensor]:
    """(numel,) bodies of experts 0..n-1 from their checkpoints."""
    return [load_file(expert_path(run_dir, e))["state"]["theta"] for e in range(n)]


def evaluate_run(recipe: Recipe, corpus: SomaCorpus, emb: torch.Tensor, k: int) -> dict[str, Any]:
    """Routed top-k test loss, the seed body alone, and the unigram entropies (nats/byte)."""
    s = recipe.soma
    run_dir = Path(recipe.run_dir)
    layout = BodyLayout.from_shape(
        ExpertShape(d_embed=s.d_embed, d_model=s.d_model, num_blocks=s.num_blocks)
    )
    experts = load_experts(run_dir, s.num_experts)
    test = corpus.windows[corpus.test]
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


def write_curves(run_dir: Path, num_experts: int) -> Path:
    """curves.csv + curves.png from the history stored in every checkpoint."""
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

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for name in dict.fromkeys(r["expert"] for r in rows):
        pts = [(r["update"], r["val_loss"]) for r in rows if r["expert"] == name]
        ax.plot(
            *zip(*pts, strict=True), lw=1.2, label=f"{'expert ' if name != 'seed' else ''}{name}"
        )
    ax.set_xlabel("update (seed run, then each expert from 0)")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    with atomic_path(out.with_suffix(".png")) as tmp_png:
        fig.savefig(tmp_png)
    plt.close(fig)
    return out


def write_run_report(
    recipe: Recipe, corpus: SomaCorpus, emb: torch.Tensor, log: Callable[[str], None]
) -> dict[str, Any]:
    run_dir = Path(recipe.run_dir)
    summary = evaluate_run(recipe, corpus, emb, recipe.soma.topk())
    write_curves(run_dir, recipe.soma.num_experts)
    write_json_atomic(run_dir / "summary.json", summary)
    log(
        f"test: routed top-{summary['k']} mixture {summary['test_nats_per_byte']:.4f} nats/byte "
        f"(seed body alone {summary['seed_only_test_nats_per_byte']:.4f}, unigram entropy "
        f"{summary['unigram_entropy_test_nats_per_byte']:.4f}) over {summary['test_windows']} "
        f"windows; wrote {run_dir / 'summary.json'}"
    )
    return summary
