"""``megatron-ext bench paper soma``: the SOMA paper's comparisons, with its baselines, here.

Every arm is trained in-process with the trainer's own update (:mod:`._soma_train`) on the
python-stdlib docstrings split by document (the test set: one window per held-out document), and
scored by the routed top-k evaluation (route on the first ``route_bytes``, score the next
``score_bytes``, nats/byte). The comparisons (paper sections in each claim):

1. N sweep at fixed expert width (Fig. 7 left): same seed body, same updates per expert;
2. SOMA N = 2 vs the monolith at ~equal total size and equal arithmetic compute (Fig. 1,
   Table 4, Table 7): both are the paper's wide controls (own tied head per expert, delta rule,
   projections), widths from Table 2's count, the monolith's updates · F_1 = 2 · SOMA's updates
   · F_2 (Eq. 21, F the forward FLOPs per token);
3. independent vs summed losses as training runs (Fig. 4, App. J): SOMA N = 4 continued from the
   same weights and Adam states, same data and probes, one arm each;
4. k sweep at evaluation (Fig. 16) on the largest N of the sweep;
5. variance cut by sharding at fixed total size (Fig. 10, Eq. 4), and summed vs independent
   losses at fixed weights (Fig. 11 left);
6. inference at equal total size: few large vs many small experts, top-4 (Table 12).

Sizes: ``quick`` (tiny widths, a few updates: the shape of every comparison, no evidence) and
``full`` (d_E = 32, D = 2, n_pert = 8, B = 4, T = 128, 513-byte windows routed on 128 bytes and
scored on 384 -- the stdlib docstrings hold too few documents of 1,025 bytes for a test set --;
N sweep 1, 2, 4, 8 at width 32, 70 updates per expert after a 60-update seed run; variance at
fixed weights on B = 2, T = 64, n_pert = 4, 16 repeats; inference N = 8 (wide) vs N = 64 (width
32) at ~2.1M parameters; estimated 25-30 min for 2 seeds on the loaded 2-core host from measured
per-update and per-measurement times, see :data:`SCALES`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Literal

from megatron_ext.bench._soma_inference import body_numel, width_for_total
from megatron_ext.bench.paper._soma_train import Scale

PAPER = "soma-scaling-zero-order-pretraining.txt"
TITLE = "SOMA (Scaling Zero-Order Pretraining through Model Sharding): the paper's comparisons"
SIZES = ("quick", "full")
CLAIM_IDS = (
    "scaling.more_experts_fixed_width",
    "compute.soma_n2_beats_monolith",
    "mechanism.independent_beats_summed",
    "inference.k4_beats_k1",
    "inference.k4_beats_all_experts",
    "variance.sharding_cuts_variance",
    "variance.summed_over_independent_is_n",
    "inference.many_small_experts_faster",
)

#: per size: the training scale and every comparison's own numbers
SCALES: dict[str, dict[str, Any]] = {
    "quick": {
        "scale": Scale(d_embed=8, blocks=1, n_pert=4, batch=4, seq=32, window_bytes=129,
                       route_bytes=32, score_bytes=64, seed_updates=4, updates=6,
                       corpus_bytes=120_000),
        "n_sweep": (1, 2, 8), "width": 8, "mono_width": 16, "summed_n": 4,
        "summed_updates": 4, "var_total_n": (1, 4), "var_width": 16, "var_repeats": 12,
        "var_batch": 2, "var_seq": 16, "var_n_pert": 4,
        "tp_n": (2, 16), "tp_rounds": 1, "tp_windows": 16,
    },
    "full": {
        "scale": Scale(d_embed=32, blocks=2, n_pert=8, batch=4, seq=128, window_bytes=513,
                       route_bytes=128, score_bytes=384, seed_updates=60, updates=70,
                       corpus_bytes=1_500_000, test_fraction=0.1),
        "n_sweep": (1, 2, 4, 8), "width": 32, "mono_width": 64, "summed_n": 4,
        "summed_updates": 35, "var_total_n": (1, 8), "var_width": 64, "var_repeats": 16,
        "var_batch": 2, "var_seq": 64, "var_n_pert": 4,
        "tp_n": (8, 64), "tp_rounds": 2, "tp_windows": 64,
    },
}  # fmt: skip


def _compute_matched_updates(sc: Scale, w_mono: int, w_soma: int, n: int) -> int:
    """SOMA's updates per expert at the monolith's arithmetic compute (Eq. 21:
    C = 2·T·n_pert·B·N·F_N·s, equal T, n_pert, B): s_N = s_1·F_1 / (N·F_N)."""
    from megatron_ext.bench.soma import forward_flops_per_token as flops

    f1, fn = flops(w_mono, sc.d_embed, sc.blocks), flops(w_soma, sc.d_embed, sc.blocks)
    return max(1, round(sc.updates * f1 / (n * fn)))


def _run_seed(cfg: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every arm of one seed: its raw figures (losses nats/byte, ratios, tokens/s)."""
    from megatron_ext.bench.paper import _soma_measure as meas
    from megatron_ext.bench.paper import _soma_train as tr

    sc, w = cfg["scale"], cfg["width"]
    out: dict[str, Any] = {}
    ens = {n: tr.ensemble(sc, n, w, seed) for n in cfg["n_sweep"]}
    out["n_sweep"] = {str(n): tr.test_loss(e) for n, e in ens.items()}
    big = ens[max(ens)]
    out["k_sweep"] = {str(k): tr.test_loss(big, k) for k in range(1, big.n + 1)}
    w1 = cfg["mono_width"]
    w2 = width_for_total(2, sc.layout(w1).numel, sc.blocks, d_embed=sc.d_embed, wide_only=True)
    mono = tr.ensemble(sc, 1, w1, seed)
    s2 = _compute_matched_updates(sc, w1, w2, 2)
    soma2 = tr.ensemble(sc, 2, w2, seed, updates=s2)
    from megatron_ext.bench.soma import forward_flops_per_token as flops

    out["monolith"] = {
        "test_loss": tr.test_loss(mono), "updates": sc.updates, "width": w1,
        "params": sc.layout(w1).numel, "flops_per_token": flops(w1, sc.d_embed, sc.blocks),
    }  # fmt: skip
    out["soma_n2"] = {
        "test_loss": tr.test_loss(soma2), "updates": s2, "width": w2,
        "params": 2 * sc.layout(w2).numel, "flops_per_token": flops(w2, sc.d_embed, sc.blocks),
    }  # fmt: skip
    start = ens.get(cfg["summed_n"]) or tr.ensemble(sc, cfg["summed_n"], w, seed)
    arms = {
        m: tr.advance(start.clone(), cfg["summed_updates"], m) for m in ("independent", "summed")
    }
    out["loss_mode"] = {m: tr.test_loss(e) for m, e in arms.items()}
    out["loss_mode"]["start"] = tr.test_loss(start)
    windows = tr.corpus(sc).windows
    kw = dict(
        batch=cfg["var_batch"], seq=cfg["var_seq"], n_pert=cfg["var_n_pert"],
        repeats=cfg["var_repeats"], seed=seed,
    )  # fmt: skip
    n1, nn = cfg["var_total_n"]
    total = n1 * body_numel(cfg["var_width"], sc.blocks, None)  # narrow: d_E = d
    out["variance"] = {
        str(n): meas.sharded_variance(
            n, width_for_total(n, total, sc.blocks, d_embed=None), sc.blocks, windows, **kw
        )
        for n in (n1, nn)
    }
    out["summed_variance"] = meas.summed_vs_independent_ratio(
        cfg["summed_n"], w, sc.blocks, windows, **kw
    )
    test = tr.corpus(sc).test[: cfg["tp_windows"]]
    out["throughput"] = meas.throughput(
        cfg["tp_n"], sc.blocks, windows, test, route_bytes=sc.route_bytes,
        score_bytes=sc.score_bytes, rounds=cfg["tp_rounds"], seed=seed,
    )  # fmt: skip
    return out


