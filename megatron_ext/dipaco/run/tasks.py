"""The work of each task kind (``run_task``): every function reads its inputs from the tasks it
depends on (``files``: :class:`.store.RunFiles`), works with the worker's corpus and model
(``tools``: :class:`.tools.TaskTools`), writes its files to its own attempt folder (``out``) and
returns its result (JSON) for the queue. Nothing here depends on which worker runs a task or how
often it was attempted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.data.documents import (
    STREAM_BASE,
    STREAM_BATCH,
    ShardStream,
    document_batch,
    ensure_corpus,
    shard_split,
    split_documents,
)
from megatron_ext.dipaco.model.layout import ModuleId
from megatron_ext.dipaco.model.parts import assign_params, split_by_level
from megatron_ext.dipaco.model.path_model import lm_loss
from megatron_ext.dipaco.queue.task_queue import Lease
from megatron_ext.dipaco.recipe import DipacoConfig, eval_tokens
from megatron_ext.dipaco.run.group import data_parallel_inner_steps
from megatron_ext.dipaco.run.plan import score_id
from megatron_ext.dipaco.run.store import (
    RunFiles,
    load_arrays,
    load_tensors,
    save_arrays,
    save_tensors,
)
from megatron_ext.dipaco.run.tools import TaskTools
from megatron_ext.dipaco.steps.inner import InnerOptimizer, inner_schedule, inner_steps
from megatron_ext.dipaco.steps.outer import OuterConfig, outer_step
from megatron_ext.dipaco.steps.routing import fit_discriminative, fit_generative, shards
from megatron_ext.dipaco.steps.zero_order import SPSAInner, spsa_inner_steps
from megatron_ext.errors import ConfigError
from megatron_ext.schedules.plan import lr_schedule, run_steps

__all__ = ["run_task"]


def run_task(recipe: Recipe, files: RunFiles, tools: TaskTools, lease: Lease) -> dict[str, Any]:
    """Run ``lease``'s task of the run of ``recipe``; returns its result."""
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
        from megatron_ext.dipaco.run.evaluate import evaluate

        return evaluate(recipe, files, tools)
    return kinds[lease.kind](recipe, files, tools, files.out(lease), **lease.payload)


def _scored_mean(losses: list[torch.Tensor], route_tokens: int) -> np.ndarray:
    """Each document's mean loss over its targets after the routing prefix."""
    return np.array([float(x[route_tokens - 1 :].mean()) for x in losses])


def _val_loss(model: torch.nn.Module, stream: ShardStream, seq_length: int) -> float | None:
    """Mean loss of ``model`` on a shard's validation windows (None: no slice)."""
    if stream.tokens == 0:
        return None
    model.eval()
    with torch.no_grad():
        losses = [float(lm_loss(model, w)) for w in stream.val_windows(seq_length)]
    return float(np.mean(losses))


def _checked(check: Callable[[], None], items: Iterator[Any]) -> Iterator[Any]:
    """``items``, calling ``check`` before each (it raises :class:`.tools.LeaseLost` as soon as
    the lease is lost)."""
    for item in items:
        check()
        yield item


# ---------------------------------------------------------------------------- tasks


def prepare(recipe: Recipe, files: RunFiles, tools: TaskTools, out: Path) -> dict[str, Any]:
    """Tokenizer, indexed dataset, the eval / router / train split."""
    tokenizer = ensure_corpus(recipe)
    lengths = np.asarray(tools.dataset.sequence_lengths, dtype=np.int64)
    split = split_documents(lengths, recipe)
    paths = files.layout.num_paths
    if len(split["train"]) < paths:
        raise ConfigError(
            f"{len(split['train'])} training documents leave some of the {paths} paths an empty "
            f"shard: add text to data.source, or use fewer paths (dipaco.modules_per_level)"
        )
    save_arrays(out / "split.npz", **split)
    return {
        "documents": len(lengths),
        "tokens": int(lengths.sum()),
        "vocab_size": tokenizer.vocab_size,
        **{k: len(v) for k, v in split.items()},
    }


