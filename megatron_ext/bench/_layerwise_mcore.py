"""``megatron-ext bench layerwise --against megatron-core``: megatron-core's own layer-wise
optimizer and megatron-ext's, side by side in one run.

For each depth (``--depths``) and DP size (``--dp``), torchrun starts that many gloo ranks
(one compute thread each; :mod:`._layerwise_mcore_worker`); every rank builds both arms
(:mod:`._layerwise_mcore_arms`: the same megatron-core GPT and initial weights, the same Muon
settings, megatron-core's ``LayerWiseDistributedOptimizer`` fp32 through
:mod:`megatron_ext.megatron.cpu_compat_layerwise` on a CPU host) and trains them on the same
batches, interleaved step by step, until the iteration-time ratio's spread is at most
``--spread`` or ``--budget`` seconds pass (at least ``--steps`` steps; :mod:`._trust`).

Figures per (depth, DP), ours / megatron-core where a ratio (never pass/fail):

* trajectory: the largest relative difference of the DP-averaged losses over the first
  ``--steps`` steps, and of any parameter (‖Δ‖/‖p‖) at the end;
* bytes per rank per step (the collectives' payload, counted the same way for both arms by
  :mod:`._collective_bytes`): gradient sync (the larger of sent and received, worst rank) and
  parameter gather (received, worst rank);
* time: per step the slowest rank's thread-CPU seconds of the whole iteration, of forward +
  backward + gradient sync and of ``optimizer.step()``; the ratio is the median over steps of
  ours / theirs with its ≈95 % CI (``spread``); wall-clock ratios beside;
* optimizer-state bytes per rank and the peak RSS increase during an iteration (the resident
  set's high-water mark over the resident set before it, median over steps, worst rank), and
  the same within ``optimizer.step()`` and within forward + backward + gradient sync; ours
  minus megatron-core's, paired per rank and step, median with its ≈95 % CI (the figure that
  says whether a gap between the worst-rank medians is more than the step-to-step noise);
* compute imbalance: max / mean over ranks of the per-rank median ``step()`` CPU seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from megatron_ext.bench._trust import load_check, ratio_spread
from megatron_ext.bench.common import progress, set_anchor, write_json

ARMS = ("megatron_core", "megatron_ext")
ANCHOR = (
    "megatron-core 0.19.2's LayerWiseDistributedOptimizer (fp32, Muon from Emerging-Optimizers) "
    "on the same model, data and Muon settings, interleaved step by step in the same run "
    "(ratios: megatron-ext / megatron-core)"
)
MMAP_THRESHOLD = 128 * 1024
#: the JSON's top-level keys of an ``--against megatron-core`` run
JSON_KEYS = ("against", "model", "settings", "load", "runs", "trajectories", "notes", "meta")
NOTES = [
    "megatron-core's arm: get_megatron_optimizer(OptimizerConfig(optimizer='muon', "
    "use_layer_wise_distributed_optimizer=True)); on a CPU host the calls listed in "
    "megatron_ext/megatron/cpu_compat_layerwise.py are replaced (device='cuda' tensors in four "
    "modules, clip_grads' CUDA type assertion, uneven all-gathers as per-rank broadcasts); its raw "
    "inner optimizers are wrapped in megatron-core's FP32Optimizer (its API, not a patch)",
    "interleaving: megatron-ext's parameter all-gather, normally waited on in the next forward, "
    "is waited on at the end of its own iteration, so neither arm's communication runs into the "
    "other's",
    "time: thread CPU seconds of each rank's main thread (one compute thread per rank; gloo's "
    "transfers run on its own threads); the ranks share this host's cores",
]


def add_against_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the side-by-side run (``--dp``, ``--steps``, ``--spread``, ``--budget``
    and ``--json`` are the bench's own)."""
    parser.add_argument(
        "--against",
        choices=("megatron-core",),
        help="run megatron-core's LayerWiseDistributedOptimizer beside megatron-ext's on a GPT "
        "(--depths, --hidden, --vocab) instead of the optimizers' reference workload",
    )
    parser.add_argument(
        "--depths", type=int, nargs="+", default=[2, 4], help="--against: GPT layers (default 2 4)"
    )
    parser.add_argument("--hidden", type=int, default=256, help="--against: width (default 256)")
    parser.add_argument("--vocab", type=int, default=1024, help="--against: vocab (default 1024)")
    parser.add_argument(
        "--seq-length", type=int, default=64, help="--against: tokens per sequence (default 64)"
    )
    parser.add_argument(
        "--global-batch", type=int, default=8, help="--against: sequences per step (default 8)"
    )
    parser.add_argument(
        "--mcore-layout",
        choices=("legacy", "padded"),
        default="legacy",
        help="--against: megatron-core's parameter layout: legacy (whole-gradient all-reduce, "
        "unpadded all-gather; default) or padded (Megatron-LM's default wrap: shard-aligned "
        "buckets, reduce-scatter, buffer all-gather)",
    )