def _ratio_se(per: list[dict[str, Any]]) -> float:
    """2 × the relative standard error of summed/independent, from the two variance estimates'
    own standard errors (:func:`megatron_ext.soma.variance.relative_standard_error`)."""
    sv = [p["summed_variance"] for p in per]
    se = [math.hypot(v["summed_rel_se"], v["independent_rel_se"]) for v in sv]
    return 2 * sum(se) / len(se)


def _claims(cfg: dict[str, Any], arms: dict[str, dict[str, Any]], seeds: list[int]) -> list[Any]:
    from megatron_ext.bench.paper.claims import Claim

    per = [arms[str(s)] for s in seeds]
    ns, n_small, n_big = cfg["n_sweep"], *cfg["tp_n"]
    nmin, nmax = str(min(ns)), str(max(ns))
    kmax, n1, nn = str(max(ns)), *cfg["var_total_n"]
    sc = cfg["scale"]
    return [
        Claim(
            "scaling.more_experts_fixed_width",
            "Adding fixed-width experts lowers loss monotonically (more total parameters and work, "
            "same n_pert and B)",
            "Sec. 6 'Scaling sweeps', Fig. 7 left, App. A",
            "N 1→256 lowers ensemble validation loss 1.84→1.72 (~184 h); at 4M updates 1.86→1.72",
            f"test loss N={nmin} − N={nmax} at width {cfg['width']}, equal updates per expert "
            "(nats/byte)",
            [p["n_sweep"][nmin] - p["n_sweep"][nmax] for p in per],
            note=f"N in {list(ns)}; the sweep's losses are in arms; single corpus, "
            f"{sc.updates} updates per expert",
        ),
        Claim(
            "compute.soma_n2_beats_monolith",
            "At ~equal total size and training compute SOMA N=2 beats monolithic SPSA",
            "Sec. 6 'Training compute at fixed model size', Fig. 1, Table 4, Table 7",
            "1.76 vs 2.00 test nats/byte near 150 GPU-h (Table 4); equal tuning, 3 seeds: "
            "2.2232 vs 2.2628, mean 0.0396 (Table 7)",
            "test loss monolith − SOMA N=2 (nats/byte), both wide controls (own delta-rule head)",
            [p["monolith"]["test_loss"] - p["soma_n2"]["test_loss"] for p in per],
            note=f"widths {per[0]['monolith']['width']} (N=1) / {per[0]['soma_n2']['width']} "
            "(N=2) at "
            f"{per[0]['monolith']['params']} / {per[0]['soma_n2']['params']} parameters; "
            f"equal arithmetic compute (Eq. 21): {per[0]['monolith']['updates']} monolith "
            f"updates vs {per[0]['soma_n2']['updates']} per expert; no lr tuning",
        ),
        Claim(
            "mechanism.independent_beats_summed",
            "Independent expert losses beat their sum as training runs (same start, Adam state, "
            "data, probes, updates)",
            "Sec. 6 'Independent expert losses', Fig. 4, App. J",
            "−0.035 nats/byte after 1,000 updates of SOMA N=4 (0.0362, 0.0339, 0.0353)",
            f"test loss summed − independent after {cfg['summed_updates']} further updates of "
            f"N={cfg['summed_n']} (nats/byte)",
            [p["loss_mode"]["summed"] - p["loss_mode"]["independent"] for p in per],
            note="the start is our own N=4 ensemble (paper: experts 0–3 of N=8 at 2,000 updates)",
        ),
        Claim(
            "inference.k4_beats_k1",
            "Averaging the top-4 routed experts beats the top-1 at evaluation, no retraining",
            "Sec. 8, Fig. 16, App. N.2",
            "top-k with k=4 captures most of the gain (Fig. 16); N=256 at k=4: 1.72",
            f"test loss k=1 − k=4 on the N={kmax} ensemble (nats/byte)",
            [p["k_sweep"]["1"] - p["k_sweep"][str(min(4, max(ns)))] for p in per],
        ),
        Claim(
            "inference.k4_beats_all_experts",
            "Evaluating all N experts gives higher loss than the top-4",
            "Sec. 8, Fig. 16",
            "N=256: all 256 experts cost more and give higher loss; k 4→12 lowers it by 0.013",
            f"test loss k=N − k=4 on the N={kmax} ensemble (nats/byte)",
            [p["k_sweep"][kmax] - p["k_sweep"][str(min(4, max(ns)))] for p in per],
        ),
        Claim(
            "variance.sharding_cuts_variance",
            "At fixed total size, N independent shards have lower relative gradient variance "
            "than the monolith (≈ 1/N of it, Eq. 4)",
            "Sec. 5, Eq. 4, Fig. 10, App. G.1",
            "N=256 vs N=1 at ~8.44M: 118× lower relative centered variance (136× at 5,000 "
            "updates; float64 136×/121×)",
            f"ln(R(N={n1}) / R(N={nn})) at equal total size (widths "
            f"{per[0]['variance'][str(n1)]['d']} / {per[0]['variance'][str(nn)]['d']}), "
            "R = Σ tr Cov(ĝ) / Σ ‖g‖²",
            [
                math.log(p["variance"][str(n1)]["measured"] / p["variance"][str(nn)]["measured"])
                for p in per
            ],
            note="fresh (untrained) bodies, float64, ε=1e-5; predicted ratios in arms",
        ),
        Claim(
            "variance.summed_over_independent_is_n",
            "On one fixed separable objective, summed losses have ≈ N× the relative variance of "
            "independent ones (prediction (M−1)/(M/N−1))",
            "Sec. 5, Fig. 11 left, App. G.2",
            "N=4: 4.02× measured vs 4.00× predicted",
            f"measured ratio / predicted ratio − 1 at N={cfg['summed_n']}",
            [
                p["summed_variance"]["ratio"] / p["summed_variance"]["predicted_ratio"] - 1
                for p in per
            ],
            expect="equal",
            tolerance=_ratio_se(per),
            note="tolerance: twice the measured ratio's own relative standard error (the two "
            "variances' standard errors over the repeats, mean over seeds)",
        ),
        Claim(
            "inference.many_small_experts_faster",
            "At ~equal total size with top-4 routing, many small experts run more tokens/s than "
            "fewer large ones",
            "Sec. 8, Table 12, App. N.1",
            "N=256 2.36M vs N=8 257k tokens/s (9.19×, routing included; A40/RTX GPU)",
            f"ln(tokens/s N={n_big} / N={n_small}), routing included, this CPU",
            [
                math.log(
                    p["throughput"][str(n_big)]["tokens_per_s"]
                    / p["throughput"][str(n_small)]["tokens_per_s"]
                )
                for p in per
            ],
            note="untrained bodies (speed does not depend on training); CPU, not the paper's "
            "Triton kernels; machine shared with other jobs",
        ),
    ]


