"""DiPaCo trained fully synchronously: the paper's ablation of DiLoCo (Sec. 4.5).

"All paths compute gradients on their own data shards, then gradients are aggregated
module-by-module, and a single AdamW step is taken with the aggregated gradient." Per step k
(k = 0 .. phases·τ − 1), with the same batches the DiPaCo train tasks draw (path p's step k of
phase t is key (path, t, k mod τ) of the batch stream) and the same learning rate schedule:

    g_p        = ∇ loss of path p on its batch, at the current global modules + its own parts
    g_(l,e)    = Σ_{p uses (l,e)} α_p g_p[(l,e)]      α_p = |D_p| / Σ |D_q| (shard tokens)
    (l, e)    ← InnerOpt_(l,e)(g_(l,e))               one optimizer (state, clipping) per module
    own_p     ← InnerOpt_p(g_p[own])                  path-specific parts: their own gradient

No outer step, no momentum across phases: the modules are synchronised every step (what DDP
would do per module). Runs in one process over what the run's finished ``prepare``/``base``/
``route`` tasks left (the base model and the phase-0 shards), without the task queue.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from megatron_ext.dipaco.data.documents import STREAM_BATCH, ShardStream
from megatron_ext.dipaco.model.layout import ModuleId
from megatron_ext.dipaco.model.parts import assign_params, module_names
from megatron_ext.dipaco.model.path_model import lm_loss
from megatron_ext.dipaco.recipe import DipacoConfig, path_layout
from megatron_ext.dipaco.steps.inner import InnerOptimizer, inner_schedule
from megatron_ext.errors import TrainingDivergedError

if TYPE_CHECKING:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from megatron_ext.config.schema import Recipe

__all__ = ["full_sync_train"]

Params = dict[str, torch.Tensor]


def _holder(params: Params) -> dict[str, torch.nn.Parameter]:
    """Trainable copies of ``params`` (the optimizer's own tensors)."""
    return {n: torch.nn.Parameter(t.detach().clone()) for n, t in params.items()}


def full_sync_train(
    recipe: Recipe,
    model: torch.nn.Module,
    dataset: IndexedDataset,
    shards: dict[str, np.ndarray],
    base: Mapping[int | None, Params],
    check: Callable[[], None],
) -> tuple[dict[ModuleId, Params], dict[int, Params]]:
    """Train the paths of ``recipe`` fully synchronously for ``phases · τ`` steps from the base
    model (``base``: its parameters by level, None: the path-specific ones) on the phase-0
    shards (``shards``: ``train_<p>`` document ids of ``dataset``), with ``model`` (a GPTModel
    of the recipe) computing every path's gradient; ``check`` is called before each step (it
    raises to stop). Returns (each module's parameters, each path's own parameters)."""
    d, layout = recipe.section(DipacoConfig), path_layout(recipe)
    streams = [ShardStream(dataset, shards[f"train_{p}"]) for p in range(layout.num_paths)]
    modules = {m: _holder(base[m.level]) for m in layout.modules}
    own = {p: _holder(base[None]) for p in range(layout.num_paths)}
    opt = recipe.optimizer
    module_opt = {m: InnerOptimizer(list(modules[m].items()), opt) for m in modules if modules[m]}
    own_opt = {p: InnerOptimizer(list(own[p].items()), opt) for p in own if own[p]}
    sched = inner_schedule(opt, d.phases, d.tau, d.inner_warmup_steps)
    names = module_names(dict(model.named_parameters()), layout)
    for step in range(d.phases * d.tau):
        check()
        phase, k = divmod(step, d.tau)
        grads: dict[int, Params] = {}
        for p, stream in enumerate(streams):
            assign_params(model, *(modules[m] for m in layout.path_modules(p)), own[p])
            model.train()
            model.zero_grad(set_to_none=True)
            micro = stream.step_batch(recipe, STREAM_BATCH, p, phase, k)
            value = 0.0
            for part in micro:
                loss = lm_loss(model, part) / len(micro)
                loss.backward()
                value += float(loss.detach())
            if not torch.isfinite(torch.tensor(value)):
                raise TrainingDivergedError(
                    f"full-sync step {step} path {p}: loss is {value}", on_every_rank=False
                )
            grads[p] = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
        lr = sched.lr_at(step)
        for m, opt_m in module_opt.items():
            users = layout.paths_of(m)
            total = sum(streams[p].tokens for p in users)
            for n, q in modules[m].items():
                q.grad = sum(streams[p].tokens / total * grads[p][n] for p in users)
            opt_m.step(lr)
        for p, opt_p in own_opt.items():
            for n in names.get(None, []):
                own[p][n].grad = grads[p][n]
            opt_p.step(lr)
    detach = lambda h: {n: q.detach().clone() for n, q in h.items()}  # noqa: E731
    return {m: detach(h) for m, h in modules.items()}, {p: detach(h) for p, h in own.items()}
