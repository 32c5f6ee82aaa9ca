"""``megatron-ext bench ramp RECIPE``: the recipe at its constant global batch and under a
doubling batch ramp, at equal tokens, side by side.

Both runs go through the normal launcher with the same seed, data order, model and LR recipe.
The constant run is ``training.steps`` steps of ``training.global_batch_size``; the ramp run
starts at ``--start`` sequences and doubles every ``--double-every`` steps up to that batch
(√B learning rate at every stage, warmup tied to the ramp) and runs until it has consumed the
same number of tokens (``training.train_tokens``). Prints the final training loss (mean of the
last K steps), the last validation loss and the step counts; writes one PNG of both loss curves
against tokens and a JSON. Figures, not pass/fail.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from megatron_ext.bench import common
from megatron_ext.bench.common import read_metrics
from megatron_ext.commands import positive_int
from megatron_ext.errors import ConfigError

DESCRIPTION = "constant batch vs a doubling batch ramp at equal tokens: final losses, curves"

RUN = ("checkpoint.load=none", "checkpoint.save_interval=0", "checkpoint.save_at_end=false")


QUICK = {"steps": 16, "double_every": 4, "last": 4}
EXAMPLE = "megatron-ext bench ramp tiny_cpu_gpt training.micro_batch_size=2 --quick"
#: the JSON's top-level keys (``ramp.json``); ``results`` holds ``constant`` and ``ramp``
JSON_KEYS = ("recipe", "overrides", "ramp", "results", "curves", "meta")
#: the baseline this benchmark's ratios are against (``meta.anchor`` of its JSON)
ANCHOR = "the constant-batch run of the same recipe, seed and tokens"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe file or shipped recipe name (a GPT recipe)")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to both runs")
    p.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training.steps of the constant run, the recipe's schedule scaled with it (printed)",
    )
    p.add_argument("--start", type=positive_int, default=4, help="the ramp's first global batch")
    p.add_argument(
        "--double-every", type=positive_int, default=32, help="optimizer steps per doubling"
    )
    p.add_argument("--last", type=int, default=20, help="K: final loss = mean of the last K")
    p.add_argument("--out", default="runs/bench_ramp", help="folder of the runs, PNG and JSON")
    p.add_argument("--json", default=None, help="also write the JSON here")


def summarize(run_dir: Path, last: int) -> dict[str, Any]:
    train, evals = read_metrics(run_dir)
    return {
        "steps": train[-1]["step"],
        "tokens": train[-1]["consumed_tokens"],
        "train_loss": statistics.fmean(r["loss"] for r in train[-last:]),
        "val_loss": evals[-1]["val_loss"] if evals else None,
        "curve": {
            "tokens": [r["consumed_tokens"] for r in train],
            "loss": [r["loss"] for r in train],
            "global_batch": [r["global_batch"] for r in train],
            "val_tokens": [r["consumed_tokens"] for r in evals],
            "val_loss": [r["val_loss"] for r in evals],
        },
    }


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_ext.atomic import save_figure

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        c = r["curve"]
        (line,) = ax.plot(c["tokens"], c["loss"], lw=0.8, alpha=0.8, label=f"{name} (train)")
        ax.plot(
            c["val_tokens"],
            c["val_loss"],
            "o--",
            ms=3,
            color=line.get_color(),
            label=f"{name} (validation)",
        )
    ax.set_xlabel("consumed tokens")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def run(args: argparse.Namespace) -> int:
    from megatron_ext.bench.common import run_length_overrides, write_json
    from megatron_ext.config import get_trainer, load_recipe
    from megatron_ext.schedules import training_schedule

    overrides = run_length_overrides(args.recipe, args.overrides, args.steps, "ramp")
    recipe = load_recipe(args.recipe, overrides)  # a bad recipe fails before any run
    if not get_trainer(recipe.trainer).token_schedule:
        raise ConfigError(
            f"bench ramp needs a GPT recipe, {args.recipe} is trainer {recipe.trainer}"
        )
    tokens = training_schedule(recipe.training, recipe.optimizer).total_tokens
    ramp = [
        f"training.batch_ramp.start={args.start}",
        f"training.batch_ramp.double_every={args.double_every}",
        "training.lr_warmup_steps=0",  # the warmup is the ramp's
        f"training.train_tokens={tokens}",
    ]
    load_recipe(args.recipe, [*overrides, *ramp])
    out = Path(args.out)
    results = {}
    with common.progress("ramp", "runs", 2) as shown:
        for name, extra in (("constant", []), ("ramp", ramp)):
            print(f"[ramp] {name}: running", flush=True)
            with shown.running(name):
                run_dir = common.launch_run(
                    args.recipe, [*overrides, *RUN, *extra], out / name, name
                )
            results[name] = summarize(run_dir, args.last)
    for name, r in results.items():
        val = "–" if r["val_loss"] is None else f"{r['val_loss']:.4f}"
        print(
            f"{name:<9} steps {r['steps']:>5}  tokens {r['tokens']:>10,}  "
            f"train loss (last {args.last}) {r['train_loss']:.4f}  val loss {val}"
        )
    title = f"{args.recipe}: constant batch vs ramp {args.start} x2 every {args.double_every}"
    plot(results, out / "ramp.png", title)
    print(f"wrote {out / 'ramp.png'}")
    payload = {
        "recipe": args.recipe,
        "overrides": overrides,
        "ramp": ramp,
        "results": {n: {k: v for k, v in r.items() if k != "curve"} for n, r in results.items()},
        "curves": {n: r["curve"] for n, r in results.items()},
    }
    for path in filter(None, (str(out / "ramp.json"), args.json)):
        write_json(payload, path)
    return 0
