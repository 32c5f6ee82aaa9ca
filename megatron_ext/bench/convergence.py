"""``megatron-ext bench convergence RECIPE``: the same run once per optimizer, side by side.

Each variant runs through the normal launcher (``megatron-ext launch RECIPE ...``) with the same
seed, data order, token count and LR schedule — only ``optimizer.name`` (and a variant's own
overrides, e.g. KL-SOAP's Newton–Schulz roots) differs, and with update-RMS matching one
``optimizer.lr`` serves them all. From each run's ``metrics.jsonl`` it prints the final
training loss (mean of the last K steps), the validation loss after the last step, the median
step time and the
optimizer's share of it, and the largest gradient norm; it writes one PNG with the loss curves
and a JSON with every figure. Figures, not pass/fail: expectations (e.g. KL-SOAP ≤ Muon ≈ MOP <
AdamW at equal tokens) are for the reader to check.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
from pathlib import Path
from typing import Any

from megatron_ext.bench import common
from megatron_ext.bench.common import read_metrics
from megatron_ext.errors import ConfigError

DESCRIPTION = "one recipe, once per optimizer: final losses, step time, optimizer share, curves"

#: name -> extra overrides of the variants beyond each registered optimizer at its defaults;
#: ``optimizer.name`` is the part of the name before the first "+".
EXTRA_VARIANTS: dict[str, tuple[str, ...]] = {
    "kl_soap+ns": ("optimizer.kl_soap_inverse_root=newton_schulz",),
}


def variants() -> dict[str, tuple[str, ...]]:
    """Every variant: each registered optimizer (no extra override), then :data:`EXTRA_VARIANTS`."""
    from megatron_ext.optimizers import registered_optimizers

    return {**dict.fromkeys(registered_optimizers(), ()), **EXTRA_VARIANTS}


QUICK = {"optimizers": "adamw,muon", "steps": 12, "last": 4}
EXAMPLE = "megatron-ext bench convergence tiny_cpu_gpt --quick"
#: the JSON's top-level keys (``convergence.json``); ``results`` holds one entry per variant
JSON_KEYS = ("recipe", "overrides", "last", "results", "curves", "meta")
#: the baseline this benchmark's ratios are against (``meta.anchor`` of its JSON)
ANCHOR = "the first optimizer (adamw by default): same recipe, seed, data order and tokens"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe file or shipped recipe name")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every run")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training.steps of every run, the recipe's schedule scaled with it (printed)",
    )
    p.add_argument(
        "--optimizers",
        default=",".join(variants()),
        help="comma-separated variants (default: all; kl_soap+ns = KL-SOAP with Newton–Schulz "
        f"inverse roots); known: {', '.join(variants())}",
    )
    p.add_argument("--last", type=int, default=20, help="K: final losses are means of the last K")
    p.add_argument(
        "--out", default="runs/bench_convergence", help="folder of the runs, PNG and JSON"
    )
    p.add_argument("--json", default=None, help="also write the JSON here")


def parse_variants(spec: str) -> dict[str, tuple[str, ...]]:
    """The variants named in ``spec`` (``ConfigError`` naming an unknown one)."""
    names = [s.strip() for s in spec.split(",") if s.strip()]
    known = variants()
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ConfigError(
            f"--optimizers: unknown variant(s) {unknown or spec!r}; known: {', '.join(known)}"
        )
    return {n: known[n] for n in names}


def run_variant(
    recipe: str, overrides: list[str], name: str, extra: tuple[str, ...], out: Path
) -> Path:
    """One launcher run; returns its run directory. The run's own log goes to ``run.log``."""
    variant = [
        *overrides,
        f"optimizer.name={name.split('+')[0]}",
        *extra,
        "checkpoint.load=none",
        "checkpoint.save_interval=0",
        "checkpoint.save_at_end=false",
    ]
    return common.launch_run(recipe, variant, out / name, name)


