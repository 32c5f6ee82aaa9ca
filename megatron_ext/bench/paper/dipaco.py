"""``megatron-ext bench paper dipaco``: the DiPaCo paper's comparisons with its baselines, on a CPU.

The arms (:mod:`._dipaco_arms`) are runs of the DiPaCo trainer on the Python Language Reference
(SentencePiece tokens), every arm of a seed from the same dense base model, at equal steps per
path (and equal tokens and FLOPs among the P-path arms), evaluated on held-out documents after a
routing prefix (never scored), read to ``dipaco.eval_seq_length`` tokens. Each comparison is a
:class:`~megatron_ext.bench.paper.claims.Claim` whose quantity is a perplexity difference signed
so that the paper's claim is Q > 0, with a precondition: the compared arms' ln(perplexity) at
least 0.3 nats/token below the evaluation text's token-unigram cross-entropy, or, for the
routing and re-routing claims, paths that have specialised (the best path beats the path
average by >= :data:`ROUTING_GAIN_MIN` nats/token on the router documents: otherwise the
discriminative targets are noise). Every arm takes the same outer step (the recipe's Nesterov,
lr 0.7, momentum 0.9), the dense arm included.

Scales: ``quick`` (a 4-block width-32 GPT, 2 phases of τ = 1, 200 documents, 8 evaluation
documents: every comparison, no verdicts) and ``full`` (a 4-block width-64 GPT, vocabulary
1,024, sequence 48, batch 4, a 200-step base, 10 phases of τ = 40 = 400 steps per path,
1,200 documents, 128 evaluation documents of up to 208 tokens: 57 paths × 400 = 22,800 path
steps per seed). The full run of 2026-12-05 (3 seeds, 68,400 path steps plus routing,
early-stopping and evaluation tasks) took 1,593 s on the 2-core machine, partly beside another
study (a 40-step train task: 0.7–1.0 s). The paper's scale
(150M-parameter paths, 256 paths, 64K steps on C4) is 5-6 orders of magnitude away: a claim
that does not reproduce here is reported as such.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from megatron_ext.bench.paper.claims import Claim, Precondition, below_unigram
from megatron_ext.bench.paper.report import StudyResult

PAPER = "dipaco-distributed-path-composition.txt"
TITLE = "DiPaCo (Douillard et al. 2024): the paper's comparisons at CPU scale"
SIZES = ("quick", "full")
CLAIM_IDS = (
    "dense.dipaco_beats_dense_at_equal_steps",
    "paths.4x4_beats_2x2",
    "diloco.dipaco_beats_diloco_p_workers",
    "flat_moe.dipaco_beats_flat_moe_at_equal_paths",
    "routing.discriminative_beats_generative_2x2",
    "routing.discriminative_beats_generative_4x4",
    "rerouting.w64_beats_once",
    "rerouting.w32_beats_w64",
    "rerouting.w16_beats_w32",
    "optimizer.diloco_beats_full_sync_2x2",
    "early_stopping.helps",
    "path_specific.helps",
)
#: what a routing claim needs: the best router must gain this much over a random one (mean per
#: token over the router documents, nats), else its targets are noise. Fixed before any run: a
#: third of the paper's discriminative-over-generative gain (0.7 PPL at ~12.4: ~0.06 nats/token)
ROUTING_GAIN_MIN = 0.02
#: the arms whose paths are routed (a routing gain is measured for them)
ROUTED = ("dipaco_2x2", "dipaco_2x2_gen", "dipaco_4x4", "dipaco_4x4_gen", "flat_moe",
          "path_specific")  # fmt: skip
#: the arms run per seed, in order (the first trains the seed's base model)
ORDER = (
    "dipaco_2x2",
    "dipaco_2x2_gen",
    "dipaco_4x4",
    "dipaco_4x4_gen",
    "dense",
    "diloco",
    "flat_moe",
    "path_specific",
    "full_sync",
)


def run_study(size: Literal["quick", "full"], seeds: list[int], out: Path) -> StudyResult:
    import torch
    from threadpoolctl import threadpool_limits

    # one thread: the arms are tiny matrices, where threads only wait on each other (and on
    # the other processes of a shared machine)
    torch.set_num_threads(1)
    with threadpool_limits(limits=1):
        return _run_study(size, seeds, out)


def _run_study(size: Literal["quick", "full"], seeds: list[int], out: Path) -> StudyResult:
    from megatron_ext.bench._dipaco_measure import write_small_corpus
    from megatron_ext.bench.common import progress
    from megatron_ext.bench.paper import _dipaco_arms as A
    from megatron_ext.config import load_recipe
    from megatron_ext.convert import init_single_process

    init_single_process()
    data = write_small_corpus(out / "data", documents=A.CORPUS[size])
    arms: dict[str, dict[str, Any]] = {arm: {} for arm in (*ORDER, "early_stopping", "corpus")}
    started = time.perf_counter()
    with progress("paper", "dipaco arms", len(seeds) * len(ORDER), unit="arm") as shown:
        for seed in seeds:
            base: Path | None = None
            for arm in ORDER:
                t0 = time.perf_counter()
                run_dir = out / "runs" / f"{arm}_s{seed}"
                recipe = load_recipe(
                    A.RECIPE, A.arm_overrides(arm, size, seed, data, run_dir, base)
                )
                with shown.running(f"seed {seed} {arm}"):
                    if arm == "full_sync":
                        figures = A.full_sync_perplexity(recipe)
                    else:
                        A.run_arm(recipe)
                        figures = dict(A.summary(recipe)["perplexity"])
                if base is None:
                    base = A.base_model(A.context(recipe)[0])
                    arms["corpus"][str(seed)] = {"unigram_entropy": A.unigram_entropy(recipe)}
                if arm in ROUTED:
                    figures["routing_gain"] = A.routing_gain(recipe)
                figures["wall_s"] = time.perf_counter() - t0
                arms[arm][str(seed)] = figures
                print(f"[dipaco] seed {seed} {arm}: " + _line(figures), flush=True)
                if arm == "dipaco_2x2":
                    es = A.early_stopping_perplexities(recipe)
                    arms["early_stopping"][str(seed)] = es
                    print(
                        f"[dipaco] seed {seed} early stopping: on {es['on']:.3f}, "
                        f"off {es['off']:.3f}"
                    )
    settings = {
        "size": size,
        "recipe": A.RECIPE,
        "overrides": A.SIZES[size],
        "corpus_documents": A.CORPUS[size],
        "arms": {arm: A.ARMS.get(arm, A.ARMS["dipaco_2x2_gen"]) for arm in ORDER},
        "wall_s": time.perf_counter() - started,
    }
    plots = [_plot(arms, seeds, out)]
    return StudyResult(_claims(arms, seeds), settings, arms, plots, NOTES)


NOTES = [
    "Data: the Python Language Reference split into paragraphs (not C4), SentencePiece tokens; "
    "every arm of a seed shares the split, the base model and the evaluation documents.",
    "Accounting: every path takes phases x tau inner steps of the same batch (equal steps: the "
    "paper's x-axis, Sec. 4); DiPaCo, flat MoE and DiLoCo have P = 4 paths/workers of the same "
    "size (equal tokens and FLOPs, Table 1); the dense arm is one path at equal steps.",
    "The paper's numbers are for 150M-parameter paths on C4 (16x16 = 256 paths, 88K steps); "
    "ours are perplexities of a tiny GPT; only the sign of each difference is compared.",
    "The paper does not say when its one discriminative re-shard happens; ours is halfway.",
    "Full sync: per-step per-module gradients of the paths that use the module, token-weighted; "
    "one AdamW per module (its own state and clipping); compared with DiPaCo on the same "
    "generative shards (no re-shard in either).",
]


def _line(figures: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in figures.items() if isinstance(v, float))


def _q(arms: dict, seeds: list[int], a: str, ka: str, b: str, kb: str) -> list[float]:
    """Per seed: arms[a][seed][ka] − arms[b][seed][kb] (perplexity points)."""
    return [arms[a][str(s)][ka] - arms[b][str(s)][kb] for s in seeds]


#: claim -> what its precondition reads: ("trained", the (arm, key) perplexities compared) or
#: ("routing", the arm whose paths must have specialised)
PRECONDITIONS: dict[str, tuple[str, Any]] = {
    "dense.dipaco_beats_dense_at_equal_steps": ("trained", [("dense", "once"),
                                                            ("dipaco_2x2", "once")]),
    "paths.4x4_beats_2x2": ("trained", [("dipaco_2x2", "once"), ("dipaco_4x4", "once")]),
    "diloco.dipaco_beats_diloco_p_workers": ("trained", [("diloco", "once"),
                                                         ("dipaco_2x2_gen", "once")]),
    "flat_moe.dipaco_beats_flat_moe_at_equal_paths": ("trained", [("flat_moe", "once"),
                                                                  ("dipaco_2x2", "once")]),
    "routing.discriminative_beats_generative_2x2": ("routing", "dipaco_2x2"),
    "routing.discriminative_beats_generative_4x4": ("routing", "dipaco_4x4"),
    "rerouting.w64_beats_once": ("routing", "dipaco_2x2"),
    "rerouting.w32_beats_w64": ("routing", "dipaco_2x2"),
    "rerouting.w16_beats_w32": ("routing", "dipaco_2x2"),
    "optimizer.diloco_beats_full_sync_2x2": ("trained", [("full_sync", "once"),
                                                         ("dipaco_2x2_gen", "once")]),
    "early_stopping.helps": ("trained", [("early_stopping", "off"), ("early_stopping", "on")]),
    "path_specific.helps": ("trained", [("dipaco_2x2", "once"), ("path_specific", "once")]),
}  # fmt: skip


def _precondition(claim_id: str, arms: dict, seeds: list[int]) -> Precondition:
    """The claim's precondition (:data:`PRECONDITIONS`) on every seed's figures."""
    kind, what = PRECONDITIONS[claim_id]
    if kind == "routing":
        return Precondition(
            f"routing gain of {what}'s paths (best path − mean over paths, per token on the "
            f"router documents) >= {ROUTING_GAIN_MIN} nats/token: the routing targets are not "
            "noise",
            [arms[what][str(s)]["routing_gain"] for s in seeds],
            ROUTING_GAIN_MIN,
            below=False,
        )
    names = ", ".join(f"{a} ({k})" for a, k in what)
    entropy = [arms["corpus"][str(s)]["unigram_entropy"] for s in seeds]
    worst = [max(math.log(arms[a][str(s)][k]) for a, k in what) for s in seeds]
    mean_h = statistics.fmean(entropy)
    # each seed's margin against its own entropy (the split is per seed), shown on the mean's scale
    return below_unigram(
        f"worst ln(perplexity) of {names} (nats/token)",
        [mean_h + w - h for w, h in zip(worst, entropy, strict=True)],
        mean_h,
        unit="nats/token",
    )


def _claims(arms: dict, seeds: list[int]) -> list[Claim]:
    q = lambda *k: _q(arms, seeds, *k)  # noqa: E731
    ppl = "perplexity points"
    found = [
        Claim(
            CLAIM_IDS[0],
            "DiPaCo beats the dense model of one path's size at equal steps",
            "Sec. 4.1, Fig. 8",
            "16x16 DiPaCo ~12.4 vs 150M dense ~14-15 at 88K steps (Fig. 8)",
            f"PPL(dense) − PPL(DiPaCo 2x2, routed once), {ppl}",
            q("dense", "once", "dipaco_2x2", "once"),
            note="ours: 2x2 = 4 paths, not 16x16; the dense arm takes the same outer step "
            "(Nesterov, lr 0.7, momentum 0.9) as every other arm",
        ),
        Claim(
            CLAIM_IDS[1],
            "More paths (finer modules) lower perplexity at equal steps per path",
            "Sec. 4.1, Fig. 8, Table 1",
            "Fig. 8: 2x2 → 4x4 → 8x8 → 16x16 lower perplexity at equal steps (16x16: 12.4 at 88K "
            "steps)",
            f"PPL(DiPaCo 2x2) − PPL(DiPaCo 4x4), both discriminative, routed once, {ppl}",
            q("dipaco_2x2", "once", "dipaco_4x4", "once"),
            note="4x4 has 16 paths on the same corpus: each path's shard is 4x smaller",
        ),
        Claim(
            CLAIM_IDS[2],
            "DiPaCo beats DiLoCo with P workers sharing every parameter at equal tokens/FLOPs",
            "Sec. 4.3, Table 1",
            "DiLoCo 13.8 vs 16x16 DiPaCo 12.4 (Table 1)",
            f"PPL(DiLoCo, 4 workers) − PPL(DiPaCo 2x2), both generative shards, {ppl}",
            q("diloco", "once", "dipaco_2x2_gen", "once"),
            note="DiLoCo's outer step: plain mean of the 4 deltas (no sqrt(P), no token weights), "
            "Nesterov lr 0.7, momentum 0.9",
        ),
        Claim(
            CLAIM_IDS[3],
            "At equal paths, sharing modules beats fully independent paths (flat MoE)",
            "Sec. 4.3, Tables 1-2",
            "256 paths: flat MoE 14.1 at 10K steps (overfits), 13.6 at 64K with top-2 + early "
            "stopping vs 16x16 DiPaCo 12.4 (Table 2); 64 flat paths 12.5 ≈ 16x16 (Table 1)",
            f"PPL(flat MoE, 4 paths) − PPL(DiPaCo 2x2), both discriminative, {ppl}",
            q("flat_moe", "once", "dipaco_2x2", "once"),
            note="the paper's gap appears at 256 paths where shards get small; ours has 4",
        ),
        Claim(
            CLAIM_IDS[4],
            "Discriminative routing beats generative (product k-means) routing, 2x2",
            "Sec. 7.3, Table 5, Fig. 10",
            "8x8: discriminative 0.7 PPL better than product k-means (Table 5); the gain grows "
            "with the number of paths (Fig. 10)",
            f"PPL(generative) − PPL(discriminative), 2x2, routed once, {ppl}",
            q("dipaco_2x2_gen", "once", "dipaco_2x2", "once"),
        ),
        Claim(
            CLAIM_IDS[5],
            "Discriminative routing beats generative (product k-means) routing, 4x4",
            "Sec. 7.3, Table 5, Fig. 10",
            "8x8: 0.7 PPL (Table 5)",
            f"PPL(generative) − PPL(discriminative), 4x4, routed once, {ppl}",
            q("dipaco_4x4_gen", "once", "dipaco_4x4", "once"),
        ),
        Claim(
            CLAIM_IDS[6],
            "Re-routing every 64 tokens at evaluation beats routing once per sequence",
            "Sec. 4.4, Table 3",
            "16x16: once 12.22 (with early stopping) → W=64 11.38 (Table 3)",
            f"PPL(once) − PPL(W=64), DiPaCo 2x2, {ppl}",
            q("dipaco_2x2", "once", "dipaco_2x2", "w64"),
        ),
        Claim(
            CLAIM_IDS[7],
            "Re-routing every 32 tokens beats every 64",
            "Sec. 4.4, Table 3",
            "W=64 11.38 → W=32 11.31 (Table 3)",
            f"PPL(W=64) − PPL(W=32), DiPaCo 2x2, {ppl}",
            q("dipaco_2x2", "w64", "dipaco_2x2", "w32"),
        ),
        Claim(
            CLAIM_IDS[8],
            "Re-routing every 16 tokens beats every 32",
            "Sec. 4.4, Table 3",
            "W=32 11.31 → W=16 11.26 (Table 3)",
            f"PPL(W=32) − PPL(W=16), DiPaCo 2x2, {ppl}",
            q("dipaco_2x2", "w32", "dipaco_2x2", "w16"),
        ),
        Claim(
            CLAIM_IDS[9],
            "DiLoCo beats fully synchronous training (per-step per-module gradients), 2x2",
            "Sec. 4.5",
            "2x2: DiLoCo 0.3 PPL better; 4x4: 0.6; 8x8: full sync 0.1 better (Sec. 4.5)",
            f"PPL(full sync) − PPL(DiPaCo 2x2 with DiLoCo), generative shards, {ppl}",
            q("full_sync", "once", "dipaco_2x2_gen", "once"),
        ),
        Claim(
            CLAIM_IDS[10],
            "Path-specific early stopping improves perplexity",
            "Sec. 2.7, Table 3",
            "16x16, routed once: 12.39 → 12.22 with early stopping (Table 3)",
            f"PPL(last versions) − PPL(early-stopping versions), DiPaCo 2x2, once, {ppl}",
            q("early_stopping", "off", "early_stopping", "on"),
            note="Q = 0 when every path's best version is its last (no overfitting yet)",
        ),
        Claim(
            CLAIM_IDS[11],
            "Path-specific modules (unshared blocks) improve perplexity at equal paths",
            "Sec. 2.6.1 / 4.2, Fig. 9",
            "Fig. 9: curves with path-specific modules lie below (values not printed)",
            f"PPL(2x2 all shared) − PPL(2x2, blocks 0 and 3 path-specific), {ppl}",
            q("dipaco_2x2", "once", "path_specific", "once"),
        ),
    ]
    assert tuple(c.id for c in found) == CLAIM_IDS
    return [replace(c, precondition=_precondition(c.id, arms, seeds)) for c in found]


def _plot(arms: dict, seeds: list[int], out: Path) -> str:
    """Once-per-sequence perplexity of every arm (mean and each seed), and 2x2's W sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_ext.atomic import atomic_path

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.2), width_ratios=(2.2, 1))
    names = [a for a in ORDER]
    for i, arm in enumerate(names):
        ys = [arms[arm][str(s)]["once"] for s in seeds]
        ax.bar(i, sum(ys) / len(ys), color="#9ab", width=0.7)
        ax.plot([i] * len(ys), ys, "k.", ms=6)
    ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel("eval perplexity, routed once")
    ax.set_title("arms (bars: mean, dots: seeds)")
    lo = min(arms[a][str(s)]["once"] for a in names for s in seeds)
    ax.set_ylim(bottom=lo * 0.95)
    keys = ["once", "w64", "w32", "w16"]
    for s in seeds:
        bx.plot(keys, [arms["dipaco_2x2"][str(s)][k] for k in keys], "o-", label=f"seed {s}")
    bx.set_title("DiPaCo 2x2: re-routing every W tokens")
    bx.set_ylabel("eval perplexity")
    bx.legend(fontsize=8)
    fig.tight_layout()
    name = "paper_dipaco.png"
    with atomic_path(out / name) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return name
