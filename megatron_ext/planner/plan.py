"""A GPT run's plan on a cluster: per rank, memory, communication and step time, and whether it
fits — computed from the recipe alone (torch-free, seconds), with the trainer's own functions
for the parameters (:mod:`.params`), the optimizer routes and the layer-wise ownership plan
(:mod:`.ownership`).

:func:`plan_run` is the whole computation; :mod:`.report` renders it; :func:`first_fix` finds the
first single change that makes a layout that does not fit fit. Where the figures rest on an
assumption (an MFU, link bandwidths, a runtime reserve), the plan carries it in ``assumptions``
so the report prints it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from megatron_ext.config.load import read_recipe
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import get_trainer
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.flops import gpt_train_flops_per_token
from megatron_ext.optimizers.spec import optimizer_spec, recipe_hyperparameters
from megatron_ext.planner.activations import ActivationShape, activation_bytes
from megatron_ext.planner.baselines import matrix_routed, routed_specs, scheme_loads
from megatron_ext.planner.comm import CommFigures, data_parallel_bytes
from megatron_ext.planner.gpus import DEFAULT_MFU, DEFAULT_RESERVE_BYTES, GpuSpec
from megatron_ext.planner.mcore_layout import default_bucket_size
from megatron_ext.planner.memory import MemoryFigures, rank_memory, state_bytes
from megatron_ext.planner.ownership import FP32, OptimizerLayout, domain_buckets, optimizer_layout
from megatron_ext.planner.params import (
    PlannedParam,
    default_ffn_hidden_size,
    gpt_parameters,
    moe_layer_pattern,
    padded_vocab_size,
    stage_layers,
)
from megatron_ext.planner.steptime import StepTime, step_time
from megatron_ext.run.precision import precision_spec

__all__ = [
    "BYTE_VOCAB",
    "Cluster",
    "Plan",
    "RankLoads",
    "RunLayout",
    "StagePlan",
    "first_fix",
    "plan_recipe",
    "plan_run",
    "plan_vocab_size",
    "stage_activations",
]

#: the byte tokenizer's vocabulary (megatron_ext.data.tokenizers.ByteTokenizer.vocab_size)
BYTE_VOCAB = 258


@dataclass(frozen=True)
class Cluster:
    """The machines: ``nodes × gpus_per_node`` GPUs of one kind."""

    gpu: GpuSpec
    nodes: int
    gpus_per_node: int
    reserve_bytes: int = DEFAULT_RESERVE_BYTES

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class RunLayout:
    """The parallel layout and batch of the run (sizes in ranks, sequences and tokens)."""

    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    edp: int  # expert data parallel: dp·cp/ep (expert TP = TP)
    sequence_parallel: bool
    recompute: str
    micro_batch: int
    global_batch: int
    seq: int

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank per step (the gradient-accumulation count)."""
        return self.global_batch // (self.micro_batch * self.dp)

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "micro_batches": self.micro_batches}


@dataclass
class RankLoads:
    """Per data-parallel rank of one domain (dense or experts): what the layer-wise plan gives
    it to update beyond the replicated parameters (bytes, FLOPs per step)."""

    state_bytes: list[int]
    master_bytes: list[int]
    flops: list[float]
    gather_bytes: list[int]  # all-gather-v bytes received per step

    @property
    def ranks(self) -> int:
        return len(self.state_bytes)

    def imbalance(self, values: Sequence[float]) -> float:
        """max / mean (1 = perfectly balanced; 0 work anywhere counts as balanced)."""
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ranks": self.ranks}
        for key in ("state_bytes", "master_bytes", "flops", "gather_bytes"):
            values = getattr(self, key)
            out[key] = {
                "max": max(values),
                "mean": sum(values) / len(values),
                "imbalance": self.imbalance(values),
            }
        return out