def summarize(run_dir: Path, last: int) -> dict[str, Any]:
    """Figures of one run from its ``metrics.jsonl``."""
    train, evals = read_metrics(run_dir)
    times = [r["step_time_s"] for r in train[1:]] or [train[0]["step_time_s"]]
    opt_times = [r["optimizer_s"] for r in train[1:] if "optimizer_s" in r]
    step_time = statistics.median(times)
    return {
        "steps": train[-1]["step"],
        "tokens": train[-1]["consumed_tokens"],
        "train_loss": statistics.fmean(r["loss"] for r in train[-last:]),
        "val_loss": evals[-1]["val_loss"] if evals else None,  # after the last step
        "step_time_s": step_time,
        "optimizer_share": statistics.median(opt_times) / step_time if opt_times else None,
        "max_grad_norm": max(r["grad_norm"] for r in train if r["grad_norm"] is not None),
        "curve": {
            "step": [r["step"] for r in train],
            "tokens": [r["consumed_tokens"] for r in train],
            "loss": [r["loss"] for r in train],
            "val_step": [r["step"] for r in evals],
            "val_loss": [r["val_loss"] for r in evals],
        },
    }


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def report(results: dict[str, dict[str, Any]], last: int) -> str:
    lines = [
        f"{'optimizer':<12} {'train loss':>10} {'val loss':>9} {'s/step':>8} {'opt share':>9} "
        f"{'max gnorm':>9}   (train: mean of the last {last} steps; val: after the last)"
    ]
    for name, r in results.items():
        lines.append(
            f"{name:<12} {r['train_loss']:>10.4f} {_fmt(r['val_loss'], '.4f'):>9} "
            f"{r['step_time_s']:>8.3f} {_fmt(r['optimizer_share'], '.1%'):>9} "
            f"{r['max_grad_norm']:>9.2f}"
        )
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_ext.atomic import save_figure

    fig, (ax, zoom) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, r in results.items():
        c = r["curve"]
        (line,) = ax.plot(c["tokens"], c["loss"], lw=1, label=name)
        zoom.plot(c["tokens"], c["loss"], lw=1, color=line.get_color(), label=name)
        if c["val_loss"]:
            val_tokens = [c["tokens"][c["step"].index(s)] for s in c["val_step"]]
            zoom.plot(val_tokens, c["val_loss"], "o--", ms=3, color=line.get_color())
    half = max(max(r["curve"]["tokens"]) for r in results.values()) / 2
    tail = [
        v
        for r in results.values()
        for t, v in zip(r["curve"]["tokens"], r["curve"]["loss"], strict=True)
        if t >= half
    ]
    zoom.set_xlim(half, 2 * half)
    zoom.set_ylim(min(tail) * 0.97, max(tail) * 1.03)
    ax.set_title("\n".join(textwrap.wrap(title, 70)), fontsize=8)
    zoom.set_title("second half (dots: validation)")
    for a in (ax, zoom):
        a.set_xlabel("tokens")
        a.set_ylabel("loss (nats/token)")
        a.grid(alpha=0.3)
        a.legend()
    save_figure(fig, path, dpi=110)


def run(args: argparse.Namespace) -> int:
    from megatron_ext.bench.common import progress, run_length_overrides, write_json

    variants = parse_variants(args.optimizers)
    if args.last < 1:
        raise ConfigError(f"--last must be >= 1, got {args.last}")
    # a bad recipe fails here, before any run starts
    overrides = run_length_overrides(args.recipe, args.overrides, args.steps, "convergence")
    out = Path(args.out)
    results = {}
    with progress("convergence", "runs", len(variants)) as shown:
        for name, extra in variants.items():
            print(f"[convergence] {name}: running", flush=True)
            with shown.running(name):
                run_dir = run_variant(args.recipe, overrides, name, extra, out)
            results[name] = summarize(run_dir, args.last)
            print(f"[convergence] {name}: train loss {results[name]['train_loss']:.4f}", flush=True)
    print(report(results, args.last))
    title = f"{args.recipe} {' '.join(overrides)}".strip()
    plot(results, out / "convergence.png", title)
    payload = {
        "recipe": args.recipe,
        "overrides": overrides,
        "last": args.last,
        "results": {n: {k: v for k, v in r.items() if k != "curve"} for n, r in results.items()},
        "curves": {n: r["curve"] for n, r in results.items()},
    }
    print(f"wrote {out / 'convergence.png'}")
    for path in filter(None, (str(out / "convergence.json"), args.json)):
        write_json(payload, path)
    return 0
