"""Routed-inference sweeps of ``megatron-ext bench soma`` (CPU).

Two sweeps over the number of experts N (default 8, 32, 256), top-k = 4, the same held-out-sized
windows of the python-stdlib corpus, routers fit once per N:

* ``equal_total``: every N at about the same total body parameters (default: those of N = 8
  experts of width 128, 4.33 M); each N gets the width whose N·(parameters per expert) is
  nearest that total -- the paper's comparison ("at similar total model size, N = 256 small
  experts run 9.19× the tokens/s of N = 8 large ones");
* ``equal_expert``: every N at the same expert width (``--d-model``), so per-token work is the
  same and only the number of experts changes.

Experts are randomly initialised (speed does not depend on training). tokens/s counts each
window's input bytes once, routing included; configurations are timed round-robin (one pass of
each per round) so background load hits them alike, and each reports its fastest round: load
from other jobs only ever slows a pass down (on 2 cores one busy neighbour can make a pass 10x
slower, each thread barrier waiting out a time slice), so the fastest round is the estimate of
the configuration's own cost; the median is kept in the JSON. The ratio N_max / N_min
of each sweep is reported beside the paper's.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

PAPER_RATIO = 9.19  # SOMA paper: N=256 vs N=8 tokens/s at similar total size, top-4
D_EMBED = 32


def body_numel(d_model: int, blocks: int, d_embed: int | None = D_EMBED) -> int:
    """Parameters of one expert of width ``d_model`` (a wide one's own head included);
    ``d_embed=None``: a narrow expert, d_E = d_model (its shared E not counted)."""
    from megatron_ext.soma import BodyLayout, ExpertShape

    e = d_model if d_embed is None else d_embed
    shape = ExpertShape(d_embed=e, d_model=d_model, num_blocks=blocks)
    return BodyLayout.from_shape(shape).numel


def width_for_total(
    n: int,
    total: int,
    blocks: int,
    max_width: int = 1024,
    d_embed: int | None = D_EMBED,
    wide_only: bool = False,
) -> int:
    """The width d whose N·body_numel(d, blocks, d_embed) is nearest ``total`` (ties to the
    smaller d); ``wide_only``: d != d_embed (the paper's wide controls, own head each)."""
    widths = [d for d in range(1, max_width + 1) if not (wide_only and d == d_embed)]
    return min(widths, key=lambda d: (abs(n * body_numel(d, blocks, d_embed) - total), d))


def _configs(args: Any) -> dict[str, list[tuple[int, int]]]:
    total = args.sweep_total or 8 * body_numel(128, args.blocks)
    return {
        "equal_total": [(n, width_for_total(n, total, args.blocks)) for n in args.experts],
        "equal_expert": [(n, args.d_model) for n in args.experts],
    }


def inference_sweeps(args: Any) -> dict[str, Any]:
    """Both sweeps: per sweep the rows (N, width, parameters, tokens/s, routing share) and the
    ratio of the largest N's tokens/s to the smallest N's."""
    import numpy as np
    import torch

    from megatron_ext.soma import (
        BodyLayout,
        ExpertShape,
        RouterConfig,
        build_windows,
        fit_router,
        forward_kind,
        init_body,
        init_embedding,
        routed_throughput,
        window_texts,
    )

    windows = build_windows(["python-stdlib"], window_bytes=1025).windows
    rng = np.random.default_rng(0)
    held_out = windows[
        rng.choice(len(windows), size=min(args.windows, len(windows)), replace=False)
    ]
    routers, fit_s = {}, {}
    for n in args.experts:
        t0 = time.perf_counter()
        routers[n], _ = fit_router(window_texts(windows), RouterConfig(n_clusters=n, seed=0))
        fit_s[n] = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(0)
    runs: dict[tuple[str, int], Any] = {}
    for sweep, rows in _configs(args).items():
        for n, d in rows:
            shape = ExpertShape(d_embed=D_EMBED, d_model=d, num_blocks=args.blocks)
            layout = BodyLayout.from_shape(shape)
            experts = [init_body(shape, gen) for _ in range(n)]
            emb = init_embedding(shape, gen)
            k = min(args.topk, n)

            def once(held=held_out, n=n, experts=experts, emb=emb, layout=layout, k=k):
                return routed_throughput(
                    held, routers[n], experts, emb, layout, k, fused=args.fused
                )

            once(held_out[:8])  # warm-up: allocator, and the fused scan's compile
            with torch.inference_mode():  # what the forward runs on: eager, native or compiled
                kind = forward_kind(args.fused, experts[0][None], emb, layout)
            runs[sweep, n] = (d, layout.numel, k, once, kind)
    samples: dict[tuple[str, int], list[dict[str, float]]] = {key: [] for key in runs}
    for _ in range(args.inference_repeats):
        for key, (*_, once, _kind) in runs.items():
            samples[key].append(once())
    out: dict[str, Any] = {
        "windows": len(held_out),
        "paper_ratio": PAPER_RATIO,
        "rounds": args.inference_repeats,
        "fused": args.fused,
    }
    for sweep in ("equal_total", "equal_expert"):
        rows = []
        for n in args.experts:
            d, numel, k, _, kind = runs[sweep, n]
            got = samples[sweep, n]
            best = max(got, key=lambda r: r["tokens_per_s"])
            tps, routing = best["tokens_per_s"], best["routing_s"] / best["total_s"]
            rows.append(
                {
                    "n_experts": n,
                    "d_model": d,
                    "k": k,
                    "params_per_expert": numel,
                    "total_params": n * numel,
                    "tokens_per_s": tps,
                    "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in got),
                    "tokens_per_s_all": [r["tokens_per_s"] for r in got],
                    "routing_share": routing,
                    "forward": kind,
                    "total_s": best["total_s"],
                    "router_fit_s": fit_s[n],
                }
            )
        lo, hi = rows[0], rows[-1]
        out[sweep] = {
            "rows": rows,
            "ratio": hi["tokens_per_s"] / lo["tokens_per_s"],
            "ratio_of": f"N={hi['n_experts']} / N={lo['n_experts']}",
        }
    return out


def print_sweeps(res: dict[str, Any]) -> None:
    titles = {
        "equal_total": "equal total body parameters",
        "equal_expert": "equal expert size",
    }
    for sweep, title in titles.items():
        s = res[sweep]
        print(
            f"routed inference (CPU), {title}, {res['windows']} windows, routing included, "
            f"fastest of {res['rounds']} rounds, fused={res['fused']}:"
        )
        print(
            f"  {'N':>4s} {'d':>4s} {'k':>2s} {'params/expert':>14s} {'total params':>13s} "
            f"{'tokens/s':>10s} {'routing':>8s}  forward"
        )
        for r in s["rows"]:
            print(
                f"  {r['n_experts']:4d} {r['d_model']:4d} {r['k']:2d} "
                f"{r['params_per_expert']:14,d} {r['total_params']:13,d} "
                f"{r['tokens_per_s']:10,.0f} {r['routing_share']:8.1%}  {r['forward']}"
            )
        print(f"  ratio {s['ratio_of']}: {s['ratio']:.2f}x (paper, equal total: {PAPER_RATIO}x)")
