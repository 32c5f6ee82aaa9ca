"""Bytes one rank holds during a GPT run, term by term, as this project's GPT trainer lays them out.

- **parameters**: the rank's shards (:func:`~.params.gpt_parameters`) in the model dtype (bf16
  for every precision but fp32: megatron-core's ``Float16Module``);
- **gradients**: megatron-core DDP's ``main_grad`` buffer, fp32 (the trainer sets
  ``grad_reduce_in_fp32=True``), one element per parameter element;
- **masters**: fp32 copies of bf16 parameters where this rank updates them — its element
  ranges of the AdamW-routed parameters (every parameter for plain AdamW: ZeRO-1,
  :class:`~megatron_ext.distributed.sharded_adam.ShardedAdamW`), the owned and the replicated
  matrices under the layer-wise plan (:class:`~megatron_ext.distributed.layerwise.
  LayerwiseOptimizer`);
- **optimizer state**: each held parameter's optimizer spec (``state_bytes``: AdamW's two
  moments over this rank's ranges, Muon's momentum, KL-SOAP's factors, eigenbases and
  moments, ...), by optimizer;
- **activations**: what one micro-batch keeps for backward, times the micro-batches in flight
  (1F1B: ``pp - stage`` on stage ``stage``), see :mod:`.activations`;
- **transient**: the largest short-lived buffer: the all-gather buffers of the layer-wise and
  the element-sharded buckets (every bucket is launched at the end of the step and freed in
  the next forward, so all are alive at once), a reduce-scatter-v bucket's send and receive
  buffers, the matrix optimizer's workspace on its largest matrix, or an element-wise
  optimizer's update temporaries: AdamW (``foreach``) and Lion step each parameter group with
  torch's foreach kernels, which allocate one fp32 element per element of the group at once
  (AdamW's ``√v``, Lion's interpolated update) — this rank's ranges for the element-sharded
  AdamW, a bucket's owned share under the layer-wise optimizer.

The peak is ``static + max(activations, transient)``: the gather buffers are released as the
forward that builds the activations reaches each bucket.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.optimizers.routing import decays_weight
from megatron_ext.optimizers.spec import optimizer_spec
from megatron_ext.planner.ownership import FP32, OptimizerLayout, domain_buckets, matrices
from megatron_ext.planner.params import PlannedParam

__all__ = ["MemoryFigures", "rank_memory", "state_bytes"]


def state_bytes(p: PlannedParam, route: str, *, tp: int = 1, tp_mode: str = "duplicated") -> int:
    """Optimizer state of ``p`` (bytes) under ``route``: of the shard's shape, or of the whole
    matrix's where the optimizer keeps it for a TP shard (``full_state_tp_modes``)."""
    spec = optimizer_spec(route)
    full = p.tensor_parallel and tp > 1 and tp_mode in spec.full_state_tp_modes
    count, rows, cols = matrices(p.full_shape(tp) if full else p.shape)
    return count * spec.state_bytes(rows, cols)


@dataclass
class MemoryFigures:
    """Bytes on one rank (see the module docstring)."""

    parameters: int
    gradients: int
    masters: int
    optimizer_state: dict[str, int]  # by optimizer name
    activations: int
    transient: int
    transient_what: str
    notes: list[str] = field(default_factory=list)

    @property
    def static(self) -> int:
        return self.parameters + self.gradients + self.masters + sum(self.optimizer_state.values())

    @property
    def peak(self) -> int:
        return self.static + max(self.activations, self.transient)

    def as_dict(self) -> dict[str, Any]:
        return {
            "parameters": self.parameters,
            "gradients": self.gradients,
            "masters": self.masters,
            "optimizer_state": dict(self.optimizer_state),
            "optimizer_state_total": sum(self.optimizer_state.values()),
            "activations": self.activations,
            "transient": self.transient,
            "transient_what": self.transient_what,
            "static": self.static,
            "peak": self.peak,
        }


