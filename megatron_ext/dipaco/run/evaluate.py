"""The ``eval`` task: perplexity of the routed paths on held-out documents, and the summary.

Every evaluation document's targets after the ``route_tokens`` prefix are scored (the prefix
never is). Each path's per-token losses come from its ``final`` task (its early-stopping
version); the evaluation picks, per span of targets, whose losses count:

- ``once``: one path per document, the last training router's top-1 on the prefix features;
- ``w<W>``: every W tokens a sequence router reads the whole document so far: the first scored
  chunk is routed as ``once`` is (the last training router on the prefix), chunk i + 1 (i >= 1)
  by the mean base-model feature over chunks 0..i (the paper's re-routing, Sec. 4.4: the router
  sees everything before the chunk it routes, never the chunk itself). That router is fitted on
  the router documents' chunks i >= 1, each one's target being the path with the lowest loss
  over the next chunk's W tokens (logistic regression + frequency bias, as the training router);
- ``base``: the dense base model, the reference DiPaCo has to beat.

Writes ``summary.json`` (figures, each path's early-stopping choice) and, through the run's
metrics logger, one ``metrics.jsonl`` record per train task and one for the evaluation.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from megatron_ext.atomic import write_json
from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.data.documents import document_batch
from megatron_ext.dipaco.data.features import chunk_spans
from megatron_ext.dipaco.model.parts import assign_params
from megatron_ext.dipaco.recipe import DipacoConfig, eval_tokens
from megatron_ext.dipaco.run.plan import final_id, shard_phase, train_id
from megatron_ext.dipaco.run.store import RunFiles, load_tensors
from megatron_ext.dipaco.run.tools import TaskTools
from megatron_ext.dipaco.steps.routing import Router, fit_discriminative
from megatron_ext.errors import ConfigError
from megatron_ext.run.metrics import MetricsLogger

__all__ = ["evaluate", "routed_loss"]


def routed_loss(
    losses: list[list[torch.Tensor]], choice: list[list[int]], spans: list[list[tuple[int, int]]]
) -> tuple[float, int]:
    """(total nats, scored targets) when document d's chunk i + 1 is scored by path
    ``choice[d][i]``: ``losses[p][d]`` are path p's per-target losses (target j predicts token
    j + 1), ``spans[d]`` the document's chunks (chunk 0 is the unscored prefix)."""
    nats, count = 0.0, 0
    for d, doc_spans in enumerate(spans):
        for i, (a, b) in enumerate(doc_spans[1:]):
            part = losses[choice[d][i]][d][a - 1 : b - 1]
            nats += float(part.double().sum())
            count += len(part)
    return nats, count


def _window_targets(losses, spans) -> np.ndarray:
    """For every (document, chunk i < last), the path with the lowest loss over chunk i + 1."""
    rows = []
    for d, doc_spans in enumerate(spans):
        for a, b in doc_spans[1:]:
            rows.append([float(path[d][a - 1 : b - 1].double().sum()) for path in losses])
    return np.asarray(rows).reshape(-1, len(losses))


def _prefix_rows(
    feats: np.ndarray, offsets: np.ndarray, spans: list[list[tuple[int, int]]]
) -> list[np.ndarray]:
    """Per document, for every chunk i but its last (the ones that route a next chunk): the
    mean feature over the tokens of chunks 0..i, (chunks − 1, hidden). Chunk features are
    means over their spans, so the token-weighted running mean is the mean over the whole
    prefix read so far (the base model is causal: a token's feature does not see the future)."""
    rows = []
    for (a, b), doc_spans in zip(itertools.pairwise(offsets), spans, strict=True):
        if b - a != len(doc_spans):
            raise ValueError(f"chunk features hold {b - a} rows for {len(doc_spans)} spans")
        n = np.asarray([e - s for s, e in doc_spans], dtype=np.float64)[:, None]
        running = np.cumsum(feats[a:b] * n, axis=0) / np.cumsum(n, axis=0)
        rows.append(running[:-1])
    return rows


