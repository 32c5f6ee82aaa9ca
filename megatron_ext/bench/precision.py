"""``megatron-ext bench precision RECIPE --precisions bf16,mxfp8``: one recipe, once per precision.

Every run goes through the normal launcher with the same seed, data order and token count, and
from the same initial weights: the first precision's run writes its step-0 checkpoint
(``checkpoint.save_initial``) and every other run starts from it (``checkpoint.load`` of a
step-0 checkpoint loads its weights only, rounded to the run's own dtype). Every precision is
checked against the hardware rules (:mod:`megatron_ext.run.hardware`) before the first run
starts: a precision this machine cannot run stops the bench with the gate's one line (exit 2).

Printed and written (``precision.json``, ``precision.png``):

* the loss at matched tokens (the mean of a few steps ending at 25/50/75/100% of the run) and
  the final loss (mean of the last K steps) with its delta against the first precision; with
  ``--noise`` the first precision runs once more with the next seed (fresh initial weights and
  data order), and the two runs' final-loss difference is the run-to-run noise each delta is
  read against;
* per device (a GPU, or a gloo rank on a CPU host): tokens/s, model TFLOP/s (the trainer's
  FLOP model) and MFU against the device's dense BF16 peak, for FP8/FP4 runs too (the usual
  convention; labelled), or on a CPU host against the measured fp32 matmul rate of one rank's
  threads (labelled: a CPU has no BF16 peak on record); peak memory allocated and reserved on
  CUDA, the process's peak resident set on CPU (labelled);
* each precision's step time against the first's: the median of the per-step ratios (step i
  of this run over step i of the first, the first step left out) with its ≈95 % CI spread
  (:func:`megatron_ext.bench._trust.ratio_spread`). The precisions are whole launches, one after
  another, so they cannot be interleaved step by step: a load average above the cores the runs
  use is warned about and recorded (``load``), and the ratio is to be read with it;
* one PNG: the loss curves overlaid, and each precision's per-step loss minus the first's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
from pathlib import Path
from typing import Any

from megatron_ext.bench._trust import load_check, ratio_spread
from megatron_ext.errors import ConfigError

DESCRIPTION = "one recipe once per precision, same start: loss deltas, tokens/s, MFU, memory"
MARKS = (0.25, 0.5, 0.75, 1.0)  # fractions of the run where losses are compared


QUICK = {"steps": 8, "last": 2}
EXAMPLE = "megatron-ext bench precision tiny_cpu_gpt --precisions fp32,bf16 --quick"
#: the JSON's top-level keys (``precision.json``); ``results`` holds one entry per precision
JSON_KEYS = (
    "precisions",
    "reference",
    "last",
    "steps",
    "matched_tokens",
    "matched_window",
    "noise",
    "mfu_basis",
    "peak_tflops_per_device",
    "results",
    "curves",
    "recipe",
    "overrides",
    "device",
    "start_checkpoint",
    "noise_run",
    "load",
    "meta",
)
#: the baseline this benchmark's ratios are against (``meta.anchor`` of its JSON)
ANCHOR = (
    "the first --precisions entry: same start weights, seed, data and tokens; noise: its "
    "second-seed run (--noise)"
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from megatron_ext.run import PRECISIONS

    p.add_argument("recipe", help="recipe file or shipped recipe name")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    p.add_argument(
        "--precisions",
        default="fp32,bf16",
        help=f"comma-separated, the first is the reference; known: {', '.join(PRECISIONS)}",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training.steps of every run, the recipe's schedule scaled with it (printed)",
    )
    p.add_argument("--last", type=int, default=20, help="K: final losses are means of the last K")
    p.add_argument(
        "--noise", action="store_true", help="run the first precision again with the next seed"
    )
    p.add_argument("--out", default="runs/bench_precision", help="folder of runs, PNG and JSON")
    p.add_argument("--json", default=None, help="also write the JSON here")


def parse_precisions(spec: str) -> list[str]:
    """The precisions named in ``spec``, in order (``ConfigError`` for an unknown or repeated
    one)."""
    from megatron_ext.run import PRECISIONS

    names = [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [n for n in names if n not in PRECISIONS]
    if unknown or not names or len(set(names)) != len(names):
        raise ConfigError(
            f"--precisions {spec!r}: give distinct known precisions (unknown: {unknown}); "
            f"known: {', '.join(PRECISIONS)}"
        )
    return names


def run(args: argparse.Namespace) -> int:
    from megatron_ext.bench.common import launch_run, progress, run_length_overrides, write_json
    from megatron_ext.config import load_recipe
    from megatron_ext.run import probe_device, unmet_requirement

    precisions = parse_precisions(args.precisions)
    if args.last < 1:
        raise ConfigError(f"--last must be >= 1, got {args.last}")
    overrides = run_length_overrides(args.recipe, args.overrides, args.steps, "precision")
    recipe = load_recipe(args.recipe, overrides)  # a bad recipe fails before any run starts
    device = probe_device()
    for reason in (unmet_requirement(p, device) for p in precisions):
        if reason is not None:  # fail closed before the first run
            raise ConfigError(reason)
    out = Path(args.out)
    launch = recipe.launch  # threads_per_rank 0: the ranks share every core
    cores = launch.nproc_per_node_cpu * launch.threads_per_rank or os.cpu_count() or 1
    load = load_check(len(device.names) if device.gpus else cores, "bench precision")
    common = [*overrides, "checkpoint.save_interval=0", "checkpoint.save_at_end=false"]
    reference = precisions[0]
    start = out / reference / "checkpoints" / "step_000000"
    plan = [(reference, reference, ["checkpoint.load=none", "checkpoint.save_initial=true"])]
    plan += [(p, p, [f"checkpoint.load={start}"]) for p in precisions[1:]]
    noise_name = f"{reference}_seed{recipe.seed + 1}"
    if args.noise:
        seed = f"seed={recipe.seed + 1}"
        plan.append((noise_name, reference, ["checkpoint.load=none", seed]))
    with progress("precision", "runs", len(plan)) as shown:
        for name, precision, extra in plan:
            print(f"[precision] {name}: running", flush=True)
            shutil.rmtree(out / name, ignore_errors=True)
            with shown.running(name):
                launch_run(
                    args.recipe,
                    [*common, f"training.precision={precision}", *extra],
                    out / name,
                    name,
                )
    runs = {name: read_run(out / name, args.last) for name, _, _ in plan}
    noise = (
        abs(runs[noise_name]["final_loss"] - runs[reference]["final_loss"]) if args.noise else None
    )
    peak = device_peak(device, recipe.launch.threads_per_rank)
    report = build_report(precisions, runs, args.last, peak, noise)
    report |= {
        "recipe": args.recipe,
        "overrides": overrides,
        "device": device.describe(),
        "start_checkpoint": str(start),
        "noise_run": noise_name if args.noise else None,
        "load": {**load, "interleaved": False, "why": "each precision is its own launch"},
    }
    print(format_report(report))
    plot(report, runs, out / "precision.png", f"{args.recipe} {' '.join(overrides)}".strip())
    print(f"wrote {out / 'precision.png'}")
    for path in filter(None, (str(out / "precision.json"), args.json)):
        write_json(report, path)
    return 0


def read_run(run_dir: Path, last: int) -> dict[str, Any]:
    """One run's curve (metrics.jsonl) and figures (summary.json)."""
    from megatron_ext.bench.common import read_metrics

    train, _ = read_metrics(run_dir)
    summary = json.loads((run_dir / "summary.json").read_text())
    return {
        "steps": [r["step"] for r in train],
        "tokens": [r["consumed_tokens"] for r in train],
        "loss": [r["loss"] for r in train],
        "final_loss": statistics.fmean(r["loss"] for r in train[-last:]),
        "precision": summary["precision"],
        "tokens_per_s_per_device": summary["tokens_per_s_per_rank"],
        "tflops_per_device": summary["tflops_per_rank"],
        "step_time_s": statistics.median(r["step_time_s"] for r in train[1:] or train),
        "step_times_s": [r["step_time_s"] for r in train[1:] or train],
        "memory": summary.get("memory"),
    }


