"""``megatron-ext``: one command, subcommands ``launch``, ``train``, ``data``, ``bench``.

Errors that are the user's (a bad recipe, override or flag) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from megatron_ext.errors import ConfigError

DESCRIPTION = """\
megatron-ext: matrix optimizers, a layer-wise distributed optimizer, recipes and alternate
trainers on top of megatron-core.

  megatron-ext launch RECIPE [key=value ...]   run a recipe on this node / cluster (torchrun)
  megatron-ext train  RECIPE [key=value ...]   per-rank entry point (torchrun, mpirun, srun)
  megatron-ext data   build|tokenizer ...      build indexed datasets, train tokenizers
  megatron-ext bench  NAME ...                 benchmarks: figures and JSON, never pass/fail

RECIPE is a YAML file or the name of a shipped recipe (e.g. tiny_cpu_gpt).
"""


def _add_recipe_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="recipe YAML file, or a shipped recipe name (tiny_cpu_gpt)")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="override recipe fields, e.g. optimizer.lr=3e-4 training.steps=20",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-ext",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser(
        "launch",
        help="validate a recipe and run it with torchrun",
        description="Validate RECIPE, then run `megatron-ext train` on every rank "
        "with torchrun: --standalone on one node; multi-node from --nnodes/"
        "--node-rank/--rdzv-endpoint or from the SLURM environment.",
    )
    _add_recipe_args(p)
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        help="ranks per node (default: GPU count, or launch.nproc_per_node_cpu on CPU)",
    )
    p.add_argument("--nnodes", type=int, default=None, help="number of nodes (default: SLURM or 1)")
    p.add_argument("--node-rank", type=int, default=None, help="this node's index")
    p.add_argument("--rdzv-endpoint", default=None, help="HOST:PORT of the rendezvous")
    p.add_argument("--rdzv-id", default=None, help="rendezvous job id (default: SLURM job id)")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the exact command and environment, run nothing",
    )

    p = sub.add_parser(
        "train",
        help="per-rank entry point (started by torchrun/mpirun/srun)",
        description="Train RECIPE on this rank. Rank, world size and local rank "
        "come from torchrun's variables, or from OMPI_/PMI_/SLURM_ when the "
        "processes were started by mpirun/mpiexec or srun.",
    )
    _add_recipe_args(p)

    p = sub.add_parser("data", help="build indexed datasets and tokenizers")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    b = dsub.add_parser(
        "build",
        help="turn .txt/.jsonl files into a megatron-core indexed dataset (<output>.bin/.idx)",
    )
    b.add_argument(
        "inputs",
        nargs="+",
        help=".txt/.jsonl files or folders; 'python-stdlib' = stdlib docstrings",
    )
    b.add_argument("--output", required=True, help="output prefix")
    b.add_argument("--tokenizer", choices=("byte", "sentencepiece"), default="byte")
    b.add_argument("--tokenizer-model", default="", help="SentencePiece .model file")
    b.add_argument("--json-key", default="text", help="field holding the text in .jsonl")
    t = dsub.add_parser("tokenizer", help="train a SentencePiece model on local text")
    t.add_argument("inputs", nargs="+", help=".txt/.jsonl files or folders, or 'python-stdlib'")
    t.add_argument("--output", required=True, help="model prefix (<output>.model)")
    t.add_argument("--vocab-size", type=int, default=4096)
    t.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")

    from megatron_ext.soma.cli import add_soma_parser

    add_soma_parser(sub)

    p = sub.add_parser("bench", help="benchmarks (print figures and JSON)")
    from megatron_ext.bench import BENCHMARKS, add_bench_parsers

    add_bench_parsers(
        p.add_subparsers(
            dest="bench_name", metavar="NAME", required=True, help=", ".join(BENCHMARKS)
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "launch":
            from megatron_ext.launch.launcher import launch_main

            return launch_main(args)
        if args.command == "train":
            from megatron_ext.training.entry import train_main

            return train_main(args.recipe, args.overrides)
        if args.command == "data":
            from megatron_ext.data.cli import data_main

            return data_main(args)
        if args.command == "soma":
            from megatron_ext.soma.cli import soma_main

            return soma_main(args)
        if args.command == "bench":
            from megatron_ext.bench import run_bench

            return run_bench(args)
    except ConfigError as exc:
        print(f"megatron-ext: error: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
