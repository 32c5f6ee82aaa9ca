"""The work of each task kind (``run_task``): every function reads its inputs from the tasks it
depends on, writes its files to its own attempt folder and returns its result (JSON) for the
queue. Nothing here depends on which worker runs a task or how often it was attempted.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from megatron_ext.dipaco.context import TaskContext, load_arrays, save_arrays
from megatron_ext.dipaco.data import (
    STREAM_BASE,
    STREAM_BATCH,
    ShardStream,
    document_batch,
    ensure_corpus,
    shard_split,
    split_documents,
)
from megatron_ext.dipaco.group import data_parallel_inner_steps
from megatron_ext.dipaco.inner import InnerOptimizer, inner_schedule, inner_steps
from megatron_ext.dipaco.layout import ModuleId
from megatron_ext.dipaco.model import lm_loss
from megatron_ext.dipaco.outer import OuterConfig, outer_step
from megatron_ext.dipaco.plan import score_id
from megatron_ext.dipaco.queue import Lease
from megatron_ext.dipaco.recipe import eval_tokens
from megatron_ext.dipaco.routing import fit_discriminative, fit_generative, shards
from megatron_ext.dipaco.store import assign_params, load_tensors, save_tensors, split_by_level
from megatron_ext.dipaco.zero_order import SPSAInner, spsa_inner_steps
from megatron_ext.errors import ConfigError
from megatron_ext.schedules.plan import lr_schedule, run_steps

__all__ = ["run_task"]


def run_task(ctx: TaskContext, lease: Lease) -> dict[str, Any]:
    """Run ``lease``'s task; returns its result."""
    kinds = {
        "prepare": prepare,
        "base": base,
        "route": route,
        "train": train,
        "outer": outer,
        "score": score,
        "final": final,
    }
    if lease.kind == "eval":
        from megatron_ext.dipaco.evaluate import evaluate

        return evaluate(ctx, lease)
    return kinds[lease.kind](ctx, lease, **lease.payload)


def _scored_mean(losses: list[torch.Tensor], route_tokens: int) -> np.ndarray:
    """Each document's mean loss over its targets after the routing prefix."""
    return np.array([float(x[route_tokens - 1 :].mean()) for x in losses])


def _val_loss(ctx: TaskContext, stream: ShardStream) -> float | None:
    """Mean loss of the worker's model on a shard's validation windows (None: no slice)."""
    if stream.tokens == 0:
        return None
    model = ctx.path_model.model
    model.eval()
    with torch.no_grad():
        losses = [
            float(lm_loss(model, w)) for w in stream.val_windows(ctx.recipe.training.seq_length)
        ]
    return float(np.mean(losses))


def _checked(ctx: TaskContext, items: Iterator[Any]) -> Iterator[Any]:
    """``items``, stopping with :class:`LeaseLost` as soon as the lease is lost."""
    for item in items:
        ctx.check_lease()
        yield item


# ---------------------------------------------------------------------------- tasks


def prepare(ctx: TaskContext, lease: Lease) -> dict[str, Any]:
    """Tokenizer, indexed dataset, the eval / router / train split."""
    tokenizer = ensure_corpus(ctx.recipe)
    _, dataset = ctx.corpus
    lengths = np.asarray(dataset.sequence_lengths, dtype=np.int64)
    split = split_documents(lengths, ctx.recipe)
    paths = ctx.layout.num_paths
    if len(split["train"]) < paths:
        raise ConfigError(
            f"{len(split['train'])} training documents leave some of the {paths} paths an empty "
            f"shard: add text to data.source, or use fewer paths (dipaco.modules_per_level)"
        )
    save_arrays(ctx.out(lease) / "split.npz", **split)
    return {
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "vocab_size": tokenizer.vocab_size,
        **{k: len(v) for k, v in split.items()},
    }