def device_peak(device: Any, threads_per_rank: int) -> dict[str, Any]:
    """The MFU denominator per device, and what it is: a GPU's dense BF16 peak; on a CPU host
    the measured fp32 matmul rate at one rank's thread count."""
    from megatron_ext.run import dense_bf16_peak_tflops

    if device.gpus:
        name = device.names[0]
        tflops = dense_bf16_peak_tflops(name)
        basis = f"{name} dense BF16 peak" if tflops else f"{name}: no dense BF16 peak on record"
        return {"tflops": tflops, "basis": basis}
    import os

    import torch

    from megatron_ext.bench.common import matmul_gflops

    threads = threads_per_rank or os.cpu_count() or 1
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tflops = matmul_gflops() / 1e3
    finally:
        torch.set_num_threads(previous)
    basis = f"CPU: measured fp32 matmul rate at {threads} thread(s), no BF16 peak on record"
    return {"tflops": tflops, "basis": basis}


def build_report(
    precisions: list[str],
    runs: dict[str, dict[str, Any]],
    last: int,
    peak: dict[str, Any],
    noise: float | None,
) -> dict[str, Any]:
    """The figures of every precision against the first (runs share the token grid)."""
    reference = runs[precisions[0]]
    for p in precisions[1:]:
        if runs[p]["tokens"] != reference["tokens"]:
            raise RuntimeError(f"{p} trained on other token counts than {precisions[0]}")
    n = len(reference["steps"])
    window = max(1, min(last, n // 10))
    marks = sorted({max(window, round(f * n)) for f in MARKS})
    results = {}
    for p in precisions:
        r = runs[p]
        mfu = r["tflops_per_device"] / peak["tflops"] if peak["tflops"] else None
        results[p] = {
            "final_loss": r["final_loss"],
            "final_loss_delta": r["final_loss"] - reference["final_loss"],
            "delta_over_noise": (
                abs(r["final_loss"] - reference["final_loss"]) / noise if noise else None
            ),
            "matched_loss": [statistics.fmean(r["loss"][m - window : m]) for m in marks],
            "tokens_per_s_per_device": r["tokens_per_s_per_device"],
            "tflops_per_device": r["tflops_per_device"],
            "mfu": mfu,
            "step_time_s": r["step_time_s"],
            "step_time_vs_reference": ratio_spread(
                [a / b for a, b in zip(r["step_times_s"], reference["step_times_s"], strict=True)]
            ).as_dict(),
            "memory": r["memory"],
        }
    return {
        "precisions": precisions,
        "reference": precisions[0],
        "last": last,
        "steps": n,
        "matched_tokens": [reference["tokens"][m - 1] for m in marks],
        "matched_window": window,
        "noise": noise,
        "mfu_basis": peak["basis"] + " (FP8/FP4 runs too, as is customary)",
        "peak_tflops_per_device": peak["tflops"],
        "results": results,
        "curves": {p: {k: runs[p][k] for k in ("steps", "tokens", "loss")} for p in runs},
    }


def _mib(value: int | None) -> str:
    return "–" if value is None else f"{value / 2**20:.0f} MiB"


def format_report(report: dict[str, Any]) -> str:
    ref, res = report["reference"], report["results"]
    marks = ", ".join(f"{t:,}" for t in report["matched_tokens"])
    lines = [
        f"loss at matched tokens ({marks}; each the mean of {report['matched_window']} steps "
        "ending there):"
    ]
    lines += [
        f"  {p:<15} " + "  ".join(f"{v:.4f}" for v in r["matched_loss"]) for p, r in res.items()
    ]
    noise = report["noise"]
    lines.append(
        f"final loss = mean of the last {report['last']} steps; delta vs {ref}"
        + (f"; run-to-run noise of {ref} (second seed): {noise:.4f}" if noise is not None else "")
    )
    lines.append(
        f"{'precision':<15} {'final':>7} {'delta':>8} {'tok/s/dev':>10} {'TFLOP/s/dev':>11} "
        f"{'MFU':>7} {'peak alloc':>10} {'peak resv':>10} {'peak RSS':>9}"
    )
    for p, r in res.items():
        mem = r["memory"] or {}
        alloc, resv = mem.get("peak_allocated_bytes"), mem.get("peak_reserved_bytes")
        mfu = "–" if r["mfu"] is None else f"{r['mfu']:.2%}"
        lines.append(
            f"{p:<15} {r['final_loss']:>7.4f} {r['final_loss_delta']:>+8.4f} "
            f"{r['tokens_per_s_per_device']:>10.0f} {r['tflops_per_device']:>11.4f} {mfu:>7} "
            f"{_mib(alloc):>10} {_mib(resv):>10} "
            f"{_mib(mem.get('peak_rss_bytes')):>9}"
        )
    for p, r in res.items():
        t = r["step_time_vs_reference"]
        spread = "n/a" if t["spread"] is None else f"±{100 * t['spread']:.1f}%"
        lines.append(
            f"step time {p} / {ref}: median per-step ratio {t['median']:.3f} ({spread}; "
            f"runs one after another, not interleaved)"
        )
    basis = next((r["memory"]["basis"] for r in res.values() if r["memory"]), "not reported")
    lines.append(f"MFU against: {report['mfu_basis']}; memory (rank 0): {basis}")
    return "\n".join(lines)


def plot(report: dict[str, Any], runs: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_ext.atomic import save_figure

    ref = runs[report["reference"]]
    fig, (ax, diff) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in runs.items():
        (line,) = ax.plot(r["tokens"], r["loss"], lw=1, label=name)
        if name in report["precisions"] and name != report["reference"]:
            delta = [a - b for a, b in zip(r["loss"], ref["loss"], strict=True)]
            diff.plot(r["tokens"], delta, lw=1, color=line.get_color(), label=name)
    if report["noise"] is not None:
        label = f"±{report['noise']:.4f}: final-loss noise (second seed)"
        diff.axhspan(-report["noise"], report["noise"], color="grey", alpha=0.2, label=label)
    diff.axhline(0.0, color="black", lw=0.8)
    ax.set_title(title, fontsize=9)
    diff.set_title(f"per-step loss minus {report['reference']}'s")
    for a, ylabel in ((ax, "loss (nats/token)"), (diff, "loss difference (nats/token)")):
        a.set_xlabel("tokens")
        a.set_ylabel(ylabel)
        a.grid(alpha=0.3)
        a.legend()
    save_figure(fig, path, dpi=110)
