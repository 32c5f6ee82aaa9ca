"""Routing features from the base model: the mean last-block hidden state over a span.

- prefix features: over each document's first ``route_tokens`` tokens (train, router and
  evaluation documents); the prefix is never scored;
- evaluation and router documents are read to ``dipaco.eval_seq_length`` tokens (the paper's
  2,048), training documents to ``training.seq_length`` (prefix features are the same either
  way: the model is causal);
- chunk features (evaluation and router documents, for each W of ``eval_every_tokens``):
  chunk 0 is the prefix, chunk i >= 1 the tokens ``[R + (i-1)W, R + iW)``; chunk i's features
  choose the path for chunk i + 1, so a chunk never routes itself. Stored flat, with each
  document's first row in ``<name>_w<W>_offsets``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from megatron_ext.dipaco.data.documents import document_batch
from megatron_ext.dipaco.recipe import DipacoConfig, eval_tokens

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.config.schema import Recipe
    from megatron_ext.dipaco.model.path_model import PathModel

__all__ = ["base_features", "chunk_spans"]


def chunk_spans(length: int, route_tokens: int, window: int) -> list[tuple[int, int]]:
    """Token spans of a ``length``-token document: the prefix, then windows of ``window``."""
    prefix = min(route_tokens, length)
    spans = [(0, prefix)]
    start = prefix
    while start < length:
        spans.append((start, min(start + window, length)))
        start += window
    return spans


def base_features(
    model: PathModel,
    dataset: IndexedDataset,
    split: dict[str, np.ndarray],
    recipe: Recipe,
    check: Callable[[], None],
) -> dict[str, np.ndarray]:
    """Prefix features of every split and chunk features of ``eval``/``router`` documents, by
    ``model`` (holding the base model's parameters) on ``dataset``'s documents ``split``
    (``train``/``router``/``eval`` ids); ``check`` is called before each split (it raises to
    stop, e.g. when the lease was lost)."""
    d = recipe.section(DipacoConfig)
    r, max_tokens = d.route_tokens, recipe.training.seq_length + 1
    out: dict[str, np.ndarray] = {}
    for name in ("train", "router", "eval"):
        check()
        # the W-routers learn on router-document chunks as far as the evaluation reads
        length = eval_tokens(recipe) if name != "train" else max_tokens
        docs = document_batch(dataset, split[name], length)
        out[name] = model.prefix_features(docs, r).numpy()
        if name == "train":
            continue
        for w in d.eval_every_tokens:
            spans = [chunk_spans(int(n), r, w) for n in docs.lengths]
            feats = model.span_features(docs, spans)
            out[f"{name}_w{w}"] = np.concatenate([f.numpy() for f in feats])
            out[f"{name}_w{w}_offsets"] = np.cumsum([0, *(len(s) for s in spans)])
    return out