def _plot(cfg: dict[str, Any], arms: dict[str, Any], out: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_ext.atomic import save_figure

    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    for seed, a in arms.items():
        ns = sorted(a["n_sweep"], key=int)
        ax[0].plot([int(n) for n in ns], [a["n_sweep"][n] for n in ns], "o-", label=f"seed {seed}")
        ks = sorted(a["k_sweep"], key=int)
        ax[1].plot([int(k) for k in ks], [a["k_sweep"][k] for k in ks], "o-", label=f"seed {seed}")
        bars = [a["monolith"]["test_loss"], a["soma_n2"]["test_loss"],
                a["loss_mode"]["summed"], a["loss_mode"]["independent"]]  # fmt: skip
        ax[2].plot(range(4), bars, "o", label=f"seed {seed}")
    ax[0].set(xscale="log", xlabel="experts N (fixed width)", ylabel="test loss (nats/byte)",
              title="N sweep (Fig. 7 left)")  # fmt: skip
    ax[0].set_xticks(list(cfg["n_sweep"]), [str(n) for n in cfg["n_sweep"]])
    ax[0].minorticks_off()
    ax[1].set(xlabel="active experts k", title=f"k sweep, N={max(cfg['n_sweep'])} (Fig. 16)")
    ax[2].set_xticks(range(4), ["monolith", "SOMA N=2", "summed", "independent"])
    ax[2].set(title="equal size+compute (Fig. 1) | loss rule (Fig. 4)")
    for a_ in ax:
        a_.legend(fontsize=7)
        a_.grid(alpha=0.3)
    name = "paper_soma.png"
    save_figure(fig, out / name)
    return name


def run_study(size: Literal["quick", "full"], seeds: list[int], out: Path) -> Any:
    """Every comparison at ``size`` for each seed; the claims, raw figures and the plot."""
    import time

    import torch

    from megatron_ext.bench.paper.report import StudyResult

    cfg = SCALES[size]
    torch.set_num_threads(min(2, torch.get_num_threads()))
    t0 = time.perf_counter()
    arms = {str(s): _run_seed(cfg, s) for s in seeds}
    plot = _plot(cfg, arms, out)
    settings = {k: (v.__dict__ if isinstance(v, Scale) else v) for k, v in cfg.items()}
    settings["wall_s"] = round(time.perf_counter() - t0, 1)
    from megatron_ext.bench.paper import _soma_train as tr

    settings["test_windows"] = len(tr.corpus(cfg["scale"]).test)
    settings["train_windows"] = len(tr.corpus(cfg["scale"]).windows)
    notes = [
        "Corpus: the python-stdlib docstrings, split by document (one test window per held-out "
        "document), not FineWeb-Edu; routers fit on the training windows (tf-idf, SVD 32).",
        "No plateau lr/ε decay: every run is shorter than the paper's 1,000-update patience.",
        "Seeds change the initial weights, batches and probes; corpus, split and routers are "
        "fixed (paper Table 7: seeds change batches and probes from a fixed checkpoint).",
        "The seed runs' cost is excluded from the compute match, as in the paper (App. I).",
    ]
    return StudyResult(_claims(cfg, arms, seeds), settings, arms, [plot], notes)
