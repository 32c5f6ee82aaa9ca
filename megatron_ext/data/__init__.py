"""Data: tokenizers (bytes, SentencePiece), local text corpora, megatron-core indexed datasets.

    tokenizer = build_tokenizer("byte")
    build_indexed_dataset(["python-stdlib"], "data/stdlib", tokenizer)
    train, valid, test = build_gpt_datasets("data/stdlib", tokenizer, seq_length=256,
                                            split="98,2,0", seed=1234,
                                            num_samples=(steps * global_batch, None, None))

Names are imported on first use: ``megatron_ext.data.corpus`` and the CLI's input checks must
not pay for importing torch and megatron-core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ext.exports import lazy_exports

if TYPE_CHECKING:
    from megatron_ext.data.build import build_gpt_datasets
    from megatron_ext.data.corpus import PYTHON_STDLIB, iter_documents, python_docs_documents
    from megatron_ext.data.indexed import BuildStats, build_indexed_dataset
    from megatron_ext.data.null_ids import NullIdsTokenizer
    from megatron_ext.data.tokenizers import (
        ByteTokenizer,
        PretrainingTokenizer,
        SentencePieceTokenizer,
        build_tokenizer,
        train_sentencepiece,
    )

_EXPORTS = {
    "BuildStats": "indexed",
    "build_gpt_datasets": "build",
    "build_indexed_dataset": "indexed",
    "PYTHON_STDLIB": "corpus",
    "iter_documents": "corpus",
    "python_docs_documents": "corpus",
    "ByteTokenizer": "tokenizers",
    "NullIdsTokenizer": "null_ids",
    "PretrainingTokenizer": "tokenizers",
    "SentencePieceTokenizer": "tokenizers",
    "build_tokenizer": "tokenizers",
    "train_sentencepiece": "tokenizers",
}
__all__ = [
    "PYTHON_STDLIB",
    "BuildStats",
    "ByteTokenizer",
    "NullIdsTokenizer",
    "PretrainingTokenizer",
    "SentencePieceTokenizer",
    "build_gpt_datasets",
    "build_indexed_dataset",
    "build_tokenizer",
    "iter_documents",
    "python_docs_documents",
    "train_sentencepiece",
]

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