def base(ctx: TaskContext, lease: Lease) -> dict[str, Any]:
    """The dense base model on all training documents (or the recipe's base checkpoint)."""
    pm, out = ctx.path_model, ctx.out(lease) / "model.pt"
    if ctx.d.base_checkpoint:
        from megatron_ext.dipaco.checks import load_base_checkpoint

        weights = load_base_checkpoint(ctx.d.base_checkpoint, pm.init_state, pm.model)
        save_tensors(out, weights)
        return {"steps": 0, "from": ctx.d.base_checkpoint}
    _, dataset = ctx.corpus
    stream = ShardStream(dataset, ctx.split()["train"])
    assign_params(pm.model, pm.init_state)
    optimizer = InnerOptimizer(list(pm.model.named_parameters()), ctx.recipe.optimizer)
    schedule = lr_schedule(ctx.recipe)
    steps = run_steps(ctx.recipe)  # training.steps, or what training.train_tokens takes
    batches = (stream.step_batch(ctx.recipe, STREAM_BASE, k) for k in range(steps))
    lrs = [schedule.lr_at(k) for k in range(steps)]
    losses = inner_steps(pm.model, optimizer, _checked(ctx, batches), lrs, lm_loss, "base")
    save_tensors(out, pm.state())
    return {"steps": steps, "loss_first": losses[0], "loss_last": losses[-1]}


def route(ctx: TaskContext, lease: Lease, phase: int) -> dict[str, Any]:
    """Phase 0: base features, product k-means shards. Later: the discriminative re-shard."""
    d, layout, seed = ctx.d, ctx.layout, ctx.recipe.seed
    split, out = ctx.split(), ctx.out(lease)
    if phase == 0:
        from megatron_ext.dipaco.features import base_features

        feats = base_features(ctx, split)
        save_arrays(out / "features.npz", **feats)
        router, first = fit_generative(
            feats["train"], layout.modules_per_level, max_iter=d.kmeans_max_iter, seed=seed
        )
        scores = router.scores(feats["train"])
        scores[np.arange(len(first)), first] = np.inf  # the balanced choice comes first
        routes = np.argsort(-scores, axis=1, kind="stable")[:, : d.train_overlap]
        routes, filled = _fill_empty_products(routes, router.scores(feats["train"]))
    else:
        filled = []
        feats = ctx.features()
        losses = np.stack(
            [
                load_arrays(ctx.done(score_id(phase - 1, p)) / "losses.npz")["losses"]
                for p in range(layout.num_paths)
            ],
            axis=1,
        )
        router = fit_discriminative(feats["router"], losses, max_iter=d.router_max_iter, seed=seed)
        routes = router.route(feats["train"], d.train_overlap)
    docs = shards(routes, split["train"], layout.num_paths)
    previous = ctx.shards(phase - 1) if phase > 0 else None
    # every path's early-stopping slice is drawn once, at phase 0, and kept through every
    # re-shard, so the losses early stopping compares are on the same documents (paper:
    # Sec. 2.7); a path never trains on its own slice
    if phase == 0:
        vals = [shard_split(s, d.val_fraction, seed, p, 0)[1] for p, s in enumerate(docs)]
    else:
        phase0 = ctx.shards(0)
        vals = [phase0[f"val_{p}"] for p in range(layout.num_paths)]
    docs = [np.setdiff1d(s, v) for s, v in zip(docs, vals, strict=True)]
    kept = [p for p, s in enumerate(docs) if len(s) == 0]
    if kept and previous is None:
        raise ConfigError(f"paths {kept} got empty shards; add text or use fewer paths")
    arrays, tokens = {}, []
    _, dataset = ctx.corpus
    for p, s in enumerate(docs):
        # a path no training document prefers keeps its previous training documents
        train_docs = previous[f"train_{p}"] if p in kept else s
        arrays[f"train_{p}"], arrays[f"val_{p}"] = train_docs, vals[p]
        tokens.append(int(dataset.sequence_lengths[train_docs].sum()))
    save_arrays(out / "shards.npz", **arrays)
    save_arrays(out / "router.npz", **router.to_arrays())
    result = {"phase": phase, "kind": router.kind, "shard_tokens": tokens, "kept": kept}
    return {**result, "filled": filled}


_MIN_FILL = 8  # documents at least: a few may be other paths' early-stopping slices


