"""``megatron-ext soma eval|generate|variance``: use a trained SOMA run (rank-free, one
process), or measure the estimator's variance. Registered as the ``soma`` command."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_ext.commands import Command, positive_float, positive_int
from megatron_ext.progress import step


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``eval``, ``variance`` and ``generate``, each with its options."""
    ssub = p.add_subparsers(dest="soma_command", metavar="ACTION", required=True)
    e = ssub.add_parser("eval", help="routed top-k test loss (nats/byte) of a trained run")
    e.add_argument("recipe", help="the run's recipe (path or shipped name)")
    e.add_argument("overrides", nargs="*", help="key=value overrides, as for launch")
    e.add_argument(
        "--k", type=positive_int, default=None, help="experts per window (default recipe's)"
    )
    e.add_argument("--throughput", action="store_true", help="also time routed inference")
    v = ssub.add_parser(
        "variance",
        help="the SPSA estimator's variance vs its small-eps prediction, the 1/n_pert law and "
        "independent vs summed losses (CSV + PNG)",
    )
    v.add_argument("--out", default="runs/soma_variance", help="folder for variance.csv/.png")
    v.add_argument(
        "--probes",
        type=int,
        default=4800,
        help="probes per measured point (default 4800: about 2%% standard error)",
    )
    g = ssub.add_parser("generate", help="sample bytes after a prompt from the routed mixture")
    g.add_argument("recipe")
    g.add_argument("overrides", nargs="*")
    g.add_argument("--prompt", required=True, help="text; routed on its first 256 bytes")
    g.add_argument(
        "--bytes", type=positive_int, default=200, help="bytes to generate (default 200)"
    )
    g.add_argument("--k", type=positive_int, default=None)
    g.add_argument("--temperature", type=positive_float, default=0.8)
    g.add_argument("--seed", type=int, default=0)


def soma_main(args: argparse.Namespace) -> int:
    from megatron_ext.config import load_recipe
    from megatron_ext.errors import ConfigError
    from megatron_ext.soma.recipe import TRAINER, SomaConfig

    if args.soma_command == "variance":
        from megatron_ext.soma.variance import measure_paper_claims

        if args.probes < 2:
            raise ConfigError(f"--probes={args.probes} must be at least 2")
        from megatron_ext.atomic import check_output_path

        check_output_path(Path(args.out) / "variance.csv", "--out")  # before minutes of work
        for row in measure_paper_claims(args.out, probes_per_point=args.probes):
            print(
                f"{row['experiment']:>11s} {row['x_label']}={row['x']}: measured "
                f"{row['measured']:.2f}, predicted {row['predicted']:.2f}"
            )
        print(f"wrote {args.out}/variance.csv and variance.png")
        return 0

    recipe = load_recipe(args.recipe, args.overrides)
    if recipe.trainer != TRAINER.name:  # `megatron-ext soma` serves its own trainer only
        raise ConfigError(f"{args.recipe} is a trainer={recipe.trainer} recipe, not {TRAINER.name}")
    s = recipe.section(SomaConfig)
    k = args.k if args.k is not None else s.topk()
    if not 1 <= k <= s.num_experts:
        raise ConfigError(f"--k={k} must be between 1 and soma.num_experts={s.num_experts}")

    run_dir = Path(recipe.run_dir)
    seed = run_dir / "soma" / "seed.pt"  # megatron_ext.soma.state.expert_path(run_dir, SEED)
    if not seed.is_file():
        raise ConfigError(
            f"run_dir={str(run_dir)!r} holds no trained SOMA run (no {seed}): give the run_dir "
            "of a finished `megatron-ext launch` of this recipe"
        )
    from megatron_ext.soma.corpus import test_windows
    from megatron_ext.soma.layout import BodyLayout
    from megatron_ext.soma.report import load_experts
    from megatron_ext.soma.state import SEED_EXPERT, expert_path, load_file
    from megatron_ext.soma.trainer import expert_shape

    with step("soma", f"loading the router and {s.num_experts} experts of {run_dir}"):
        windows, router = test_windows(recipe)  # a missing router artifact stops here
        layout = BodyLayout.from_shape(expert_shape(recipe))
        emb = load_file(expert_path(run_dir, SEED_EXPERT))["emb"]
        experts = load_experts(run_dir, s.num_experts)
    if args.soma_command == "eval":
        import torch

        from megatron_ext.soma.evaluate import routed_eval, routed_throughput

        with torch.inference_mode():
            r = routed_eval(windows, router, experts, emb, layout, k, s.route_bytes, s.score_bytes)
        out = {"k": k, "test_windows": r.windows, "test_nats_per_byte": r.nats_per_byte}
        if args.throughput:
            out["routed_inference"] = routed_throughput(
                windows, router, experts, emb, layout, k, s.route_bytes, s.score_bytes
            )
        print(json.dumps(out, indent=2))
        return 0
    from megatron_ext.soma.generate import generate

    if args.bytes < 1:
        raise ConfigError(f"--bytes={args.bytes} must be at least 1")
    with step("soma", f"generating {args.bytes} bytes with {k} experts"):
        text, chosen = generate(
            args.prompt.encode("utf-8"),
            args.bytes,
            router,
            experts,
            emb,
            layout,
            k,
            args.temperature,
            args.seed,
            s.route_bytes,
        )
    print(f"[experts {chosen}]", file=sys.stderr)
    sys.stdout.write(args.prompt + text.decode("utf-8", errors="replace") + "\n")
    return 0


#: The ``megatron_ext.commands`` entry point ``soma`` (setup.py).
COMMAND = Command(
    name="soma",
    usage="eval|generate|variance",
    help="use a trained SOMA run; the estimator's variance",
    description="Evaluate or sample a trained SOMA run, or measure the SPSA estimator's variance.",
    add_arguments=add_arguments,
    run=soma_main,
)