def evaluate(recipe: Recipe, files: RunFiles, tools: TaskTools) -> dict[str, Any]:
    """The ``eval`` task of the run of ``recipe`` (see the module docstring): reads the
    ``final`` tasks' losses and the routers from ``files``, scores the base model with the
    worker's model; writes ``summary.json`` and ``metrics.jsonl``, returns the figures."""
    d, layout, seed = recipe.section(DipacoConfig), files.layout, recipe.seed
    paths = layout.num_paths
    # what the run left: the split and the base features, each path's losses at its
    # early-stopping version (its ``final`` task), the last training router, the base model
    split, feats = files.split(), files.features()
    finals = [
        load_tensors(files.done(final_id(p)) / "eval_losses.pt")["losses"] for p in range(paths)
    ]
    router_losses = [
        load_tensors(files.done(final_id(p)) / "router_losses.pt")["losses"] for p in range(paths)
    ]
    router = Router.from_arrays(files.router_arrays(shard_phase(recipe, d.phases - 1)))
    base = files.composition(0, 0)
    dataset, pm = tools.dataset, tools.path_model
    r = d.route_tokens
    eval_length = eval_tokens(recipe)  # the paper's 2,048 (+ 1) where the recipe says so
    eval_docs = document_batch(dataset, split["eval"], eval_length)
    router_docs = document_batch(dataset, split["router"], eval_length)
    lengths = [int(n) for n in eval_docs.lengths]
    router_lengths = [int(n) for n in router_docs.lengths]
    results: dict[str, float] = {}
    # the base model
    assign_params(pm.model, *base)
    base_losses = pm.token_losses(eval_docs)
    once_spans = [[(0, min(r, n)), (min(r, n), n)] for n in lengths]
    results["base"] = _mean(routed_loss([base_losses], [[0] for _ in lengths], once_spans))
    # once per sequence: the last training router on the prefix
    top = router.route(feats["eval"], 1)[:, 0]
    results["once"] = _mean(routed_loss(finals, [[int(p)] for p in top], once_spans))
    # every W tokens
    for w in d.eval_every_tokens:
        tools.check_lease()
        spans = [chunk_spans(n, r, w) for n in router_lengths]
        targets = _window_targets(router_losses, spans)  # rows: (document, chunk i < last)
        rows = _prefix_rows(feats[f"router_w{w}"], feats[f"router_w{w}_offsets"], spans)
        # chunk 1 is routed by the prefix router: the W-router learns chunks i >= 1 only
        later = np.concatenate([np.arange(len(x)) >= 1 for x in rows])
        x = np.concatenate(rows)[later]
        w_router = (
            fit_discriminative(x, targets[later], max_iter=d.router_max_iter, seed=seed)
            if len(x)
            else None
        )
        eval_spans = [chunk_spans(n, r, w) for n in lengths]
        eval_rows = _prefix_rows(feats[f"eval_w{w}"], feats[f"eval_w{w}_offsets"], eval_spans)
        if w_router is None and any(len(x) > 1 for x in eval_rows):
            raise ConfigError(
                f"dipaco.eval_every_tokens W={w}: no router document is longer than the prefix "
                "plus one chunk, so the W-router has nothing to learn from; lower W or raise "
                "dipaco.eval_seq_length"
            )
        per_doc = []
        for first, doc_rows in zip(top, eval_rows, strict=True):
            rest = w_router.route(doc_rows[1:], 1)[:, 0] if len(doc_rows) > 1 else []
            per_doc.append([int(first), *(int(p) for p in rest)][: len(doc_rows)])
        results[f"w{w}"] = _mean(routed_loss(finals, per_doc, eval_spans))
    scored = sum(n - min(r, n) for n in lengths)
    return _write_summary(recipe, files, results, len(lengths), scored)


def _mean(total: tuple[float, int]) -> float:
    nats, count = total
    return nats / max(count, 1)


def _write_summary(
    recipe: Recipe, files: RunFiles, losses: dict[str, float], documents: int, targets: int
) -> dict[str, Any]:
    d, layout, run_dir = recipe.section(DipacoConfig), files.layout, files.run_dir
    paths = [files.result(final_id(p)) for p in range(layout.num_paths)]
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)  # a re-run rewrites it
    log = MetricsLogger(run_dir, echo=True, write=True, tensorboard=False, prefix="dipaco ")
    try:
        for t in range(d.phases):
            for p in range(layout.num_paths):
                res = files.result(train_id(t, p))
                log.record(t * layout.num_paths + p, {"step": t * d.tau, **res})
        figures = {
            "eval_loss": losses,
            "perplexity": {k: float(np.exp(v)) for k, v in losses.items()},
        }
        log.record(d.phases * layout.num_paths, {"step": d.phases * d.tau, **figures})
        log.info(
            "eval perplexity: "
            + ", ".join(f"{k} {v:.2f}" for k, v in figures["perplexity"].items())
        )
    finally:
        log.close()
    summary = {
        "trainer": "dipaco",
        "num_paths": layout.num_paths,
        "modules_per_level": list(layout.modules_per_level),
        "phases": d.phases,
        "tau": d.tau,
        "routing": d.routing,
        "eval_documents": documents,
        "eval_targets": targets,
        **figures,
        "early_stopping": [
            {"path": r["path"], "best_version": r["best_version"], "val_loss": r["val"]}
            for r in paths
        ],
    }
    write_json(run_dir / "summary.json", summary)
    return {k: summary[k] for k in ("eval_loss", "perplexity")}
