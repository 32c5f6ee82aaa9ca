"""The launcher's data checks beyond "the files exist": the tokenizer is what the recipe says it
is, and the dataset's token ids fit the model's vocabulary.

A dataset built with another tokenizer than the model's (a converted Llama recipe pointed at a
byte-level dataset, or the reverse) holds ids at or above the model's vocabulary: on the ranks
the embedding lookup dies with an ``IndexError`` after the start-up. Here it is one line before
any process starts. The ids are read from megatron-core's ``.bin`` with the ``.idx`` header's
dtype (the indexed-dataset format: ``MMIDIDX\\0\\0``, a little-endian u64 version, one dtype code
byte), without megatron-core or torch: the launcher stays torch-free.

Torch-free (numpy and sentencepiece only, both without torch).
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import get_trainer
from megatron_ext.errors import ConfigError
from megatron_ext.planner.inputs import BYTE_VOCAB

__all__ = ["check_tokenizer_and_vocabulary", "max_token_id"]

_INDEX_HEADER = b"MMIDIDX\x00\x00"
#: megatron-core's indexed-dataset dtype codes (megatron.core.datasets.indexed_dataset.DType)
_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}
#: bytes of .bin read in full; a larger dataset is checked on this many bytes spread over it
SCAN_BYTES = 8 << 30
_CHUNK = 64 << 20


def check_tokenizer_and_vocabulary(recipe: Recipe) -> None:
    """A SentencePiece ``data.tokenizer_model`` must exist and load; a Hugging Face one must be
    a folder; an existing dataset at ``data.path`` must hold no id >= the model's vocabulary
    (``model.vocab_size``, else the tokenizer's)."""
    data, model = recipe.sections.get("data"), recipe.sections.get("model")
    if data is None or not hasattr(data, "tokenizer"):
        return
    trains = get_trainer(recipe.trainer).trains_tokenizer
    if trains and data.source and not Path(data.tokenizer_model).exists():
        return  # the trainer trains its SentencePiece model from data.source first (DiPaCo)
    vocab = _tokenizer_vocabulary(data.tokenizer, data.tokenizer_model)
    if model is not None and getattr(model, "vocab_size", None):
        vocab = int(model.vocab_size)
    if vocab is None or model is None or not data.path:
        return
    prefix = data.path
    if not (Path(prefix + ".bin").is_file() and Path(prefix + ".idx").is_file()):
        return  # built from data.source by the ranks, with the recipe's tokenizer
    top, checked, total = max_token_id(prefix)
    if checked < total:
        print(
            f"megatron-ext: note: token ids checked on {checked / 2**30:.0f} GiB of "
            f"{prefix}.bin's {total / 2**30:.0f} GiB",
            file=sys.stderr,
        )
    if top >= vocab:
        raise ConfigError(
            f"data.path={prefix!r} holds token id {top}, beyond the model's vocabulary of {vocab} "
            f"(model.vocab_size, else data.tokenizer's): rebuild the dataset with the model's "
            f"tokenizer (megatron-ext data build ... --tokenizer ...), or set model.vocab_size="
            f"{top + 1} or more"
        )


def _tokenizer_vocabulary(kind: str, model_path: str) -> int | None:
    """The tokenizer's vocabulary where it can be read without torch, None where not (a
    Hugging Face tokenizer); a missing or unreadable file is refused."""
    if kind == "byte":
        return BYTE_VOCAB
    path = Path(model_path)
    if not model_path or not path.exists():
        raise ConfigError(
            f"data.tokenizer={kind}: data.tokenizer_model={model_path!r} does not exist: give "
            "the tokenizer's file (SentencePiece .model) or folder (Hugging Face)"
        )
    if kind != "sentencepiece":
        return None
    import sentencepiece

    try:
        return int(sentencepiece.SentencePieceProcessor(model_file=str(path)).vocab_size())
    except (RuntimeError, OSError):
        raise ConfigError(
            f"data.tokenizer_model={model_path!r} is not a SentencePiece model: give a .model "
            "file (megatron-ext data tokenizer writes one) or set data.tokenizer to its kind"
        ) from None


def max_token_id(prefix: str) -> tuple[int, int, int]:
    """(largest token id, bytes of ``prefix.bin`` read, its size): all of it up to
    :data:`SCAN_BYTES`, else that many bytes in chunks spread evenly over the file."""
    import numpy as np

    idx = Path(prefix + ".idx")
    with open(idx, "rb") as f:
        header = f.read(len(_INDEX_HEADER) + 9)
    if len(header) < len(_INDEX_HEADER) + 9 or not header.startswith(_INDEX_HEADER):
        raise ConfigError(
            f"{idx} is not a megatron-core index file: rebuild the dataset "
            "(megatron-ext data build)"
        )
    code = struct.unpack("<B", header[-1:])[0]
    if code not in _DTYPES:
        raise ConfigError(f"{idx}: token dtype code {code} is not an integer type")
    dtype = np.dtype(_DTYPES[code])
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    total = tokens.size * dtype.itemsize
    if tokens.size == 0:
        return -1, 0, 0
    chunk = _CHUNK // dtype.itemsize
    starts = range(0, tokens.size, chunk)
    if total > SCAN_BYTES:  # evenly spread chunks
        n = SCAN_BYTES // _CHUNK
        starts = range(0, tokens.size, max(chunk, tokens.size // n))
    top = max(int(tokens[s : s + chunk].max()) for s in starts)
    checked = min(total, len(starts) * _CHUNK)
    return top, checked, total
