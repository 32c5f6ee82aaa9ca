"""A GPT run's plan on a cluster: per rank, memory, communication and step time, and whether it
fits — computed from the recipe alone (torch-free, seconds), with the trainer's own functions
for the parameters (:mod:`.params`), the optimizer routes and the layer-wise ownership plan
(:mod:`.ownership`).

:func:`plan_run` is the whole computation, from :mod:`.inputs` (the cluster, the layout, the
vocabulary) and :mod:`.stage` (each pipeline stage) into :mod:`.figures` (what a plan holds);
:mod:`.report` renders it; :func:`first_fix` finds the first single change that makes a layout
that does not fit fit. Where the figures rest on an
assumption (an MFU, link bandwidths, a runtime reserve), the plan carries it in ``assumptions``
so the report prints it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from megatron_ext.config.load import read_recipe
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import get_trainer
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.flops import gpt_train_flops_per_token
from megatron_ext.optimizers.spec import recipe_hyperparameters
from megatron_ext.planner.baselines import matrix_routed, routed_specs, scheme_loads
from megatron_ext.planner.figures import Plan
from megatron_ext.planner.gpus import DEFAULT_MFU
from megatron_ext.planner.inputs import (
    Cluster,
    RunLayout,
    fused_attention,
    plan_vocab_size,
    planned_model,
    run_layout,
)
from megatron_ext.planner.mcore_layout import default_bucket_size
from megatron_ext.planner.memory import state_bytes
from megatron_ext.planner.ownership import FP32
from megatron_ext.planner.params import (
    PlannedParam,
    default_ffn_hidden_size,
    gpt_parameters,
    padded_vocab_size,
)
from megatron_ext.planner.stage import plan_stage
from megatron_ext.planner.steptime import step_time
from megatron_ext.run.precision import half_parameters

__all__ = [
    "candidate_changes",
    "checkpoint_bytes",
    "first_fix",
    "layerwise_baselines",
    "plan_recipe",
    "plan_run",
    "plan_with_fix",
]


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
    stages = [plan_stage(recipe, lay, s, vocab, hp) for s in range(lay.pp)]
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
        vp=lay.vp,
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
    return plan_with_fix(read_recipe(source, overrides), source, overrides, cluster, mfu=mfu)


def plan_with_fix(
    recipe: Recipe,
    source: str,
    overrides: Sequence[str],
    cluster: Cluster,
    *,
    mfu: float = DEFAULT_MFU,
) -> Plan:
    """:func:`plan_recipe` of a recipe already read from ``source`` with ``overrides`` (the
    launcher's one read); ``source`` and ``overrides`` name it and give :func:`first_fix` the
    recipe to change."""
    plan = plan_run(recipe, cluster, name=source, mfu=mfu)
    if not plan.fits:
        plan.fix = first_fix(recipe, source, overrides, cluster, mfu=mfu)
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
    bf16 = half_parameters(recipe.training)
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
    """Training FLOPs with recomputation over those without: full recomputes the forward of
    the layers it checkpoints (4/3 for all of them: uniform; block: the first
    ``recompute_num_layers`` of each stage's); selective the attention scores and values (their
    forward share again)."""
    if lay.recompute == "full":
        per_stage = max(1, m.num_layers // lay.pp)
        return 1 + lay.recomputed_layers(per_stage) / per_stage / 3
    if lay.recompute == "selective":
        return 1.0  # the s×s products are small beside the matmuls at these sizes; counted 0
    return 1.0


def _whole_model(recipe: Recipe, vocab: int, seq: int) -> list[PlannedParam]:
    """Every parameter of the whole model (TP = PP = EP = CP = 1's parameter list)."""
    whole = replace(
        recipe.parallel,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
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
    half = half_parameters(recipe.training)
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
    recipe: Recipe,
    source: str,
    overrides: Sequence[str],
    cluster: Cluster,
    *,
    mfu: float = DEFAULT_MFU,
) -> str | None:
    """The first of :func:`candidate_changes` to ``recipe`` (read from ``source`` with
    ``overrides``) under which the plan fits (``key=value`` text), or None when none does alone;
    each candidate is read as the recipe with one more override, and one the recipe refuses at
    this size is skipped."""
    for change in candidate_changes(recipe, cluster):
        try:
            changed = read_recipe(source, [*overrides, *change])
            if plan_run(changed, cluster, mfu=mfu, baselines=False).fits:
                return " ".join(change)
        except ValueError:  # ConfigError too: not a valid layout at this size
            continue
    return None