def run_against(args: argparse.Namespace) -> int:
    if args.device == "cpu" and (args.precision == "bf16" or args.mcore_layout == "padded"):
        print(
            "bench layerwise --against megatron-core: megatron-core's bf16 optimizer "
            "(Float16OptimizerWithFloat16Params) and its padded layout's DistributedOptimizer "
            "accept only torch.cuda tensors; on a CPU host use --precision fp32 --mcore-layout "
            "legacy, or run --device cuda (scripts/gpu_mcore_layerwise.py)"
        )
        return 2
    if args.global_batch % max(args.dp):
        print(
            f"bench layerwise --against megatron-core: --global-batch {args.global_batch} must "
            f"divide by every --dp (largest {max(args.dp)}); pick a multiple of it"
        )
        return 2
    set_anchor(ANCHOR)
    sizes = sorted(set(args.dp))
    load = load_check(min(max(sizes), os.cpu_count() or 1), "bench layerwise")
    print(
        f"megatron-core's LayerWiseDistributedOptimizer ({args.mcore_layout} layout) vs "
        f"megatron-ext's, Muon, {args.precision} on {args.device}, GPT "
        f"hidden {args.hidden}, vocab {args.vocab}, {args.global_batch}x{args.seq_length} "
        f"tokens/step; layers {args.depths}, DP {sizes}; >= {args.steps} interleaved steps, "
        f"until the iteration ratio's spread <= {args.spread:.0%} or {args.budget:g} s"
    )
    runs: dict[str, dict[str, Any]] = {}
    trajectories: dict[str, dict[str, list[float]]] = {}
    launches = len(args.depths) * len(sizes)
    with progress("layerwise", "torchrun launches", launches, unit="launch") as shown:
        for depth in args.depths:
            for n in sizes:
                with shown.running(f"layers={depth} DP={n}"):
                    ranks = _launch(n, depth, args)
                if ranks is None:
                    return 1
                key = f"L{depth}_DP{n}"
                runs[key] = summarise(ranks, args.steps)
                trajectories[key] = {a: [r["loss"] for r in ranks[0]["rows"][a]] for a in ARMS}
                print(f"  layers={depth} DP={n}: {runs[key]['steps_run']} steps")
    report = {
        "against": "megatron-core",
        "model": {"hidden": args.hidden, "vocab": args.vocab, "depths": args.depths},
        "settings": {
            "device": args.device,
            "precision": args.precision,
            "mcore_layout": args.mcore_layout,
            "clock": "wall (CUDA-synchronised)" if args.device == "cuda" else "thread CPU",
            "seq_length": args.seq_length,
            "global_batch": args.global_batch,
            "min_steps": args.steps,
            "spread_bound": args.spread,
            "budget_s": args.budget,
        },
        "load": {**load, "at_end": [round(x, 2) for x in os.getloadavg()]},
        "runs": runs,
        "trajectories": trajectories,
        "notes": NOTES,
    }
    print_against(report)
    write_json(report, args.json)
    return 0


def _launch(n: int, depth: int, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    with tempfile.TemporaryDirectory(prefix="bench-layerwise-mcore-") as out:
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={n}", "-m", "megatron_ext.bench._layerwise_mcore_worker",
            f"--layers={depth}", f"--hidden={args.hidden}", f"--vocab={args.vocab}",
            f"--seq={args.seq_length}", f"--global-batch={args.global_batch}",
            f"--steps={args.steps}", f"--warmup={args.warmup}", f"--spread={args.spread}",
            f"--budget={args.budget}", f"--max-steps={args.max_rounds}", f"--out={out}",
            f"--device={args.device}", f"--precision={args.precision}",
            f"--mcore-layout={args.mcore_layout}",
        ]  # fmt: skip
        env = dict(os.environ)
        if args.device == "cpu":
            env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        # glibc: blocks of 128 KiB and more mmapped and unmapped on free, whatever was freed
        # before (no dynamic threshold): each arm's peak is its own, not hidden in the heap
        # the other arm's iteration left behind
        env["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"layers={depth} DP={n}: the ranks failed (exit {proc.returncode}); output:")
            print(proc.stdout[-4000:] + proc.stderr[-4000:])
            return None
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(n)]


