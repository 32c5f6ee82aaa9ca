"""``megatron-ext tools eps-sweep MODEL``: the RMSNorm-epsilon sensitivity of a model's logits
(an HF folder or a hf-to-mcore folder); the ``tools`` command of :mod:`.cli`."""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_ext.atomic import check_output_path
from megatron_ext.commands import positive_int
from megatron_ext.convert.inputs import read_json


def add_tools_arguments(parser: argparse.ArgumentParser) -> None:
    """``eps-sweep MODEL``."""
    sub = parser.add_subparsers(dest="tools_command", metavar="ACTION", required=True)
    e = sub.add_parser("eps-sweep", help="logit sensitivity to the RMSNorm epsilon (CSV + PNG)")
    e.add_argument("model", type=Path, help="an HF model directory or a hf-to-mcore folder")
    e.add_argument("--out", type=Path, default=Path("eps_sweep"), help="prefix of .csv/.png")
    e.add_argument("--tokens", type=positive_int, default=32)
    e.add_argument("--sequences", type=positive_int, default=16)
    e.add_argument("--seed", type=int, default=0)


def tools_main(args: argparse.Namespace) -> int:
    """``megatron-ext tools eps-sweep MODEL``: prints the table, writes CSV and PNG."""
    check_output_path(f"{args.out}.csv", "--out")  # before the model loads
    # torch and the converters load only when a conversion runs (--help stays torch-free)
    import torch

    from megatron_ext.convert import cli
    from megatron_ext.convert.eps_sweep import eps_sweep, write_sweep
    from megatron_ext.convert.hf import choose_epsilon, read_hf_config

    if (args.model / cli.FIELDS).is_file():
        gpt = cli.load_mcore(args.model)
        fields = read_json(args.model / cli.FIELDS, cli.MCORE_FIX)
        eps, source = fields["layernorm_epsilon"], f"{args.model / cli.FIELDS}"
    else:
        from megatron_ext.convert.hf import hf_to_mcore_state
        from megatron_ext.convert.parity import build_mcore

        raw = read_hf_config(args.model)
        choice = choose_epsilon(raw)
        fields = cli.hf_fields(args.model, raw, choice.value)
        hf = cli.load_hf(args.model)
        fields = cli.hf_fields(args.model, {**hf.config.to_dict(), **raw}, choice.value)
        gpt = build_mcore(fields, hf_to_mcore_state(hf.state_dict(), fields))
        eps, source = choice.value, choice.source
    generator = torch.Generator().manual_seed(args.seed)
    shape = (args.sequences, args.tokens)
    tokens = torch.randint(0, fields["vocab_size"], shape, generator=generator)
    rows = eps_sweep(gpt, eps, tokens)
    print(f"correct epsilon {eps:g} (from {source})")
    print("multiple,epsilon,cosine,argmax_agreement")
    for r in rows:
        print(f"{r['multiple']:g},{r['epsilon']:g},{r['cosine']:.8f},{r['argmax_agreement']:.4f}")
    csv_path, png_path = write_sweep(rows, args.out, f"{args.model.name}: eps {eps:g}")
    print(f"wrote {csv_path} and {png_path}")
    return 0