def base(recipe: Recipe, files: RunFiles, tools: TaskTools, out: Path) -> dict[str, Any]:
    """The dense base model on all training documents (or the recipe's base checkpoint)."""
    pm, d, file = tools.path_model, recipe.section(DipacoConfig), out / "model.pt"
    if d.base_checkpoint:
        from megatron_ext.dipaco.model.base import load_base_checkpoint

        weights = load_base_checkpoint(d.base_checkpoint, pm.init_state, pm.model)
        save_tensors(file, weights)
        return {"steps": 0, "from": d.base_checkpoint}
    stream = ShardStream(tools.dataset, files.split()["train"])
    assign_params(pm.model, pm.init_state)
    optimizer = InnerOptimizer(list(pm.model.named_parameters()), recipe.optimizer)
    schedule = lr_schedule(recipe.training, recipe.optimizer)
    steps = run_steps(recipe.training)  # training.steps, or what training.train_tokens takes
    batches = (stream.step_batch(recipe, STREAM_BASE, k) for k in range(steps))
    lrs = [schedule.lr_at(k) for k in range(steps)]
    checked = _checked(tools.check_lease, batches)
    losses = inner_steps(pm.model, optimizer, checked, lrs, lm_loss, "base")
    save_tensors(file, pm.state())
    return {"steps": steps, "loss_first": losses[0], "loss_last": losses[-1]}


def route(
    recipe: Recipe, files: RunFiles, tools: TaskTools, out: Path, phase: int
) -> dict[str, Any]:
    """Phase 0: base features, product k-means shards. Later: the discriminative re-shard."""
    d, layout, seed = recipe.section(DipacoConfig), files.layout, recipe.seed
    split = files.split()
    if phase == 0:
        from megatron_ext.dipaco.data.features import base_features

        pm = tools.path_model
        levels = [files.base_part(level) for level in range(layout.num_levels)]
        assign_params(pm.model, files.base_part(None), *levels)
        feats = base_features(pm, tools.dataset, split, recipe, tools.check_lease)
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
        feats = files.features()
        losses = np.stack(
            [
                load_arrays(files.done(score_id(phase - 1, p)) / "losses.npz")["losses"]
                for p in range(layout.num_paths)
            ],
            axis=1,
        )
        router = fit_discriminative(feats["router"], losses, max_iter=d.router_max_iter, seed=seed)
        routes = router.route(feats["train"], d.train_overlap)
    docs = shards(routes, split["train"], layout.num_paths)
    previous = files.shards(phase - 1) if phase > 0 else None
    # every path's early-stopping slice is drawn once, at phase 0, and kept through every
    # re-shard, so the losses early stopping compares are on the same documents (paper:
    # Sec. 2.7); a path never trains on its own slice
    if phase == 0:
        vals = [shard_split(s, d.val_fraction, seed, p, 0)[1] for p, s in enumerate(docs)]
    else:
        phase0 = files.shards(0)
        vals = [phase0[f"val_{p}"] for p in range(layout.num_paths)]
    docs = [np.setdiff1d(s, v) for s, v in zip(docs, vals, strict=True)]
    kept = [p for p, s in enumerate(docs) if len(s) == 0]
    if kept and previous is None:
        raise ConfigError(f"paths {kept} got empty shards; add text or use fewer paths")
    arrays, tokens = {}, []
    dataset = tools.dataset
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


def train(
    recipe: Recipe, files: RunFiles, tools: TaskTools, out: Path, phase: int, path: int
) -> dict[str, Any]:
    """τ inner steps of ``path`` from its modules' version ``phase``."""
    d, pm, layout, group = recipe.section(DipacoConfig), tools.path_model, files.layout, tools.group
    dataset = tools.dataset
    shard = files.shards(phase)
    stream = ShardStream(dataset, shard[f"train_{path}"])
    val = ShardStream(dataset, shard[f"val_{path}"])
    specific, opt_state, specific_momentum = files.path_state(phase, path)
    modules = [files.module(phase, m)[0] for m in layout.path_modules(path)]
    assign_params(pm.model, *modules, specific)
    val_before = _val_loss(pm.model, val, recipe.training.seq_length)
    optimizer = _inner_optimizer(recipe, pm.model, path)
    if opt_state is not None:
        optimizer.load_state_dict(opt_state)
    sched = inner_schedule(recipe.optimizer, d.phases, d.tau, d.inner_warmup_steps)
    steps = range(phase * d.tau, (phase + 1) * d.tau)
    batches = _checked(
        tools.check_lease,
        (stream.step_batch(recipe, STREAM_BATCH, path, phase, k) for k in steps),
    )
    where = f"train phase {phase} path {path}"
    lrs = [sched.lr_at(k) for k in steps]
    if d.inner == "spsa":
        losses = spsa_inner_steps(optimizer, batches, lrs, steps[0], phase, lm_loss, where)
    elif group.size > 1:
        losses = data_parallel_inner_steps(pm.model, optimizer, batches, lrs, lm_loss, group, where)
    else:
        losses = inner_steps(pm.model, optimizer, batches, lrs, lm_loss, where)
    if not group.leader:  # the leader writes and reports
        return {}
    parts = split_by_level(pm.state(), layout)
    for level in range(layout.num_levels):
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
        "ranks": group.size,
    }