@dataclass
class StagePlan:
    """One pipeline stage: its most loaded rank's memory and communication, the mean rank's
    memory, and the per-rank loads of the layer-wise plan."""

    stage: int
    params: int  # elements on one rank of the stage
    memory: MemoryFigures  # the most loaded rank
    mean_static: float  # the mean rank's static bytes
    comm: CommFigures
    dense: RankLoads | None
    expert: RankLoads | None
    optimizer_flops: float  # the most loaded rank's optimizer step
    in_flight: int  # micro-batches whose activations are alive at once (1F1B)
    dense_rank: int  # the most loaded rank's ranks in the dense / expert domains
    expert_rank: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "params": self.params,
            "most_loaded_rank": {"dense": self.dense_rank, "expert": self.expert_rank},
            "memory": self.memory.as_dict(),
            "mean_static": self.mean_static,
            "comm": self.comm.as_dict(),
            "optimizer_flops": self.optimizer_flops,
            "micro_batches_in_flight": self.in_flight,
            "layerwise_dense": self.dense.as_dict() if self.dense else None,
            "layerwise_expert": self.expert.as_dict() if self.expert else None,
        }


@dataclass
class Plan:
    """The whole plan (see the module docstring)."""

    recipe: str
    cluster: Cluster
    layout: RunLayout
    optimizer: str
    precision: str
    vocab: int
    total_params: int  # elements of the whole model
    stages: list[StagePlan]
    step: StepTime
    tokens_per_step: int
    train_tokens: int
    model_flops_per_rank: float
    assumptions: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    baselines: dict[str, Any] = field(default_factory=dict)
    fix: str | None = None  # the first change that makes it fit, when it does not

    @property
    def worst(self) -> StagePlan:
        """The stage whose most loaded rank peaks highest."""
        return max(self.stages, key=lambda s: s.memory.peak)

    @property
    def usable_bytes(self) -> int:
        return self.cluster.gpu.memory_bytes - self.cluster.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.worst.memory.peak <= self.usable_bytes

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step.total_s

    @property
    def time_to_budget_s(self) -> float:
        return self.train_tokens / self.tokens_per_second

    def as_dict(self) -> dict[str, Any]:
        gpu = self.cluster.gpu
        return {
            "recipe": self.recipe,
            "cluster": {
                "gpu": gpu.kind,
                "gpu_name": gpu.name,
                "nodes": self.cluster.nodes,
                "gpus_per_node": self.cluster.gpus_per_node,
                "world": self.cluster.world,
                "gpu_memory_bytes": gpu.memory_bytes,
                "reserve_bytes": self.cluster.reserve_bytes,
            },
            "layout": self.layout.as_dict(),
            "optimizer": self.optimizer,
            "precision": self.precision,
            "vocab_size": self.vocab,
            "total_params": self.total_params,
            "stages": [s.as_dict() for s in self.stages],
            "worst_stage": self.worst.stage,
            "peak_bytes": self.worst.memory.peak,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "fix": self.fix,
            "step": self.step.as_dict(),
            "model_flops_per_rank": self.model_flops_per_rank,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
            "train_tokens": self.train_tokens,
            "time_to_budget_s": self.time_to_budget_s,
            "baselines": self.baselines,
            "assumptions": self.assumptions,
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------- inputs


def plan_vocab_size(recipe: Recipe) -> int:
    """The vocabulary the model is built with (before padding): ``model.vocab_size``, else the
    tokenizer's, read without torch; a tokenizer file that cannot be read is refused."""
    m, data = recipe.model, recipe.data
    if m.vocab_size:
        return int(m.vocab_size)
    if data.tokenizer == "byte":
        return BYTE_VOCAB
    path = Path(data.tokenizer_model)
    if data.tokenizer == "sentencepiece" and path.is_file():
        import sentencepiece

        return int(sentencepiece.SentencePieceProcessor(model_file=str(path)).vocab_size())
    raise ConfigError(
        f"model.vocab_size is unset and the {data.tokenizer} tokenizer at "
        f"data.tokenizer_model={str(path)!r} cannot be read here: pass model.vocab_size=N "
        "(the tokenizer's vocabulary, e.g. 128256 for Llama-3's)"
    )


def run_layout(recipe: Recipe, world: int) -> RunLayout:
    """The layout at ``world`` ranks, after the recipe's own checks at that size."""
    recipe.check(world_size=world)
    p, t = recipe.parallel, recipe.training
    tp, pp, cp, ep = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
        p.expert_model_parallel_size,
    )
    dp = world // (tp * pp * cp)
    return RunLayout(
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        dp=dp,
        edp=dp * cp // ep,
        sequence_parallel=p.sequence_parallel,
        recompute=p.recompute_granularity,
        micro_batch=t.micro_batch_size,
        global_batch=t.global_batch_size,
        seq=t.seq_length,
    )