def _fill_empty_products(routes: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """Product k-means leaves a path empty when no document is in all its modules' clusters
    at once (the levels' clusters are correlated). Such a path also gets the documents that
    score highest for it, as many as the smallest non-empty path has (at least 8), so every path
    trains on
    the documents nearest its modules. ``routes`` (n, k), ``scores`` (n, P); returns (routes
    with one more column per filled path, -1 where a document gains nothing; the paths
    filled)."""
    num_paths = scores.shape[1]
    counts = np.bincount(routes.ravel(), minlength=num_paths)
    empty = [int(p) for p in np.flatnonzero(counts == 0)]
    if not empty:
        return routes, []
    take = max(int(counts[counts > 0].min()), _MIN_FILL)
    columns = [routes]
    for p in empty:
        column = np.full((len(routes), 1), -1, dtype=routes.dtype)
        column[np.argsort(-scores[:, p], kind="stable")[:take], 0] = p
        columns.append(column)
    return np.concatenate(columns, axis=1), empty


def train(ctx: TaskContext, lease: Lease, phase: int, path: int) -> dict[str, Any]:
    """τ inner steps of ``path`` from its modules' version ``phase``."""
    d, recipe, pm = ctx.d, ctx.recipe, ctx.path_model
    _, dataset = ctx.corpus
    shard = ctx.shards(phase)
    stream = ShardStream(dataset, shard[f"train_{path}"])
    val = ShardStream(dataset, shard[f"val_{path}"])
    specific, opt_state, specific_momentum = ctx.path_state(phase, path)
    modules = [ctx.module(phase, m)[0] for m in ctx.layout.path_modules(path)]
    assign_params(pm.model, *modules, specific)
    val_before = _val_loss(ctx, val)
    optimizer = _inner_optimizer(ctx, path)
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    sched = inner_schedule(recipe.optimizer, d.phases, d.tau, d.inner_warmup_steps)
    steps = range(phase * d.tau, (phase + 1) * d.tau)
    batches = _checked(
        ctx, (stream.step_batch(recipe, STREAM_BATCH, path, phase, k) for k in steps)
    )
    where = f"train phase {phase} path {path}"
    lrs = [sched.lr_at(k) for k in steps]
    if d.inner == "spsa":
        losses = spsa_inner_steps(optimizer, batches, lrs, steps[0], phase, lm_loss, where)
    elif ctx.group.size > 1:
        losses = data_parallel_inner_steps(
            pm.model, optimizer, batches, lrs, lm_loss, ctx.group, where
        )
    else:
        losses = inner_steps(pm.model, optimizer, batches, lrs, lm_loss, where)
    if not ctx.group.leader:  # the leader writes and reports
        return {}
    parts, out = split_by_level(pm.state(), ctx.layout), ctx.out(lease)
    for level in range(ctx.layout.num_levels):
        save_tensors(out / f"l{level}.pt", parts.get(level, {}))  # {}: a level of no parts
    # the path-specific parts are modules used by one path (P = 1): they take the outer step
    # too, here, on the worker (weight √1 · 1 = 1; paper: Sec. 2.6.1, "empirically it improves
    # convergence"); their momentum stays with the path like the parts themselves
    own, own_momentum = parts.get(None, {}), {}
    if own:
        own, own_momentum = outer_step(
            specific, specific_momentum, {path: 1}, lambda _: parts[None], _outer_config(d)
        )
    save_tensors(
        out / "state.pt",
        {"specific": own, "specific_momentum": own_momentum, "optimizer": optimizer.state_dict()},
    )
    return {
        "phase": phase,
        "path": path,
        "shard_tokens": stream.tokens,
        "val_before": val_before,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "loss_mean": float(np.mean(losses)),
        "ranks": ctx.group.size,
    }


def _inner_optimizer(ctx: TaskContext, path: int) -> Any:
    """The recipe's inner optimizer over the worker's model (gradient or zero-order)."""
    model, opt = ctx.path_model.model, ctx.recipe.optimizer
    if ctx.d.inner == "spsa":
        return SPSAInner(
            model,
            n_pert=ctx.d.spsa_n_pert,
            eps=ctx.d.spsa_eps,
            weight_decay=opt.weight_decay,
            betas=(opt.adam_beta1, opt.adam_beta2),
            seed=ctx.recipe.seed,
            path=path,
        )
    return InnerOptimizer(list(model.named_parameters()), opt)


def _outer_config(d: Any) -> OuterConfig:
    """The recipe's outer optimizer (``dipaco.outer_*``, the paper's two switches)."""
    return OuterConfig(
        lr=d.outer_lr,
        momentum=d.outer_momentum,
        nesterov=d.outer_nesterov,
        sqrt_p_scaling=d.sqrt_p_scaling,
        alpha_weighting=d.alpha_weighting,
    )


def outer(ctx: TaskContext, lease: Lease, phase: int, level: int, index: int) -> dict[str, Any]:
    """The outer step of module (level, index) over the paths that used it in ``phase``."""
    from megatron_ext.dipaco.plan import train_id

    module, d = ModuleId(level, index), ctx.d
    params, momentum = ctx.module(phase, module)
    users = ctx.layout.paths_of(module)
    tokens = {p: int(ctx.result(train_id(phase, p))["shard_tokens"]) for p in users}
    cfg = _outer_config(d)

    def load_path(p: int) -> dict[str, torch.Tensor]:
        ctx.check_lease()
        return load_tensors(ctx.done(train_id(phase, p)) / f"l{level}.pt")

    new, new_momentum = outer_step(params, momentum, tokens, load_path, cfg)
    save_tensors(ctx.out(lease) / "module.pt", {"params": new, "momentum": new_momentum})
    size = sum(t.numel() * t.element_size() for t in new.values())
    return {"version": phase + 1, "paths": list(users), "module_bytes": size}


def score(ctx: TaskContext, lease: Lease, phase: int, path: int) -> dict[str, Any]:
    """Path ``path`` at version ``phase + 1`` on every router document (mean loss after the
    prefix): the targets of the discriminative router."""
    losses = _path_losses(ctx, phase + 1, path, ctx.split()["router"])
    save_arrays(ctx.out(lease) / "losses.npz", losses=_scored_mean(losses, ctx.d.route_tokens))
    return {"phase": phase, "path": path}


def _path_losses(
    ctx: TaskContext, version: int, path: int, docs: np.ndarray, max_tokens: int | None = None
) -> list:
    """Per-token losses of ``path`` at ``version`` on ``docs``, each read to ``max_tokens``
    (None: training.seq_length + 1)."""
    _, dataset = ctx.corpus
    pm = ctx.path_model
    assign_params(pm.model, *ctx.composition(version, path))
    batch = document_batch(dataset, docs, max_tokens or ctx.recipe.training.seq_length + 1)
    return pm.token_losses(batch)


def final(ctx: TaskContext, lease: Lease, path: int) -> dict[str, Any]:
    """Early stopping: the version with the lowest validation loss on the path's fixed
    early-stopping slice (drawn at phase 0, the same documents for every version); its
    per-token losses on the evaluation documents."""
    from megatron_ext.dipaco.plan import train_id

    d = ctx.d
    _, dataset = ctx.corpus
    history = [ctx.result(train_id(t, path))["val_before"] for t in range(d.phases)]
    val = ShardStream(dataset, ctx.shards(d.phases - 1)[f"val_{path}"])
    assign_params(ctx.path_model.model, *ctx.composition(d.phases, path))
    history.append(_val_loss(ctx, val))
    known = [(v, i) for i, v in enumerate(history) if v is not None]
    best = min(known)[1] if known else d.phases
    split = ctx.split()
    out = ctx.out(lease)
    for name in ("eval", "router"):
        length = eval_tokens(ctx.recipe)  # router chunks train the W-routers
        losses = _path_losses(ctx, best, path, split[name], length)
        save_tensors(out / f"{name}_losses.pt", {"losses": losses})
    return {"path": path, "val": history, "best_version": best}
