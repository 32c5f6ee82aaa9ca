"""One pipeline stage of a GPT run's plan: its most loaded rank's memory and communication, the
mean rank's memory, the layer-wise plan's per-rank loads (:func:`plan_stage`), the activations
one micro-batch keeps (:func:`stage_activations`) and the model-parallel bytes a rank sends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from megatron_ext.config.schema import Recipe
from megatron_ext.optimizers.spec import optimizer_spec
from megatron_ext.planner.activations import ActivationShape, activation_bytes
from megatron_ext.planner.comm import CommFigures, data_parallel_bytes
from megatron_ext.planner.figures import RankLoads, StagePlan
from megatron_ext.planner.inputs import RunLayout, fused_attention, planned_model
from megatron_ext.planner.memory import rank_memory, state_bytes
from megatron_ext.planner.ownership import FP32, OptimizerLayout, domain_buckets, optimizer_layout
from megatron_ext.planner.params import (
    PlannedParam,
    gpt_parameters,
    moe_layer_pattern,
    padded_vocab_size,
    stage_layers,
)
from megatron_ext.planner.schedule import peak_held
from megatron_ext.run.precision import half_parameters

__all__ = ["plan_stage", "stage_activations"]


def _matrix_flops(p: PlannedParam, route: str, hp: dict[str, Any], tp: int, tp_mode: str) -> float:
    """One optimizer step of ``p`` (FLOPs): a TP shard is updated as the whole matrix in the
    ``duplicated`` mode (every TP rank does the whole matrix's work)."""
    spec = optimizer_spec(route)
    whole = spec.couples_matrix_entries and p.tensor_parallel and tp > 1 and tp_mode == "duplicated"
    shape = p.full_shape(tp) if whole else p.shape
    rows, cols = (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (1, shape[0])
    return spec.flops(rows, cols, hp.get(route, {}))


def _loads(
    params: Sequence[PlannedParam],
    layout: OptimizerLayout,
    expert: bool,
    *,
    bf16: bool,
    hp: dict[str, Any],
    tp: int,
    tp_mode: str,
    param_bytes: int,
) -> RankLoads | None:
    plan = layout.expert if expert else layout.dense
    if plan is None:
        return None
    world = plan.world
    out = RankLoads([0] * world, [0] * world, [0.0] * world, [0] * world)
    for p in params:
        if p.is_expert != expert or p.name in layout.sharded:
            continue  # element-sharded AdamW's ranges: not the layer-wise plan's
        rank = plan.owner[p.name]
        if rank == plan.REPLICATED:
            continue
        route = layout.routes[p.name]
        out.state_bytes[rank] += state_bytes(p, route, tp=tp, tp_mode=tp_mode)
        out.master_bytes[rank] += FP32 * p.numel if bf16 else 0
        out.flops[rank] += _matrix_flops(p, route, hp, tp, tp_mode)
    for domain_plan, buckets in domain_buckets(params, layout):
        if domain_plan is not plan:
            continue
        for b in buckets:
            for r in range(world):
                out.gather_bytes[r] += b.gather_bytes(r, param_bytes)[1]
    return out


def plan_stage(
    recipe: Recipe,
    lay: RunLayout,
    stage: int,
    vocab: int,
    hp: dict[str, Any],
) -> StagePlan:
    m, opt = planned_model(recipe), recipe.optimizer
    bf16 = half_parameters(recipe.training)
    param_bytes = 2 if bf16 else FP32
    params = gpt_parameters(m, recipe.parallel, vocab_size=vocab, pp_rank=stage, seq_length=lay.seq)
    layout = optimizer_layout(
        params, opt.name, hp, dp=lay.dp, edp=lay.edp, bf16=bf16, rules=opt.matrix_routing
    )
    kw = {"bf16": bf16, "hp": hp, "tp": lay.tp, "tp_mode": opt.tp_mode, "param_bytes": param_bytes}
    dense, expert = _loads(params, layout, False, **kw), _loads(params, layout, True, **kw)
    # the physical rank at (dense rank d, cp rank 0) is expert-data-parallel rank (d·cp) // ep
    has_expert = any(p.is_expert for p in params)
    # element-sharded AdamW: fp32 master (bf16 models) and two moments per element held
    shard_element_bytes = optimizer_spec("adamw").state_bytes(1, 1) + (FP32 if bf16 else 0)

    def shard_bytes(buckets: list[Any], rank: int) -> int:
        return shard_element_bytes * sum(b.counts[rank] for b in buckets)

    def load(d: int) -> int:
        total = shard_bytes(layout.dense_shards, d)
        if dense is not None:
            total += dense.state_bytes[d] + dense.master_bytes[d]
        e = d * lay.cp // lay.ep
        total += shard_bytes(layout.expert_shards, e) if has_expert else 0
        if expert is not None:
            total += expert.state_bytes[e] + expert.master_bytes[e]
        return total

    dense_rank = max(range(lay.dp), key=load)
    expert_rank = dense_rank * lay.cp // lay.ep if has_expert else 0
    # the forward passes the (interleaved) 1F1B schedule holds at once, each its chunk's bytes
    chunks = stage_activations(recipe, lay, stage, vocab)
    held, in_flight = peak_held(
        [kept for kept, _ in chunks], lay.pp, stage, lay.micro_batches, lay.vp_group
    )
    rebuild = max(rebuilt for _, rebuilt in chunks)
    memory = rank_memory(
        params,
        layout,
        dense_rank=dense_rank,
        expert_rank=expert_rank,
        bf16=bf16,
        activations=held + rebuild,
        tp=lay.tp,
        tp_mode=opt.tp_mode,
    )
    mean_static = float(memory.static)
    for loads, rank in ((dense, dense_rank), (expert, expert_rank)):
        if loads is not None:  # swap the chosen rank's owned share for the mean share
            own = loads.state_bytes[rank] + loads.master_bytes[rank]
            mean = (sum(loads.state_bytes) + sum(loads.master_bytes)) / loads.ranks
            mean_static += mean - own
    for buckets, rank in ((layout.dense_shards, dense_rank), (layout.expert_shards, expert_rank)):
        if buckets:  # and its element-sharded range for the mean range
            mean = shard_element_bytes * sum(b.numel for b in buckets) / len(buckets[0].counts)
            mean_static += mean - shard_bytes(buckets, rank)
    comm = data_parallel_bytes(
        params,
        layout,
        dense_rank=dense_rank,
        expert_rank=expert_rank,
        dp=lay.dp,
        edp=lay.edp,
        param_bytes=param_bytes,
    )
    _model_parallel_bytes(comm, m, lay, stage, param_bytes)
    held = layout.held(params, dense_rank, expert_rank)
    shard = layout.shard_elements(params, dense_rank, expert_rank)
    optimizer_flops = sum(
        _matrix_flops(p, layout.routes[p.name], hp, lay.tp, opt.tp_mode) for p in held
    ) + optimizer_spec("adamw").flops(1, sum(shard.values()), hp.get("adamw", {}))
    return StagePlan(
        stage=stage,
        params=sum(p.numel for p in params),
        memory=memory,
        mean_static=mean_static,
        comm=comm,
        dense=dense,
        expert=expert,
        optimizer_flops=optimizer_flops,
        in_flight=in_flight,
        dense_rank=dense_rank,
        expert_rank=expert_rank,
    )


def stage_activations(
    recipe: Recipe, lay: RunLayout, stage: int, vocab: int
) -> list[tuple[int, int]]:
    """Per model chunk of pipeline stage ``stage`` (one without virtual stages): (bytes one
    micro-batch keeps for backward, bytes recomputation rebuilds at a time),
    :func:`~.activations.activation_bytes` at the run's sizes."""
    m = planned_model(recipe)
    shape = ActivationShape(
        seq=lay.seq,
        micro_batch=lay.micro_batch,
        tp=lay.tp,
        cp=lay.cp,
        ep=lay.ep,
        sequence_parallel=lay.sequence_parallel,
        element_bytes=2 if half_parameters(recipe.training) else FP32,
        fused_attention=fused_attention(recipe),
        recompute=lay.recompute,
        recompute_method=lay.recompute_method,
        recompute_num_layers=lay.recompute_num_layers,
    )
    return [
        activation_bytes(
            m,
            shape,
            stage_layers(m, lay.pp, stage, v, lay.vp),
            first_stage=stage == 0 and v == 0,
            last_stage=stage == lay.pp - 1 and v == lay.vp - 1,
            vocab=padded_vocab_size(vocab, m.make_vocab_size_divisible_by, lay.tp),
        )
        for v in range(lay.vp)
    ]


def _model_parallel_bytes(
    comm: CommFigures, m: Any, lay: RunLayout, stage: int, element_bytes: int
) -> None:
    """TP/SP, EP and PP bytes one rank sends per step (the same amount is received).

    TP: per layer and micro-batch, forward and backward, two collectives over a
    ``tokens × hidden`` tensor (all-gather + reduce-scatter with SP, all-reduce without: the same
    ring bytes, ``2·(tp−1)/tp`` of it per all-reduce), so ``4 · 2·(tp−1)/tp · t·h·e`` per layer
    and micro-batch (full recomputation repeats the forward's two in the layers it recomputes).
    EP: dispatch and combine all-to-alls, forward and backward, of ``t·topk`` token copies of
    which ``(ep−1)/ep`` leave the rank (uniform routing). PP: one activation out and one gradient
    back per micro-batch at each boundary the stage touches."""
    t = lay.seq * lay.micro_batch // lay.cp
    h = m.hidden_size
    chunks = [stage_layers(m, lay.pp, stage, v, lay.vp) for v in range(lay.vp)]
    layers = [i for chunk in chunks for i in chunk]
    micro = lay.micro_batches
    if lay.tp > 1:
        per_collective = 2 * (lay.tp - 1) * t * h * element_bytes // lay.tp
        recomputed = sum(lay.recomputed_layers(len(chunk)) for chunk in chunks)
        collectives = 4 * len(layers) + 2 * recomputed
        tp_bytes = collectives * per_collective * micro
        comm.tensor_parallel = (tp_bytes, tp_bytes)
    if m.num_moe_experts and lay.ep > 1:
        pattern = moe_layer_pattern(m)
        moe_layers = sum(1 for i in layers if pattern[i])
        copies = t * m.moe_router_topk * (lay.ep - 1) // lay.ep
        ep_bytes = 4 * copies * h * element_bytes * moe_layers * micro
        comm.expert_all_to_all = (ep_bytes, ep_bytes)
    if lay.pp > 1:  # each chunk's, model stage v·pp + stage of pp·vp
        stages = lay.pp * lay.vp
        boundaries = sum(
            (s > 0) + (s < stages - 1) for s in (v * lay.pp + stage for v in range(lay.vp))
        )
        shard = lay.tp if lay.sequence_parallel else 1
        pp_bytes = boundaries * t * h * element_bytes // shard * micro
        comm.pipeline = (pp_bytes, pp_bytes)
