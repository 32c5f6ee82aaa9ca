"""``megatron-ext bench plan``: the plan (:mod:`megatron_ext.planner`) of the shipped GPT recipes
on 8 … 4,096 GPUs with each optimizer — memory per rank, bytes per step, the layer-wise plan's
balance beside megatron-core's layer-wise optimizer and ZeRO-1, predicted step time — as a
Markdown table, a JSON and one PNG (balance and all-gather bytes against the data-parallel
size). A simulation from the recipes, torch-free, seconds; the figures are predictions whose
terms are checked against measured CPU runs in ``tests/test_planner_measure.py``.

Each recipe keeps its parallel layout (TP, PP, EP) and micro-batch; the global batch is the
recipe's, raised to the next multiple of ``micro-batch × DP`` where the GPUs outnumber it (the
table's "batch" column says which). Recipes without a vocabulary size (a tokenizer file on the
cluster) get ``model.vocab_size=128256`` (Llama-3's), stated in the JSON.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from megatron_ext.errors import ConfigError

DESCRIPTION = "plan the GPT recipes on 8…4096 GPUs per optimizer: memory, bytes, balance, time"
QUICK = {"recipes": ["gpt_1b"], "gpus": [8, 64], "optimizers": ["adamw", "muon"]}
EXAMPLE = "megatron-ext bench plan --quick"
JSON_KEYS = ("gpu", "assumed", "rows", "balance", "meta")
#: the baseline this benchmark's ratios are against (``meta.anchor`` of its JSON)
ANCHOR = (
    "ZeRO-1 and megatron-core's layer-wise optimizer planned beside (predictions from the "
    "recipes, not measurements)"
)

RECIPES = ["gpt_1b", "gpt_8b", "olmoe_1b_7b", "qwen3_30b_a3b"]
GPU_COUNTS = [8, 64, 512, 4096]
VOCAB_WHEN_UNSET = 128256
#: the balance figure: gpt_1b's matrices under Muon, DP = GPUs (TP = 1)
BALANCE_RECIPE, BALANCE_OPTIMIZER = "gpt_1b", "muon"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipes", nargs="+", default=RECIPES, help="GPT recipes to plan")
    from megatron_ext.commands import positive_int
    from megatron_ext.planner import GPUS

    p.add_argument("--gpus", nargs="+", type=positive_int, default=GPU_COUNTS, help="GPU counts")
    from megatron_ext.optimizers import registered_optimizers

    p.add_argument(
        "--optimizers",
        nargs="+",
        default=list(registered_optimizers()),
        help="optimizer.name values (default: every registered optimizer)",
    )
    p.add_argument(
        "--gpu", default="h100", choices=sorted(GPUS), help="GPU model (megatron-ext plan --gpu)"
    )
    p.add_argument("--gpus-per-node", type=positive_int, default=8)
    p.add_argument("--out", default="runs/bench_plan", help="folder of the table, PNG and JSON")
    p.add_argument("--json", default=None, help="also write the JSON here")


def _overrides(source: str, optimizer: str, world: int, vocab_unset: bool) -> list[str]:
    from megatron_ext.config import read_recipe

    recipe = read_recipe(source)
    p, t = recipe.parallel, recipe.training
    dp = world // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )
    step = t.micro_batch_size * max(dp, 1)
    batch = -(-t.global_batch_size // step) * step
    out = [f"optimizer.name={optimizer}", f"training.global_batch_size={batch}"]
    return [*out, f"model.vocab_size={VOCAB_WHEN_UNSET}"] if vocab_unset else out


def _row(source: str, optimizer: str, world: int, args: argparse.Namespace) -> dict[str, Any]:
    from megatron_ext.config import read_recipe
    from megatron_ext.planner import Cluster, gpu_spec, plan_recipe

    vocab_unset = read_recipe(source).model.vocab_size is None
    overrides = _overrides(source, optimizer, world, vocab_unset)
    cluster = Cluster(
        gpu_spec(args.gpu), max(world // args.gpus_per_node, 1), min(world, args.gpus_per_node)
    )
    row: dict[str, Any] = {"recipe": source, "gpus": world, "optimizer": optimizer}
    try:
        plan = plan_recipe(source, overrides, cluster)
    except ConfigError as exc:  # e.g. a layout the recipe cannot take at this size
        return {**row, "error": str(exc)}
    s = plan.worst
    loads = s.dense.as_dict() if s.dense else None
    comm = s.comm
    return {
        **row,
        "overrides": overrides,
        "layout": plan.layout.as_dict(),
        "peak_gb": s.memory.peak / 1e9,
        "static_gb": s.memory.static / 1e9,
        "optimizer_state_gb": sum(s.memory.optimizer_state.values()) / 1e9,
        "activations_gb": s.memory.activations / 1e9,
        "fits": plan.fits,
        "fix": plan.fix,
        "dp_bytes_sent_gb": comm.data_parallel_sent / 1e9,
        "all_bytes_sent_gb": sum(v[0] for v in vars(comm).values()) / 1e9,
        "state_imbalance": loads["state_bytes"]["imbalance"] if loads else 1.0,
        "flops_imbalance": loads["flops"]["imbalance"] if loads else 1.0,
        "step_s": plan.step.total_s,
        "tokens_per_s": plan.tokens_per_second,
    }


def _table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| recipe | GPUs | optimizer | TP/PP/EP/DP | batch | peak GB/rank | fits | opt. state GB"
        " | state max/mean | DP GB sent/step | all GB sent/step | step s | tokens/s |\n"
        "|---|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['recipe']} | {r['gpus']} | {r['optimizer']} | — {r['error']} |")
            continue
        lay = r["layout"]
        fits = "yes" if r["fits"] else f"no → {r['fix'] or 'no single change'}"
        lines.append(
            f"| {r['recipe']} | {r['gpus']} | {r['optimizer']} | {lay['tp']}/{lay['pp']}/"
            f"{lay['ep']}/{lay['dp']} | {lay['global_batch']} | {r['peak_gb']:.1f} | {fits} | "
            f"{r['optimizer_state_gb']:.2f} | {r['state_imbalance']:.2f} | "
            f"{r['dp_bytes_sent_gb']:.2f} | {r['all_bytes_sent_gb']:.1f} | {r['step_s']:.2f} | "
            f"{r['tokens_per_s']:,.0f} |"
        )
    return head + "\n".join(lines) + "\n"


#: the results page's table of ``rows`` (:mod:`megatron_ext.docs.render`): the one printed here
RESULTS_TABLES = {"rows": _table}


def _balance(args: argparse.Namespace) -> list[dict[str, Any]]:
    """gpt_1b's Muon matrices over DP = each GPU count: the three schemes' state imbalance
    and all-gather bytes received per rank."""
    from megatron_ext.config import read_recipe
    from megatron_ext.optimizers import recipe_hyperparameters
    from megatron_ext.planner import (
        default_bucket_size,
        gpt_parameters,
        matrix_routed,
        routed_specs,
        scheme_loads,
    )

    recipe = read_recipe(BALANCE_RECIPE, [f"optimizer.name={BALANCE_OPTIMIZER}"])
    params = gpt_parameters(
        recipe.model, recipe.parallel, vocab_size=VOCAB_WHEN_UNSET, seq_length=4096
    )
    specs = matrix_routed(
        routed_specs(params, matrix_optimizer=BALANCE_OPTIMIZER, master_bytes_per_element=4)
    )
    hp = recipe_hyperparameters(recipe.optimizer)
    out = []
    for dp in sorted({2, 4, *args.gpus}):
        schemes = scheme_loads(specs, dp, bucket_size=default_bucket_size(dp), hyperparameters=hp)
        out.append(
            {
                "dp": dp,
                **{
                    s.name: {
                        "state_imbalance": s.state_bytes.imbalance,
                        "gather_gb": s.gather_bytes.max / 1e9,
                    }
                    for s in schemes
                },
            }
        )
    return out


def _plot(balance: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_ext.atomic import save_figure

    names = [k for k in balance[0] if k != "dp"]
    dps = [b["dp"] for b in balance]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name in names:
        left.plot(dps, [b[name]["state_imbalance"] for b in balance], marker="o", label=name)
        right.plot(dps, [b[name]["gather_gb"] for b in balance], marker="o", label=name)
    for ax, label in (
        (left, "optimizer state + masters, max / mean rank"),
        (right, "all-gather received per rank per step, GB"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("data-parallel ranks")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    left.legend()
    fig.suptitle(f"{BALANCE_RECIPE} matrices under {BALANCE_OPTIMIZER}: layer-wise vs ZeRO-1")
    save_figure(fig, path, dpi=110)


def _check_inputs(args: argparse.Namespace) -> None:
    """Every recipe a GPT recipe and every optimizer a registered one, before any row."""
    from megatron_ext.config import get_trainer, read_recipe
    from megatron_ext.optimizers import OPTIMIZERS

    for source in args.recipes:
        trainer = read_recipe(source).trainer
        if get_trainer(trainer).plan != "memory":
            raise ConfigError(
                f"--recipes {source}: a trainer={trainer} recipe; bench plan plans GPT recipes "
                f"(e.g. {', '.join(RECIPES)})"
            )
    for name in args.optimizers:
        OPTIMIZERS.get(name)


def run(args: argparse.Namespace) -> int:
    from megatron_ext.bench.common import progress, write_json
    from megatron_ext.planner import gpu_spec

    spec = gpu_spec(args.gpu)
    _check_inputs(args)
    cells = [
        (source, optimizer, world)
        for source in args.recipes
        for world in args.gpus
        for optimizer in args.optimizers
    ]
    rows = []
    with progress("plan", "plans", len(cells) + 1, unit="plan") as shown:
        for source, optimizer, world in cells:
            with shown.running(f"{source} {optimizer} {world} GPUs"):
                rows.append(_row(source, optimizer, world, args))
        with shown.running(f"{BALANCE_RECIPE} balance over DP"):
            balance = _balance(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = _table(rows)
    print(table)
    from megatron_ext.atomic import atomic_path

    with atomic_path(out / "plan.md") as tmp:
        tmp.write_text(table)
    _plot(balance, out / "plan_balance.png")
    payload = {
        "gpu": {"kind": spec.kind, "name": spec.name, "memory_bytes": spec.memory_bytes},
        "assumed": {
            "vocab_size_when_unset": VOCAB_WHEN_UNSET,
            "gpus_per_node": args.gpus_per_node,
            "batch": "the recipe's, raised to a multiple of micro-batch x DP",
        },
        "rows": rows,
        "balance": balance,
    }
    for path in filter(None, (str(out / "plan.json"), args.json)):
        write_json(payload, path)
    print(f"wrote {out / 'plan.md'}, {out / 'plan_balance.png'}, {out / 'plan.json'}")
    return 0
