"""Build megatron-core indexed datasets from text, and GPT datasets from those.

On disk a dataset is megatron-core's pair ``<prefix>.bin`` (token ids, one document after the
other, each followed by the tokenizer's ``eod``) and ``<prefix>.idx`` (sequence lengths and
offsets). One document is one sequence.

The GPT datasets are megatron-core's ``GPTDataset``: the documents of a split are concatenated
(in a seeded random order, reshuffled each epoch), the stream ``t`` is cut into windows of
``seq_length + 1`` tokens that overlap by one, and the windows are shuffled (same seed). Sample
``i`` is a dict of tensors of shape ``[seq_length]``, for the window starting at some ``k``:

- ``tokens``: ``t[k : k + seq_length]``,
- ``labels``: ``t[k + 1 : k + seq_length + 1]`` (the next token of each position),
- ``loss_mask``: float32 ones (megatron-core would zero padded positions, but a split's last,
  partial sample is dropped rather than padded, so there are none),
- ``position_ids``: ``0 .. seq_length - 1`` (not reset at document boundaries).

``tokens``, ``labels`` and ``position_ids`` are int64. Documents are joined by their ``eod``
token and the loss is kept on it: the model learns where documents end.

No ``attention_mask``: the model's attention is causal by construction.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import (
    DType,
    IndexedDataset,
    IndexedDatasetBuilder,
    get_bin_path,
    get_idx_path,
)
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_ext.data.corpus import iter_documents
from megatron_ext.errors import ConfigError


@dataclass(frozen=True)
class BuildStats:
    """What :func:`build_indexed_dataset` wrote."""

    prefix: str
    documents: int
    tokens: int  # including one eod per document
    text_bytes: int  # UTF-8 bytes of the documents read
    file_bytes: int  # .bin + .idx on disk
    seconds: float  # wall time, reading and tokenizing included


def build_indexed_dataset(
    inputs: Sequence[str],
    output_prefix: str | Path,
    tokenizer: MegatronTokenizerBase,
    json_key: str = "text",
) -> BuildStats:
    """Tokenize the documents of ``inputs`` into ``<output_prefix>.bin/.idx``.

    ``inputs`` are those of :func:`megatron_ext.data.corpus.iter_documents`, checked before
    anything is written. Each document becomes one sequence: its ids followed by
    ``tokenizer.eod``. The files are written under temporary names and renamed into place at
    the end, the ``.idx`` last, so the final prefix only ever names a complete dataset (or none):
    a failure or crash part way leaves at most ``<prefix>.partial-<pid>.*`` files behind, and an
    existing dataset at the prefix is replaced only once the new one is complete.
    """
    t0 = time.perf_counter()
    documents = iter_documents(inputs, json_key)
    prefix = str(output_prefix)
    Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    partial = f"{prefix}.partial-{os.getpid()}"
    dtype = DType.optimal_dtype(tokenizer.vocab_size)  # uint16 for vocabularies under 65500
    builder = IndexedDatasetBuilder(get_bin_path(partial), dtype=dtype)
    n_docs = n_tokens = n_bytes = 0
    try:
        for doc in documents:
            ids = [*tokenizer.tokenize(doc), tokenizer.eod]
            builder.add_document(np.asarray(ids, dtype=dtype), lengths=[len(ids)])
            n_docs += 1
            n_tokens += len(ids)
            n_bytes += len(doc.encode("utf-8"))
        builder.finalize(get_idx_path(partial))
        _commit(partial, prefix)
    except BaseException:
        builder.data_file.close()
        for path in (get_bin_path(partial), get_idx_path(partial)):
            Path(path).unlink(missing_ok=True)
        raise
    size = sum(Path(p).stat().st_size for p in (get_bin_path(prefix), get_idx_path(prefix)))
    return BuildStats(
        prefix=prefix,
        documents=n_docs,
        tokens=n_tokens,
        text_bytes=n_bytes,
        file_bytes=size,
        seconds=time.perf_counter() - t0,
    )


def _commit(partial: str, prefix: str) -> None:
    """Move a finished dataset to ``prefix``: the ``.idx`` is the commit marker, moved last."""
    for path in (get_bin_path(partial), get_idx_path(partial)):
        # flush to disk before the rename makes it visible: a power cut must not leave a
        # renamed but empty file
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    # Without its .idx the old dataset is unreadable, so it cannot pair with the new .bin.
    Path(get_idx_path(prefix)).unlink(missing_ok=True)
    shutil.rmtree(f"{prefix}.cache", ignore_errors=True)  # the old dataset's GPT indices
    os.replace(get_bin_path(partial), get_bin_path(prefix))
    os.replace(get_idx_path(partial), get_idx_path(prefix))


SplitSizes = tuple[int | None, int | None, int | None]


def build_gpt_datasets(
    prefix: str | Path,
    tokenizer: MegatronTokenizerBase,
    seq_length: int,
    split: str,
    seed: int,
    num_samples: SplitSizes,
) -> tuple[GPTDataset | None, GPTDataset | None, GPTDataset | None]:
    """megatron-core GPT datasets (train, valid, test) over the indexed dataset at ``prefix``.

    Args:
        prefix: indexed-dataset prefix (``<prefix>.bin/.idx``).
        tokenizer: the tokenizer the dataset was built with (``eod``, ``pad``, ``vocab_size``).
        seq_length: tokens per sample.
        split: document weights of train, valid, test, e.g. ``"98,2,0"``; a split of weight 0
            is returned as None.
        seed: seed of the document and sample shuffles.
        num_samples: samples wanted per split; the documents are repeated (reshuffled each
            epoch) as often as needed, and None means one epoch. The dataset may be longer.

    Samples are described in the module docstring; ``train[j]`` is a pure function of ``j``,
    the files and the arguments, so a training loop can index samples by a global counter.

    With ``torch.distributed`` initialised this must be called on every rank (it synchronises
    on the default group): global rank 0 builds the shuffle/sample indices and saves them under
    ``<prefix>.cache/``, then the other ranks load them, so that folder must be on a file system
    all ranks share, as the dataset is. :func:`build_indexed_dataset` empties that folder when it
    replaces a dataset, and the indices are filed under the ``.idx`` file's size and
    modification time, so a dataset replaced by other tools does not reuse stale indices either.
    """
    prefix = str(prefix)
    if not IndexedDataset.exists(prefix):
        raise ConfigError(
            f"no indexed dataset at {prefix!r} ({prefix}.bin/.idx); build one "
            "with `megatron-ext data build`"
        )
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=([prefix], None),
        split=split,
        path_to_cache=_cache_dir(prefix),
        tokenizer=tokenizer,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    # is_built_on_rank is true everywhere: every rank holds every split and picks its samples
    # by index (megatron-core still builds on rank 0 first and the others read its cache).
    train, valid, test = BlendedMegatronDatasetBuilder(
        GPTDataset, list(num_samples), lambda: True, config
    ).build()
    return train, valid, test


def _cache_dir(prefix: str) -> str:
    """``<prefix>.cache/<idx size>-<idx mtime in ns>``: new indices for every rebuilt dataset.

    megatron-core names its cache files by a hash of the dataset *path* and the GPT settings;
    the folder adds the dataset's identity, since the indices depend on its document lengths.
    """
    idx = os.stat(get_idx_path(prefix))
    return f"{prefix}.cache/{idx.st_size}-{idx.st_mtime_ns}"
