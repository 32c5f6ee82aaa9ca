"""``megatron-ext data build|tokenizer``: the command-line side of :mod:`megatron_ext.data`.

Inputs are checked before torch and megatron-core are imported, so a typo fails in a blink;
``launch/cli.py`` turns the ``ConfigError`` into one line and exit code 2.
"""

from __future__ import annotations

import argparse
import time

from megatron_ext.data.corpus import iter_documents, resolve_inputs
from megatron_ext.errors import ConfigError


def data_main(args: argparse.Namespace) -> int:
    """Run ``megatron-ext data ACTION`` (``build`` or ``tokenizer``); returns the exit code."""
    if args.data_command == "build":
        return _build(args)
    if args.data_command == "tokenizer":
        return _tokenizer(args)
    raise ConfigError(f"unknown data action {args.data_command!r}; use build or tokenizer")


def _build(args: argparse.Namespace) -> int:
    resolve_inputs(args.inputs)  # a typo fails now, not after the imports below (seconds)
    from megatron_ext.data.build import build_indexed_dataset
    from megatron_ext.data.tokenizers import build_tokenizer

    tokenizer = build_tokenizer(args.tokenizer, args.tokenizer_model)
    stats = build_indexed_dataset(args.inputs, args.output, tokenizer, json_key=args.json_key)
    print(
        f"wrote {stats.prefix}.bin/.idx: {stats.documents:,} documents, "
        f"{stats.tokens:,} tokens ({args.tokenizer} tokenizer, vocabulary "
        f"{tokenizer.vocab_size:,}), {_mb(stats.text_bytes)} of text -> "
        f"{_mb(stats.file_bytes)} on disk, {stats.seconds:.1f} s"
    )
    return 0


def _tokenizer(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
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