def _timed(rows: list[dict[str, Any]], warmup: int) -> list[dict[str, Any]]:
    return rows[warmup:]


def summarise(ranks: list[dict[str, Any]], min_steps: int) -> dict[str, Any]:
    """One (depth, DP) run's figures from its ranks' records (module docstring)."""
    warmup = ranks[0]["warmup"]
    primary = "wall" if ranks[0].get("device") == "cuda" else "thread"  # the ratio's clock
    rows = {a: [_timed(r["rows"][a], warmup) for r in ranks] for a in ARMS}
    steps = len(rows["megatron_core"][0])
    out: dict[str, Any] = {"dp": ranks[0]["world"], "steps_run": ranks[0]["steps_run"]}

    core_loss = [r["loss"] for r in ranks[0]["rows"]["megatron_core"][: warmup + min_steps]]
    ext_loss = [r["loss"] for r in ranks[0]["rows"]["megatron_ext"][: warmup + min_steps]]
    out["loss_steps_compared"] = len(core_loss)
    out["loss_max_rel_diff"] = max(
        abs(a - b) / abs(a) for a, b in zip(core_loss, ext_loss, strict=True)
    )
    out["param_max_rel_diff"] = max(max(r["param_rel_diff"].values()) for r in ranks)

    def slowest(arm: str, span: str, clock: str) -> list[float]:
        return [max(rk[i]["clocks"][span][clock] for rk in rows[arm]) for i in range(steps)]

    for span, label in (("iteration", "iteration"), ("step", "step"), ("fwd_bwd_sync", "fbs")):
        for suffix, clock in (("", primary), ("_wall", "wall")):
            core, ext = slowest("megatron_core", span, clock), slowest("megatron_ext", span, clock)
            est = ratio_spread([e / c for e, c in zip(ext, core, strict=True)])
            out[f"{label}_ratio{suffix}"] = est.median
            out[f"{label}_ratio{suffix}_spread"] = est.spread
            if not suffix:
                out[f"{label}_cpu_s_core"] = statistics.median(core)
                out[f"{label}_cpu_s_ext"] = statistics.median(ext)

    for arm, tag in (("megatron_core", "core"), ("megatron_ext", "ext")):
        grad = [_median_bytes(rk, "grad_bytes", None) for rk in rows[arm]]
        gather = [_median_bytes(rk, "step_bytes", "gather", "received") for rk in rows[arm]]
        out[f"grad_bytes_{tag}"] = max(grad)
        out[f"param_bytes_recv_{tag}"] = max(gather)
        out[f"state_bytes_{tag}"] = max(r["state_bytes"][arm] for r in ranks)
        peaks = [
            statistics.median(x["peak_rss_increase_kib"] for x in rk) * 1024
            if ranks[0]["peak_rss_measured"]
            else float("nan")
            for rk in rows[arm]
        ]
        out[f"peak_rss_increase_{tag}"] = max(peaks)
        # the same per phase: where each arm's transient memory is (the optimizers differ in
        # step(); forward + backward is the same model's)
        for phase in ("fwd_bwd_sync", "step"):
            out[f"peak_rss_increase_{phase}_{tag}"] = max(
                statistics.median(x["peak_rss_increase_phase_kib"][phase] for x in rk) * 1024
                if ranks[0]["peak_rss_measured"]
                else float("nan")
                for rk in rows[arm]
            )
        per_rank_step = [
            statistics.median(x["clocks"]["step"]["thread"] for x in rk) for rk in rows[arm]
        ]
        out[f"compute_imbalance_{tag}"] = max(per_rank_step) / (
            sum(per_rank_step) / len(per_rank_step)
        )
    if ranks[0]["peak_rss_measured"]:
        out |= _peak_rss_diff(rows)
    out["grad_bytes_ratio"] = _ratio(out["grad_bytes_ext"], out["grad_bytes_core"])
    out["param_bytes_ratio"] = _ratio(out["param_bytes_recv_ext"], out["param_bytes_recv_core"])
    out["stopped"] = (ranks[0].get("repeat") or {}).get("stopped", "")
    return out