def rank_memory(
    params: Sequence[PlannedParam],
    layout: OptimizerLayout,
    *,
    dense_rank: int,
    expert_rank: int,
    bf16: bool,
    activations: int,
    tp: int = 1,
    tp_mode: str = "duplicated",
) -> MemoryFigures:
    """One rank's bytes: ``params`` are its shards (one pipeline stage, one TP rank);
    ``tp_mode`` is ``optimizer.tp_mode``."""
    param_bytes = 2 if bf16 else FP32
    numel = sum(p.numel for p in params)
    held = layout.held(params, dense_rank, expert_rank)
    state: dict[str, int] = {}
    for p in held:
        route = layout.routes[p.name]
        state[route] = state.get(route, 0) + state_bytes(p, route, tp=tp, tp_mode=tp_mode)
    shard = layout.shard_elements(params, dense_rank, expert_rank)
    if shard:  # element-sharded AdamW: its moments over this rank's ranges
        state["adamw"] = state.get("adamw", 0) + optimizer_spec("adamw").state_bytes(
            1, sum(shard.values())
        )
    masters = FP32 * (sum(p.numel for p in held) + sum(shard.values())) if bf16 else 0
    transient, what = _largest_transient(
        params, layout, held, dense_rank, expert_rank, param_bytes, tp, tp_mode
    )
    return MemoryFigures(
        parameters=numel * param_bytes,
        gradients=numel * FP32,
        masters=masters,
        optimizer_state=state,
        activations=activations,
        transient=transient,
        transient_what=what,
    )


def _largest_transient(
    params: Sequence[PlannedParam],
    layout: OptimizerLayout,
    held: Sequence[PlannedParam],
    dense_rank: int,
    expert_rank: int,
    param_bytes: int,
    tp: int,
    tp_mode: str,
) -> tuple[int, str]:
    candidates: list[tuple[int, str]] = [(0, "none")]
    domains = domain_buckets(params, layout)
    ranked = [
        (b, expert_rank if plan is layout.expert else dense_rank)
        for plan, bs in domains
        for b in bs
    ]
    # element-sharded AdamW: its buckets move only between two or more ranks
    for bs, rank in ((layout.dense_shards, dense_rank), (layout.expert_shards, expert_rank)):
        ranked += [(b, rank) for b in bs if len(b.counts) > 1]
    if ranked:
        gathered = sum(b.numel for b, _ in ranked) * param_bytes
        candidates.append((gathered, f"all-gather-v buffers of {len(ranked)} buckets"))
    for b, rank in ranked:  # send, receive, and the summed segment of one bucket
        own = b.counts[rank]
        rs = FP32 * (sum(b.counts) + len(b.counts) * own + own)
        candidates.append((rs, "a reduce-scatter-v bucket's buffers"))
    for p in held:
        route = layout.routes[p.name]
        if optimizer_spec(route).couples_matrix_entries:
            gathered = p.tensor_parallel and tp > 1 and tp_mode == "duplicated"
            _, rows, cols = matrices(p.full_shape(tp) if gathered else p.shape)
            small = min(rows, cols)
            # iterate, its Gram matrix and the polynomial's product (Newton–Schulz), or the
            # rotated gradient and the QR workspace (KL-SOAP): about this many fp32 elements
            work = FP32 * (3 * rows * cols + 2 * small * small)
            candidates.append((work, f"{route} workspace on {p.name} {rows}x{cols}"))
    for route, numel in _elementwise_groups(params, layout, dense_rank, expert_rank):
        candidates.append((FP32 * numel, f"{route} update temporaries over {numel:,} elements"))
    return max(candidates, key=lambda c: c[0])


def _elementwise_groups(
    params: Sequence[PlannedParam], layout: OptimizerLayout, dense_rank: int, expert_rank: int
) -> list[tuple[str, int]]:
    """(route, elements) of every element-wise optimizer parameter group stepped on this rank:
    under the layer-wise optimizer one torch optimizer per route over the replicated
    parameters of each domain and one per route over this rank's share of each bucket; the
    element-sharded AdamW one per domain over this rank's ranges; each split into weight-decay
    groups (``weight_decay_groups``)."""
    by_name = {p.name: p for p in params}
    steps: list[list[tuple[PlannedParam, int]]] = []
    for plan, buckets in domain_buckets(params, layout):
        rank = expert_rank if plan is layout.expert else dense_rank
        steps.append([(by_name[n], by_name[n].numel) for n in plan.replicated if n in by_name])
        steps += [
            [(by_name[n], by_name[n].numel) for n in b.members if plan.owner[n] == rank]
            for b in buckets
        ]
    shard = layout.shard_elements(params, dense_rank, expert_rank)
    for expert in (False, True):
        steps.append(
            [(p, shard[p.name]) for p in params if p.is_expert == expert and shard.get(p.name)]
        )
    out = []
    for members in steps:
        routes: dict[str, list[tuple[PlannedParam, int]]] = {}
        for p, numel in members:
            routes.setdefault(layout.routes[p.name], []).append((p, numel))
        for route, group in routes.items():
            if optimizer_spec(route).couples_matrix_entries:
                continue
            for decays in (True, False):
                numel = sum(k for p, k in group if decays_weight(p.name, p.shape) == decays)
                if numel:
                    out.append((route, numel))
    return out
