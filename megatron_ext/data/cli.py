"""``megatron-ext data build|tokenizer``: the command-line side of :mod:`megatron_ext.data`.

Neither action imports torch or megatron-core: ``build`` writes megatron-core's indexed-dataset
files with :mod:`megatron_ext.data.indexed`, the tokenizers need sentencepiece or tokenizers
only. ``launch/cli.py`` turns a ``ConfigError`` into one line and exit code 2. On a terminal
``build`` shows a bar of the documents tokenized. Registered as the ``data`` command
(:mod:`megatron_ext.commands`).
"""

from __future__ import annotations

import argparse
import time
from typing import get_args

from megatron_ext.atomic import check_output_path, new_parents
from megatron_ext.commands import Command, positive_int
from megatron_ext.data.corpus import iter_documents, resolve_inputs
from megatron_ext.data.kinds import TokenizerKind
from megatron_ext.errors import ConfigError
from megatron_ext.progress import bar


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``build`` and ``tokenizer``, each with its options."""
    dsub = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
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
    b.add_argument("--tokenizer", choices=get_args(TokenizerKind), default="byte")
    b.add_argument(
        "--tokenizer-model",
        default="",
        help="SentencePiece .model file, or the folder of a Hugging Face tokenizer",
    )
    b.add_argument(
        "--vocab-size",
        type=positive_int,
        default=None,
        help="the null_ids tokenizer's vocabulary (Megatron-LM's NullTokenizer --vocab-size)",
    )
    b.add_argument("--json-key", default="text", help="field holding the text in .jsonl")
    t = dsub.add_parser("tokenizer", help="train a SentencePiece model on local text")
    t.add_argument("inputs", nargs="+", help=".txt/.jsonl files or folders, or 'python-stdlib'")
    t.add_argument("--output", required=True, help="model prefix (<output>.model)")
    t.add_argument("--vocab-size", type=positive_int, default=4096)
    t.add_argument("--model-type", choices=("bpe", "unigram"), default="bpe")


def data_main(args: argparse.Namespace) -> int:
    """Run ``megatron-ext data ACTION`` (``build`` or ``tokenizer``); returns the exit code."""
    if args.data_command == "build":
        return _build(args)
    if args.data_command == "tokenizer":
        return _tokenizer(args)
    raise ConfigError(f"unknown data action {args.data_command!r}; use build or tokenizer")


def _build(args: argparse.Namespace) -> int:
    resolve_inputs(args.inputs)  # a typo fails now, not after the tokenizer's import
    if args.vocab_size is not None and args.tokenizer != "null_ids":
        raise ConfigError(
            f"--vocab-size is the null_ids tokenizer's; the {args.tokenizer} tokenizer's "
            "vocabulary is its own: drop --vocab-size"
        )
    check_output_path(args.output + ".bin", "--output")
    from megatron_ext.data.indexed import build_indexed_dataset
    from megatron_ext.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer, args.tokenizer_model, args.vocab_size)
    with new_parents(args.output + ".bin"), bar("data build", "tokenizing", unit="doc") as done:
        stats = build_indexed_dataset(
            args.inputs, args.output, tokenizer, json_key=args.json_key, progress=done
        )
    print(
        f"wrote {stats.prefix}.bin/.idx: {stats.documents:,} documents, "
        f"{stats.tokens:,} tokens ({args.tokenizer} tokenizer, vocabulary "
        f"{tokenizer.vocab_size:,}), {_mb(stats.text_bytes)} of text -> "
        f"{_mb(stats.file_bytes)} on disk, {stats.seconds:.1f} s"
    )
    return 0


def _tokenizer(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    resolve_inputs(args.inputs)
    check_output_path(args.output + ".model", "--output")
    documents = list(iter_documents(args.inputs))
    from megatron_ext.data.tokenizers import train_sentencepiece

    path = train_sentencepiece(documents, args.output, args.vocab_size, args.model_type)
    text_bytes = sum(len(doc.encode("utf-8")) for doc in documents)
    print(
        f"wrote {path}: {args.model_type} vocabulary {args.vocab_size:,}, trained on "
        f"{len(documents):,} documents ({_mb(text_bytes)} of text), "
        f"{time.perf_counter() - t0:.1f} s"
    )
    return 0


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.2f} MB"


#: The ``megatron_ext.commands`` entry point ``data`` (setup.py).
COMMAND = Command(
    name="data",
    usage="build|tokenizer ...",
    help="build indexed datasets, train tokenizers",
    add_arguments=add_arguments,
    run=data_main,
)