def _inner_optimizer(recipe: Recipe, model: torch.nn.Module, path: int) -> Any:
    """The recipe's inner optimizer over ``model`` (gradient or zero-order)."""
    d, opt = recipe.section(DipacoConfig), recipe.optimizer
    if d.inner == "spsa":
        return SPSAInner(
            model,
            n_pert=d.spsa_n_pert,
            eps=d.spsa_eps,
            weight_decay=opt.weight_decay,
            betas=(opt.adam_beta1, opt.adam_beta2),
            seed=recipe.seed,
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


def outer(
    recipe: Recipe, files: RunFiles, tools: TaskTools, out: Path, phase: int, level: int, index: int
) -> dict[str, Any]:
    """The outer step of module (level, index) over the paths that used it in ``phase``."""
    from megatron_ext.dipaco.run.plan import train_id

    module, d = ModuleId(level, index), recipe.section(DipacoConfig)
    params, momentum = files.module(phase, module)
    users = files.layout.paths_of(module)
    tokens = {p: int(files.result(train_id(phase, p))["shard_tokens"]) for p in users}
    cfg = _outer_config(d)

    def load_path(p: int) -> dict[str, torch.Tensor]:
        tools.check_lease()
        return load_tensors(files.done(train_id(phase, p)) / f"l{level}.pt")

    new, new_momentum = outer_step(params, momentum, tokens, load_path, cfg)
    save_tensors(out / "module.pt", {"params": new, "momentum": new_momentum})
    size = sum(t.numel() * t.element_size() for t in new.values())
    return {"version": phase + 1, "paths": list(users), "module_bytes": size}


def score(
    recipe: Recipe, files: RunFiles, tools: TaskTools, out: Path, phase: int, path: int
) -> dict[str, Any]:
    """Path ``path`` at version ``phase + 1`` on every router document (mean loss after the
    prefix): the targets of the discriminative router."""
    parts, docs = files.composition(phase + 1, path), files.split()["router"]
    losses = _path_losses(tools, parts, docs, recipe.training.seq_length + 1)
    route_tokens = recipe.section(DipacoConfig).route_tokens
    save_arrays(out / "losses.npz", losses=_scored_mean(losses, route_tokens))
    return {"phase": phase, "path": path}


def _path_losses(
    tools: TaskTools, parts: list[dict[str, torch.Tensor]], docs: np.ndarray, max_tokens: int
) -> list:
    """Per-token losses of the path made of ``parts`` (:meth:`RunFiles.composition`) on
    ``docs``, each read to ``max_tokens``."""
    dataset, pm = tools.dataset, tools.path_model
    assign_params(pm.model, *parts)
    batch = document_batch(dataset, docs, max_tokens)
    return pm.token_losses(batch)


def final(
    recipe: Recipe, files: RunFiles, tools: TaskTools, out: Path, path: int
) -> dict[str, Any]:
    """Early stopping: the version with the lowest validation loss on the path's fixed
    early-stopping slice (drawn at phase 0, the same documents for every version); its
    per-token losses on the evaluation documents."""
    from megatron_ext.dipaco.run.plan import train_id

    d, model = recipe.section(DipacoConfig), tools.path_model.model
    history = [files.result(train_id(t, path))["val_before"] for t in range(d.phases)]
    val = ShardStream(tools.dataset, files.shards(d.phases - 1)[f"val_{path}"])
    assign_params(model, *files.composition(d.phases, path))
    history.append(_val_loss(model, val, recipe.training.seq_length))
    known = [(v, i) for i, v in enumerate(history) if v is not None]
    best = min(known)[1] if known else d.phases
    split = files.split()
    for name in ("eval", "router"):
        length = eval_tokens(recipe)  # router chunks train the W-routers
        losses = _path_losses(tools, files.composition(best, path), split[name], length)
        save_tensors(out / f"{name}_losses.pt", {"losses": losses})
    return {"path": path, "val": history, "best_version": best}
