"""DiPaCo's documents: the corpus as a megatron-core indexed dataset, its split, each path's
batches, and documents to score.

- :func:`ensure_corpus`: the SentencePiece model (trained on ``data.source`` when
  ``data.tokenizer_model`` does not exist yet) and the indexed dataset ``data.path`` (built from
  ``data.source`` when missing); one document is one sequence ending with ``eod``.
- :func:`split_documents`: a seeded split of the document ids into ``eval`` (held out, only
  documents longer than the routing prefix), ``router`` (held out to fit routers) and
  ``train``; each path's shard keeps its own validation slice (:func:`shard_split`).
- :class:`ShardStream`: a shard's documents as one token stream; the batch of inner step k of
  phase t of path p is B windows of ``seq_length + 1`` tokens at offsets drawn from a generator
  keyed by (seed, path, phase, step): whichever worker runs it, it gets the same tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset

from megatron_ext.config.schema import Recipe
from megatron_ext.data.corpus import iter_documents
from megatron_ext.data.indexed import build_indexed_dataset
from megatron_ext.data.tokenizers import (
    PretrainingTokenizer,
    build_tokenizer,
    train_sentencepiece,
)
from megatron_ext.dipaco.model.path_model import TextBatch
from megatron_ext.dipaco.recipe import DipacoConfig
from megatron_ext.errors import ConfigError

__all__ = [
    "ShardStream",
    "document_batch",
    "ensure_corpus",
    "open_corpus",
    "shard_split",
    "split_documents",
]

# generator streams (the first key after the seed), so two uses never share draws
STREAM_SPLIT, STREAM_BATCH, STREAM_SHARD, STREAM_BASE = 1, 2, 3, 4
VAL_WINDOWS = 16  # validation windows scored per path check, at most


def ensure_corpus(recipe: Recipe) -> PretrainingTokenizer:
    """The tokenizer and the indexed dataset, made from ``data.source`` where missing."""
    data, d = recipe.data, recipe.section(DipacoConfig)
    if data.tokenizer == "sentencepiece" and not Path(data.tokenizer_model).is_file():
        if not data.source:
            raise ConfigError(
                f"data.tokenizer_model={data.tokenizer_model!r} does not exist and there is no "
                f"data.source to train it on"
            )
        prefix = data.tokenizer_model.removesuffix(".model")
        train_sentencepiece(iter_documents(data.source), prefix, d.tokenizer_vocab_size)
    tokenizer = build_tokenizer(data.tokenizer, data.tokenizer_model, recipe.model.vocab_size)
    if not IndexedDataset.exists(data.path):
        if not data.source:
            raise ConfigError(f"no indexed dataset at data.path={data.path!r} and no data.source")
        Path(data.path).parent.mkdir(parents=True, exist_ok=True)
        build_indexed_dataset(data.source, data.path, tokenizer)
    return tokenizer


def open_corpus(recipe: Recipe) -> tuple[PretrainingTokenizer, IndexedDataset]:
    """The tokenizer and the dataset, both existing (:func:`ensure_corpus` made them)."""
    tokenizer = build_tokenizer(
        recipe.data.tokenizer, recipe.data.tokenizer_model, recipe.model.vocab_size
    )
    return tokenizer, IndexedDataset(recipe.data.path)


def _rng(seed: int, *key: int) -> np.random.Generator:
    return np.random.default_rng([seed, *key])


def split_documents(lengths: np.ndarray, recipe: Recipe) -> dict[str, np.ndarray]:
    """Document ids (sorted) of ``eval``, ``router`` and ``train`` from a seeded permutation.

    ``lengths``: (n,) tokens per document. Evaluation documents must have something to score
    after the ``route_tokens`` prefix (at least 2 targets); a ``ConfigError`` when the corpus
    is too small for the split or has fewer training documents than paths."""
    d, seed = recipe.section(DipacoConfig), recipe.seed
    n = len(lengths)
    order = _rng(seed, STREAM_SPLIT).permutation(n)
    scorable = order[lengths[order] >= d.route_tokens + 3]
    n_eval = min(d.eval_documents, max(1, round(d.eval_fraction * n)), len(scorable))
    eval_ids = scorable[:n_eval]
    rest = order[~np.isin(order, eval_ids)]
    n_router = max(1, round(d.router_fraction * n))
    router, train = rest[:n_router], rest[n_router:]
    if n_eval == 0 or len(train) == 0:
        raise ConfigError(
            f"the corpus has {n} documents ({len(scorable)} longer than dipaco.route_tokens="
            f"{d.route_tokens}): too few to hold out evaluation and router documents; add text"
        )
    return {"eval": np.sort(eval_ids), "router": np.sort(router), "train": np.sort(train)}


def shard_split(docs: np.ndarray, val_fraction: float, seed: int, path: int, phase: int):
    """(train, val) document ids of one path's shard: a seeded ``val_fraction`` (at least one
    document when the shard has two) is the path's early-stopping slice."""
    n_val = max(1, round(val_fraction * len(docs))) if len(docs) > 1 else 0
    order = _rng(seed, STREAM_SHARD, path, phase).permutation(len(docs))
    return np.sort(docs[order[n_val:]]), np.sort(docs[order[:n_val]])