def _peak_rss_diff(rows: dict[str, list[list[dict[str, Any]]]]) -> dict[str, float]:
    """Ours minus megatron-core's peak RSS increase of an iteration (bytes), paired per rank and
    step (the two iterations run back to back, order alternating): the median over all
    (rank, step) pairs with its ≈95 % CI.  One iteration's figure moves by hundreds of KiB from
    step to step (gloo's threads allocate and free beside the main thread; the kernel samples
    ``VmHWM`` only as the resident set shrinks), so a gap between the two arms' worst-rank
    medians smaller than this CI is noise, not memory one arm holds."""
    diffs = [
        (e["peak_rss_increase_kib"] - c["peak_rss_increase_kib"]) * 1024
        for core, ext in zip(rows["megatron_core"], rows["megatron_ext"], strict=True)
        for c, e in zip(core, ext, strict=True)
    ]
    est = ratio_spread(diffs)
    return {
        "peak_rss_increase_diff": est.median,
        "peak_rss_increase_diff_low": est.low,
        "peak_rss_increase_diff_high": est.high,
    }


def _median_bytes(
    rank_rows: list[dict[str, Any]], key: str, kind: str | None, way: str | None = None
) -> float:
    """Median over steps of one rank's bytes: ``kind`` None sums both kinds; ``way`` None takes
    the larger of sent and received."""

    def one(x: dict[str, Any]) -> float:
        kinds = [x[key][kind]] if kind else list(x[key].values())
        if way:
            return sum(k[way] for k in kinds)
        return max(sum(k["sent"] for k in kinds), sum(k["received"] for k in kinds))

    return statistics.median(one(x) for x in rank_rows)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _f(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_against(report: dict[str, Any]) -> None:
    print()
    print(
        f"{'run':>8s} {'steps':>5s} {'loss Δ':>8s} {'param Δ':>8s} {'iter':>6s} {'±':>5s} "
        f"{'step':>6s} {'±':>5s} {'f+b+s':>6s} {'iter wall':>9s} {'grad B':>6s} "
        f"{'param B':>7s} {'state MiB':>13s} {'peak RSS MiB':>13s} {'step() RSS':>13s} "
        f"{'imbalance':>11s}"
    )
    for key, r in report["runs"].items():
        print(
            f"{key:>8s} {r['steps_run']:5d} {r['loss_max_rel_diff']:8.1e} "
            f"{r['param_max_rel_diff']:8.1e} {r['iteration_ratio']:6.3f} "
            f"{100 * r['iteration_ratio_spread']:4.1f}% {r['step_ratio']:6.3f} "
            f"{100 * r['step_ratio_spread']:4.1f}% {r['fbs_ratio']:6.3f} "
            f"{r['iteration_ratio_wall']:9.3f} {_f(r['grad_bytes_ratio'], '6.3f')} "
            f"{_f(r['param_bytes_ratio'], '7.3f')} "
            f"{r['state_bytes_core'] / 2**20:6.2f}/{r['state_bytes_ext'] / 2**20:<6.2f} "
            f"{r['peak_rss_increase_core'] / 2**20:6.2f}/"
            f"{r['peak_rss_increase_ext'] / 2**20:<6.2f} "
            f"{r['peak_rss_increase_step_core'] / 2**20:6.2f}/"
            f"{r['peak_rss_increase_step_ext'] / 2**20:<6.2f} "
            f"{r['compute_imbalance_core']:5.3f}/{r['compute_imbalance_ext']:<5.3f}"
        )
    print(
        "ratios: megatron-ext / megatron-core. loss Δ: largest relative difference of the "
        "DP-averaged losses over the first --steps steps; param Δ: largest ‖Δp‖/‖p‖ at the end; "
        "iter / step / f+b+s: median over steps of the slowest rank's thread-CPU time of the "
        "iteration / optimizer.step() / forward+backward+gradient sync, ± its ≈95% CI "
        "half-width; grad B: gradient-sync bytes per rank (max of sent, received; worst rank); "
        "param B: parameter bytes received (worst rank); state, peak RSS increase during an "
        "iteration and during optimizer.step() alone (worst rank), compute imbalance (max/mean "
        "step CPU over ranks): megatron-core/megatron-ext"
    )
    for key, r in report["runs"].items():
        print(f"{key}: stopped after {r['steps_run']} steps: {r['stopped']}")
        if "peak_rss_increase_diff" in r:
            print(
                f"{key}: peak RSS increase, ours - megatron-core per rank and step: median "
                f"{r['peak_rss_increase_diff'] / 1024:+.0f} KiB, ≈95% CI "
                f"[{r['peak_rss_increase_diff_low'] / 1024:+.0f}, "
                f"{r['peak_rss_increase_diff_high'] / 1024:+.0f}] KiB"
            )
    if report["load"]["warning"]:
        print(report["load"]["warning"])
