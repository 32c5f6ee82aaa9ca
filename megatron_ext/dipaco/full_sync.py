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
would do per module). Runs in one process over the run's finished ``prepare``/``base``/
``route`` tasks (their split, base model and phase-0 shards), without the task queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from megatron_ext.dipaco.data import STREAM_BATCH, ShardStream
from megatron_ext.dipaco.inner import InnerOptimizer, inner_schedule
from megatron_ext.dipaco.layout import ModuleId
from megatron_ext.dipaco.model import lm_loss
from megatron_ext.dipaco.store import assign_params, module_names
from megatron_ext.errors import TrainingDivergedError

if TYPE_CHECKING:
    from megatron_ext.dipaco.context import TaskContext

__all__ = ["full_sync_train"]

Params = dict[str, torch.Tensor]


def _holder(params: Params) -> dict[str, torch.nn.Parameter]:
    """Trainable copies of ``params`` (the optimizer's own tensors)."""
    return {n: torch.nn.Parameter(t.detach().clone()) for n, t in params.items()}


def full_sync_train(ctx: TaskContext) -> tuple[dict[ModuleId, Params], dict[int, Params]]:
    """Train the run's paths fully synchronously for ``phases · τ`` steps from the base model
    on the phase-0 shards; returns (each module's parameters, each path's own parameters)."""
    d, layout, recipe = ctx.d, ctx.layout, ctx.recipe
    _, dataset = ctx.corpus
    shards = ctx.shards(0)
    streams = [ShardStream(dataset, shards[f"train_{p}"]) for p in range(layout.num_paths)]
    modules = {m: _holder(ctx.base_part(m.level)) for m in layout.modules}
    own = {p: _holder(ctx.base_part(None)) for p in range(layout.num_paths)}
    opt = recipe.optimizer
    module_opt = {m: InnerOptimizer(list(modules[m].items()), opt) for m in modules if modules[m]}
    own_opt = {p: InnerOptimizer(list(own[p].items()), opt) for p in own if own[p]}
    sched = inner_schedule(opt, d.phases, d.tau, d.inner_warmup_steps)
    model = ctx.path_model.model
    names = module_names(dict(model.named_parameters()), layout)
    for step in range(d.phases * d.tau):
        ctx.check_lease()
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