def planned_model(recipe: Recipe) -> Any:
    """The model section the parameters are listed for: a ``transformer_engine`` model is
    listed with the local spec's names (Transformer Engine moves each norm's weight into the
    following linear, ``linear_qkv.layer_norm_weight``: the same elements, the same routes)."""
    m = recipe.model
    return replace(m, transformer_impl="local") if m.transformer_impl == "transformer_engine" else m


def fused_attention(recipe: Recipe) -> bool:
    """Whether the cluster run's layers are Transformer Engine's (fused attention, norms fused
    into the next linear): ``auto`` and ``transformer_engine`` use TE (the NGC container has
    it); ``local`` is megatron-core's local spec with SDPA core attention (what a CPU runs)."""
    return recipe.model.transformer_impl != "local"


# --------------------------------------------------------------------------- per stage


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


def _stage(
    recipe: Recipe,
    lay: RunLayout,
    stage: int,
    vocab: int,
    hp: dict[str, Any],
) -> StagePlan:
    m, opt = planned_model(recipe), recipe.optimizer
    bf16 = precision_spec(recipe.training.precision).half
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
    kept, rebuild = stage_activations(recipe, lay, stage, vocab)
    in_flight = min(lay.pp - stage, lay.micro_batches)
    memory = rank_memory(
        params,
        layout,
        dense_rank=dense_rank,
        expert_rank=expert_rank,
        bf16=bf16,
        activations=kept * in_flight + rebuild,
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


def stage_activations(recipe: Recipe, lay: RunLayout, stage: int, vocab: int) -> tuple[int, int]:
    """(bytes one micro-batch keeps for backward on ``stage``, bytes recomputation rebuilds at
    a time), :func:`~.activations.activation_bytes` at the run's sizes."""
    m = planned_model(recipe)
    shape = ActivationShape(
        seq=lay.seq,
        micro_batch=lay.micro_batch,
        tp=lay.tp,
        cp=lay.cp,
        ep=lay.ep,
        sequence_parallel=lay.sequence_parallel,
        element_bytes=2 if precision_spec(recipe.training.precision).half else FP32,
        fused_attention=fused_attention(recipe),
        recompute=lay.recompute,
    )
    return activation_bytes(
        m,
        shape,
        stage_layers(m.num_layers, lay.pp, stage),
        first_stage=stage == 0,
        last_stage=stage == lay.pp - 1,
        vocab=padded_vocab_size(vocab, m.make_vocab_size_divisible_by, lay.tp),
    )


def _model_parallel_bytes(
    comm: CommFigures, m: Any, lay: RunLayout, stage: int, element_bytes: int
) -> None:
    """TP/SP, EP and PP bytes one rank sends per step (the same amount is received).

    TP: per layer and micro-batch, forward and backward, two collectives over a
    ``tokens × hidden`` tensor (all-gather + reduce-scatter with SP, all-reduce without: the same
    ring bytes, ``2·(tp−1)/tp`` of it per all-reduce), so ``4 · 2·(tp−1)/tp · t·h·e`` per layer
    and micro-batch (full recomputation repeats the forward's two). EP: dispatch and combine
    all-to-alls, forward and backward, of ``t·topk`` token copies of which ``(ep−1)/ep`` leave
    the rank (uniform routing). PP: one activation out and one gradient back per micro-batch at
    each boundary the stage touches."""
    t = lay.seq * lay.micro_batch // lay.cp
    h = m.hidden_size
    layers = stage_layers(m.num_layers, lay.pp, stage)
    micro = lay.micro_batches
    if lay.tp > 1:
        per_collective = 2 * (lay.tp - 1) * t * h * element_bytes // lay.tp
        collectives = 4 + (2 if lay.recompute == "full" else 0)
        tp_bytes = collectives * per_collective * len(layers) * micro
        comm.tensor_parallel = (tp_bytes, tp_bytes)
    if m.num_moe_experts and lay.ep > 1:
        pattern = moe_layer_pattern(m)
        moe_layers = sum(1 for i in layers if pattern[i])
        copies = t * m.moe_router_topk * (lay.ep - 1) // lay.ep
        ep_bytes = 4 * copies * h * element_bytes * moe_layers * micro
        comm.expert_all_to_all = (ep_bytes, ep_bytes)
    if lay.pp > 1:
        boundaries = (stage > 0) + (stage < lay.pp - 1)
        shard = lay.tp if lay.sequence_parallel else 1
        pp_bytes = boundaries * t * h * element_bytes // shard * micro
        comm.pipeline = (pp_bytes, pp_bytes)


# --------------------------------------------------------------------------- the plan


def _links(cluster: Cluster, lay: RunLayout) -> dict[str, float]:
    """GB/s each group runs at: NVLink while the group's ranks stay inside one NVLink domain
    (megatron-core's order tp, cp, ep/dp, pp: a group's span is its size times its stride)."""
    gpu = cluster.gpu
    domain = min(gpu.nvlink_domain, cluster.world)

    def bw(span: int) -> float:
        return gpu.nvlink_gbps if span <= domain else gpu.network_gbps

    return {
        "tensor_parallel": bw(lay.tp),
        "expert": bw(lay.tp * lay.ep),
        "data_parallel": bw(lay.tp * lay.cp * lay.dp),
        "expert_data_parallel": bw(lay.tp * lay.cp * lay.dp),
        "pipeline": bw(lay.tp * lay.cp * lay.dp * 2) if lay.pp > 1 else gpu.nvlink_gbps,
    }


def plan_run(
    recipe: Recipe,
    cluster: Cluster,
    *,
    name: str = "",
    mfu: float = DEFAULT_MFU,
    baselines: bool = True,
) -> Plan:
    """The plan of ``recipe`` (a GPT recipe, overrides applied) on ``cluster``, without
    :func:`first_fix` (see :func:`plan_recipe`); ``baselines``: also megatron-core's layer-wise
    and ZeRO-1 assignments (:func:`layerwise_baselines`)."""
    if get_trainer(recipe.trainer).plan != "memory":
        raise ConfigError(
            f"megatron-ext plan plans GPT runs; {name or 'this recipe'} is trainer="
            f"{recipe.trainer} (its outer-step bytes: `megatron-ext dipaco` / `soma` reports)"
        )
    if not 0 < mfu <= 1:
        raise ConfigError(f"--mfu {mfu}: give the fraction of the GPU's peak, in (0, 1]")
    lay = run_layout(recipe, cluster.world)
    vocab = plan_vocab_size(recipe)
    hp = recipe_hyperparameters(recipe.optimizer)
    stages = [_stage(recipe, lay, s, vocab, hp) for s in range(lay.pp)]
    m = recipe.model
    total = _total_params(recipe, vocab, lay)
    kv = m.kv_channels or m.hidden_size // m.num_attention_heads
    per_token = gpt_train_flops_per_token(
        m,
        lay.seq,
        padded_vocab_size(vocab, m.make_vocab_size_divisible_by, 1),
        default_ffn_hidden_size(m),
        kv,
    )
    per_token *= _recompute_factor(m, lay, kv)
    tokens = lay.global_batch * lay.seq
    model_flops = per_token * tokens / cluster.world
    worst = max(stages, key=lambda s: s.memory.peak)
    links = _links(cluster, lay)
    c = worst.comm
    # a collective lasts as long as its larger direction (the reduce-scatter-v's owner receives
    # world - 1 copies of its segment)
    exposed = {
        name: (max(getattr(c, name)), links[link])
        for name, link in (
            ("tensor_parallel", "tensor_parallel"),
            ("expert_all_to_all", "expert"),
            ("pipeline", "pipeline"),
            ("grad_reduce_scatter", "data_parallel"),
            ("replicated_all_reduce", "data_parallel"),
            ("ddp_all_reduce", "data_parallel"),
        )
    }
    step = step_time(
        model_flops=model_flops,
        optimizer_flops=max(s.optimizer_flops for s in stages),
        peak_tflops=cluster.gpu.bf16_tflops,
        mfu=mfu,
        pp=lay.pp,
        micro_batches=lay.micro_batches,
        comm_exposed=exposed,
        gather=(c.param_all_gather[1], links["data_parallel"]),
    )
    t = recipe.training
    plan = Plan(
        recipe=name,
        cluster=cluster,
        layout=lay,
        optimizer=recipe.optimizer.name,
        precision=t.precision,
        vocab=vocab,
        total_params=total,
        stages=stages,
        step=step,
        tokens_per_step=tokens,
        train_tokens=t.train_tokens or t.steps * tokens,
        model_flops_per_rank=model_flops,
        assumptions={
            "mfu": mfu,
            "bf16_peak_tflops": cluster.gpu.bf16_tflops,
            "link_gbps": links,
            "nvlink_domain": cluster.gpu.nvlink_domain,
            "reserve_bytes": cluster.reserve_bytes,
            "attention": "fused (Transformer Engine)" if fused_attention(recipe) else "local",
            "batch": "the target global batch (a ramp's earlier stages are smaller)",
        },
    )
    if t.batch_ramp.start or t.step_batch_size_schedule:
        plan.notes.append("batch ramp: figures at the target batch; earlier stages use less")
    if baselines:
        plan.baselines = layerwise_baselines(recipe, lay, vocab, hp, worst.stage)
    return plan


def plan_recipe(
    source: str, overrides: Sequence[str], cluster: Cluster, *, mfu: float = DEFAULT_MFU
) -> Plan:
    """The plan of recipe ``source`` with ``overrides``; one that does not fit carries the first
    single change that makes it fit (``plan.fix``, None when no single change does)."""
    plan = plan_run(read_recipe(source, overrides), cluster, name=source, mfu=mfu)
    if not plan.fits:
        plan.fix = first_fix(source, overrides, cluster, mfu=mfu)
    return plan


def layerwise_baselines(
    recipe: Recipe, lay: RunLayout, vocab: int, hp: dict[str, Any], stage: int
) -> dict[str, Any]:
    """The matrix-routed dense parameters of ``stage`` over the data-parallel group, as this
    project's layer-wise plan, megatron-core's layer-wise optimizer and ZeRO-1 would spread
    them (:mod:`.baselines`): per scheme the max, mean and imbalance of state bytes, FLOPs and
    all-gather bytes. Empty for AdamW (no matrix optimizer)."""
    if recipe.optimizer.name == "adamw":
        return {}
    bf16 = precision_spec(recipe.training.precision).half
    params = gpt_parameters(
        planned_model(recipe), recipe.parallel, vocab_size=vocab, pp_rank=stage, seq_length=lay.seq
    )
    specs = matrix_routed(
        routed_specs(
            [p for p in params if not p.is_expert],
            matrix_optimizer=recipe.optimizer.name,
            master_bytes_per_element=4 if bf16 else 0,
        )
    )
    if not specs:
        return {}
    schemes = scheme_loads(
        specs,
        lay.dp,
        bucket_size=default_bucket_size(lay.dp),
        hyperparameters=hp,
        element_bytes=2 if bf16 else FP32,
    )
    out: dict[str, Any] = {}
    for key, scheme in zip(("ours", "megatron_core_layerwise", "zero1"), schemes, strict=True):
        figures: dict[str, Any] = {}
        for figure in ("state_bytes", "flops", "gather_bytes"):
            values = getattr(scheme, figure)
            figures[figure] = (
                None
                if values is None
                else {"max": values.max, "mean": values.mean, "imbalance": values.imbalance}
            )
        out[key] = figures
    return out


def _recompute_factor(m: Any, lay: RunLayout, kv: int) -> float:
    """Training FLOPs with recomputation over those without: full recomputes the forward
    (4/3); selective the attention scores and values (their forward share again)."""
    if lay.recompute == "full":
        return 4 / 3
    if lay.recompute == "selective":
        return 1.0  # the s×s products are small beside the matmuls at these sizes; counted 0
    return 1.0


def _whole_model(recipe: Recipe, vocab: int, seq: int) -> list[PlannedParam]:
    """Every parameter of the whole model (TP = PP = EP = CP = 1's parameter list)."""
    whole = replace(
        recipe.parallel,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        expert_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
    )
    return gpt_parameters(planned_model(recipe), whole, vocab_size=vocab, seq_length=seq)


def _total_params(recipe: Recipe, vocab: int, lay: RunLayout) -> int:
    """Elements of the whole model (TP=PP=EP=1's parameter list)."""
    return sum(p.numel for p in _whole_model(recipe, vocab, lay.seq))


def checkpoint_bytes(recipe: Recipe) -> int:
    """Bytes of one checkpoint of a GPT recipe, over all ranks: every parameter of the whole
    model as trained (fp32, or 16-bit with its fp32 master) and its optimizer state under the
    route the trainer gives it (``route_parameter``: the matrix optimizer's state for matrices,
    AdamW's for the rest). File metadata and the data loader's state are not counted."""
    from megatron_ext.optimizers.routing import route_parameter

    vocab = plan_vocab_size(recipe)
    half = precision_spec(recipe.training.precision).half
    weight = 2 + FP32 if half else FP32
    name, rules = recipe.optimizer.name, recipe.optimizer.matrix_routing
    return sum(
        p.numel * weight
        + state_bytes(p, route_parameter(p.name, p.shape, matrix_optimizer=name, rules=rules))
        for p in _whole_model(recipe, vocab, recipe.training.seq_length)
    )


# --------------------------------------------------------------------------- fit


def candidate_changes(recipe: Recipe, cluster: Cluster) -> list[list[str]]:
    """Single changes that lower memory per rank, cheapest first: sequence parallelism (with
    TP > 1), selective then full recomputation, a smaller micro-batch, more TP (inside an
    NVLink domain), more PP."""
    p, t = recipe.parallel, recipe.training
    out: list[list[str]] = []
    if p.tensor_model_parallel_size > 1 and not p.sequence_parallel:
        out.append(["parallel.sequence_parallel=true"])
    if p.recompute_granularity == "none":
        out.append(["parallel.recompute_granularity=selective"])
    if p.recompute_granularity != "full":
        out.append(["parallel.recompute_granularity=full"])
    if t.micro_batch_size > 1:
        out.append([f"training.micro_batch_size={t.micro_batch_size // 2}"])
    tp = p.tensor_model_parallel_size * 2
    while tp <= min(cluster.gpu.nvlink_domain, cluster.world):
        out.append([f"parallel.tensor_model_parallel_size={tp}"])
        tp *= 2
    pp = p.pipeline_model_parallel_size * 2
    while pp <= recipe.model.num_layers:
        out.append([f"parallel.pipeline_model_parallel_size={pp}"])
        pp *= 2
    return out


def first_fix(
    source: str, overrides: Sequence[str], cluster: Cluster, *, mfu: float = DEFAULT_MFU
) -> str | None:
    """The first of :func:`candidate_changes` under which the plan fits (``key=value`` text),
    or None when none does alone; a change the recipe refuses at this size is skipped."""
    recipe = read_recipe(source, overrides)
    for change in candidate_changes(recipe, cluster):
        try:
            changed = read_recipe(source, [*overrides, *change])
            if plan_run(changed, cluster, mfu=mfu, baselines=False).fits:
                return " ".join(change)
        except ValueError:  # ConfigError too: not a valid layout at this size
            continue
    return None