class ShardStream:
    """A shard's documents end to end (in id order) as one token stream, read lazily."""

    def __init__(self, dataset: IndexedDataset, docs: np.ndarray) -> None:
        self.dataset, self.docs = dataset, np.asarray(docs, dtype=np.int64)
        lengths = dataset.sequence_lengths[self.docs].astype(np.int64)
        self.starts = np.concatenate([[0], np.cumsum(lengths)])
        self.tokens = int(self.starts[-1])

    def window(self, offset: int, length: int) -> np.ndarray:
        """Tokens ``offset .. offset + length - 1`` of the stream (int64)."""
        out, pos = [], offset
        i = int(np.searchsorted(self.starts, offset, side="right")) - 1
        while pos < offset + length:
            inner = pos - int(self.starts[i])
            take = min(offset + length - pos, int(self.starts[i + 1]) - pos)
            out.append(self.dataset.get(int(self.docs[i]), offset=inner, length=take))
            pos += take
            i += 1
        return np.concatenate(out).astype(np.int64)

    def batch(self, rows: int, seq_length: int, rng: np.random.Generator) -> torch.Tensor:
        """(rows, seq_length + 1) windows at offsets drawn from ``rng`` (the stream repeats
        when it is shorter than a window)."""
        need = seq_length + 1
        if self.tokens == 0:
            raise ValueError("an empty shard has no batches")
        if self.tokens < need:
            reps = -(-need // self.tokens)
            whole = np.tile(self.window(0, self.tokens), reps)[:need]
            return torch.as_tensor(np.stack([whole] * rows))
        offsets = rng.integers(0, self.tokens - need + 1, size=rows)
        return torch.as_tensor(np.stack([self.window(int(o), need) for o in offsets]))

    def step_batch(self, recipe: Recipe, stream: int, *key: int) -> list[torch.Tensor]:
        """One optimizer step's micro-batches, each (micro_batch_size, seq_length + 1), drawn
        with the generator keyed by (seed, ``stream``, ``*key``)."""
        t = recipe.training
        whole = self.batch(t.global_batch_size, t.seq_length, _rng(recipe.seed, stream, *key))
        return list(whole.split(t.micro_batch_size))

    def val_windows(self, seq_length: int, limit: int = VAL_WINDOWS) -> list[torch.Tensor]:
        """Consecutive (1, seq_length + 1) windows from the start of the stream (at most
        ``limit``; one wrapped window when the stream is shorter)."""
        need = seq_length + 1
        count = min(limit, max(1, self.tokens // need))
        if self.tokens < need:
            return [self.batch(1, seq_length, _rng(0))]
        return [torch.as_tensor(self.window(i * need, need)[None]) for i in range(count)]


def document_batch(dataset: IndexedDataset, docs: Sequence[int], max_tokens: int) -> TextBatch:
    """The first ``max_tokens`` tokens of each document, right-padded with 0 (masked)."""
    arrays = [
        dataset.get(int(i), length=min(int(dataset.sequence_lengths[i]), max_tokens)) for i in docs
    ]
    width = max(len(a) for a in arrays)
    tokens = np.zeros((len(arrays), width), dtype=np.int64)
    for row, a in enumerate(arrays):
        tokens[row, : len(a)] = a
    lengths = torch.tensor([len(a) for a in arrays])
    mask = torch.arange(width)[None, :] < lengths[:, None]
    return TextBatch(torch.as_tensor(tokens), mask, lengths)
