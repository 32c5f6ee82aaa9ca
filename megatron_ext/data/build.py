"""megatron-core GPT datasets over an indexed dataset written by
:func:`megatron_ext.data.indexed.build_indexed_dataset` (``<prefix>.bin/.idx``, megatron-core's
format: one document is one sequence, each followed by the tokenizer's ``eod``).

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
from pathlib import Path

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.tokenizers import MegatronTokenizerBase

from megatron_ext.data.indexed import idx_path
from megatron_ext.data.tokenizers import PretrainingTokenizer
from megatron_ext.errors import ConfigError

# megatron-ext's tokenizers implement megatron-core's tokenizer interface without importing it
# (`data build` runs without megatron-core); declared here, where they are handed to it, so that
# isinstance(tokenizer, MegatronTokenizerBase) holds for megatron-core's dataset code.
MegatronTokenizerBase.register(PretrainingTokenizer)


SplitSizes = tuple[int | None, int | None, int | None]


def build_gpt_datasets(
    prefix: str | Path,
    tokenizer: PretrainingTokenizer,
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
    idx = os.stat(idx_path(prefix))
    return f"{prefix}.cache/{idx.st_size}-{idx.st_mtime_ns}"
