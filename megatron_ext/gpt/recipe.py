"""The GPT trainer's part of a recipe: its cross-field rules and its registration.

The GPT trainer owns the ``model``, ``optimizer``, ``data``, ``training`` and ``parallel``
sections (:mod:`megatron_ext.gpt.sections`); SOMA and DiPaCo read parts of them. No torch
import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_ext.config.fields import spec
from megatron_ext.config.moe_presets import check_moe_fields
from megatron_ext.config.optimizer import LOSS_SCALE_FIELDS, OptimizerConfig
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import TrainerSpec
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.sections import DataConfig, ModelConfig, ParallelConfig, TrainingConfig
from megatron_ext.run.precision import check_precision_fields
from megatron_ext.run.stopping import check_stop_fields
from megatron_ext.schedules.batch import BatchRule, ConstantBatch
from megatron_ext.schedules.plan import (
    TrainingSchedule,
    batch_rule,
    lr_schedule,
    training_schedule,
)

__all__ = [
    "UNEVEN_SPLIT_FIELDS",
    "GPTRecipe",
    "check_gpt",
    "check_gpt_sections",
    "check_model_layout",
    "microbatch_group",
    "uneven_pipeline_split",
]


@dataclass(kw_only=True)
class GPTRecipe(Recipe):
    """A GPT run: the core fields and the GPT trainer's sections."""

    trainer: str = spec("gpt", help="a registered trainer (megatron_ext.config.trainers)")
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)


#: megatron-core ``TransformerConfig`` fields (in ``model.transformer_config``) that split the
#: layers over pipeline stages other than evenly; megatron-core checks them against the stage
#: count itself when it builds the config
UNEVEN_SPLIT_FIELDS = (
    "pipeline_model_parallel_layout",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
)


def uneven_pipeline_split(m: ModelConfig) -> list[str]:
    """The fields of :data:`UNEVEN_SPLIT_FIELDS` the model sets."""
    return [f for f in UNEVEN_SPLIT_FIELDS if m.transformer_config.get(f)]


def check_model_layout(m: ModelConfig, p: ParallelConfig) -> None:
    """The model's shape against the parallel sizes (heads, query groups, MoE, TP, PP): the
    recipe check and the planner (:mod:`megatron_ext.planner.params`) apply the same rules."""
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size={m.hidden_size} is not divisible by "
            f"model.num_attention_heads={m.num_attention_heads}"
        )
    groups = m.num_query_groups or m.num_attention_heads
    if m.num_attention_heads % groups:
        raise ConfigError(
            f"model.num_attention_heads={m.num_attention_heads} is not "
            f"divisible by model.num_query_groups={groups}"
        )
    check_moe_fields(m, p.expert_model_parallel_size)
    if groups % p.tensor_model_parallel_size:
        raise ConfigError(
            f"attention groups ({groups}) are not divisible by "
            f"parallel.tensor_model_parallel_size="
            f"{p.tensor_model_parallel_size}"
        )
    if m.num_layers % p.pipeline_model_parallel_size and not uneven_pipeline_split(m):
        raise ConfigError(
            f"model.num_layers={m.num_layers} is not divisible by "
            f"parallel.pipeline_model_parallel_size="
            f"{p.pipeline_model_parallel_size}"
        )
    _check_virtual_stages(m, p)


def _check_virtual_stages(m: ModelConfig, p: ParallelConfig) -> None:
    """Virtual pipeline stages: megatron-core interleaves the chunks over two or more pipeline
    ranks, each chunk an equal share of a stage's layers (an uneven split or a layout says
    otherwise, megatron-core checking it)."""
    vp = p.virtual_pipeline_model_parallel_size
    if vp is None:
        return
    pp = p.pipeline_model_parallel_size
    if pp < 2:
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size={vp} needs "
            f"parallel.pipeline_model_parallel_size >= 2 (megatron-core interleaves the model "
            f"chunks over the pipeline ranks; this recipe: {pp})"
        )
    if pp == 2 and not m.transformer_config.get("overlap_p2p_comm"):
        raise ConfigError(
            f"parallel.virtual_pipeline_model_parallel_size={vp} on 2 pipeline ranks: "
            "megatron-core's interleaved schedule then batches sends and receives between the "
            "same two ranks, which mixes activations and gradients up (Megatron-LM's "
            "validate_args refuses it too): set model.transformer_config={overlap_p2p_comm: "
            "true, batch_p2p_comm: false} (Megatron-LM's default), or use 3+ pipeline ranks"
        )
    if m.num_layers % (pp * vp) and not uneven_pipeline_split(m):
        raise ConfigError(
            f"model.num_layers={m.num_layers} is not divisible by {pp * vp} model chunks "
            f"(parallel.pipeline_model_parallel_size={pp} x "
            f"parallel.virtual_pipeline_model_parallel_size={vp})"
        )


def check_gpt_sections(recipe: GPTRecipe) -> None:
    """The rules of the GPT sections (``model``, ``optimizer``, ``data``, ``training``,
    ``parallel``) that need no job size; every trainer that reads them runs these (DiPaCo)."""
    m, t, p = recipe.model, recipe.training, recipe.parallel
    check_model_layout(m, p)
    # An LR schedule longer than the run (warmup or decay past training.steps) is accepted, as
    # Megatron-LM runs it (its tests train 100 steps of a 3,200-step warmup); the dry run's
    # schedule says where the run stops in it (schedules/table.py).
    if recipe.optimizer.min_lr > recipe.optimizer.lr:
        raise ConfigError(
            f"optimizer.min_lr={recipe.optimizer.min_lr} exceeds optimizer.lr={recipe.optimizer.lr}"
        )
    if t.lr_decay_style == "WSD" and t.lr_wsd_decay_steps is None and not t.lr_wsd_decay_samples:
        raise ConfigError(
            "training.lr_decay_style=WSD needs training.lr_wsd_decay_steps "
            "(the length of the final decay window)"
        )
    if recipe.data.tokenizer == "huggingface" and not recipe.data.tokenizer_model:
        raise ConfigError(
            "data.tokenizer=huggingface needs data.tokenizer_model (the folder a Hugging Face "
            "tokenizer was saved to, with its tokenizer.json)"
        )
    if recipe.data.tokenizer == "sentencepiece" and not recipe.data.tokenizer_model:
        raise ConfigError(
            "data.tokenizer=sentencepiece needs data.tokenizer_model "
            "(train one with `megatron-ext data tokenizer`)"
        )
    if recipe.data.tokenizer == "null_ids" and not m.vocab_size:
        raise ConfigError(
            "data.tokenizer=null_ids needs model.vocab_size: its ids are in [0, vocab_size) and "
            "vocab_size - 1 ends documents (Megatron-LM's NullTokenizer --vocab-size)"
        )
    check_precision_fields(t, m, p.pipeline_model_parallel_size)
    recipe.optimizer.check()
    _check_loss_scale(recipe.optimizer, t.precision)
    check_stop_fields(t)


def _check_loss_scale(cfg: OptimizerConfig, precision: str) -> None:
    """fp16's loss-scale fields are set only for fp16 (Megatron-LM ignores them otherwise: a
    recipe saying them elsewhere would promise a scaling that does not happen)."""
    if precision == "fp16":
        return
    default = OptimizerConfig()
    given = [f for f in LOSS_SCALE_FIELDS if getattr(cfg, f) != getattr(default, f)]
    if given:
        raise ConfigError(
            f"optimizer.{given[0]}={getattr(cfg, given[0])} is fp16's loss scale, read only with "
            f"training.precision=fp16 (this recipe trains {precision}, unscaled): remove it"
        )


def check_gpt(recipe: GPTRecipe, world_size: int | None) -> None:
    """The sections' rules, a dataset to read, a consistent LR schedule and (given) a layout
    that fits the job."""
    check_gpt_sections(recipe)
    if not recipe.data.path:
        raise ConfigError(
            "data.path is empty: set it to an indexed-dataset prefix "
            "(build one with `megatron-ext data build`)"
        )
    # The schedule checks its own consistency (e.g. the WSD window must fit after the warmup):
    # build it once here so a bad schedule fails before any process starts; then the batch
    # stages and the LR positions on consumed tokens.
    t = recipe.training
    positions = (t.lr_warmup_samples, t.lr_decay_samples, t.lr_wsd_decay_samples)
    if positions == (None, None, None) and t.lr_warmup_fraction is None:
        lr_schedule(t, recipe.optimizer)  # positions in samples: the token schedule checks them
    schedule = training_schedule(t, recipe.optimizer)
    if world_size is not None:
        _check_layout(recipe.parallel, recipe.model.num_moe_experts, world_size)
        _check_stages(recipe.parallel, recipe.model, t, schedule, batch_rule(t), world_size)


def _check_layout(p: ParallelConfig, num_experts: int, world_size: int) -> None:
    """World size against the parallel layout ``p`` (the batches: :func:`_check_stages`)."""
    # ranks holding one copy of the model; data parallel is the rest (megatron-core's rule)
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if world_size % mp:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp = "
            f"{p.tensor_model_parallel_size}*{p.pipeline_model_parallel_size}*"
            f"{p.context_parallel_size} = {mp}: change the rank count or the parallel sizes"
        )
    dp = world_size // mp
    if num_experts:
        edp = dp * p.context_parallel_size
        if edp % p.expert_model_parallel_size:
            raise ConfigError(
                f"data-parallel size {dp} (x cp) is not divisible by "
                f"parallel.expert_model_parallel_size={p.expert_model_parallel_size}"
            )


def _check_stages(
    p: ParallelConfig,
    model: ModelConfig,
    t: TrainingConfig,
    schedule: TrainingSchedule,
    rule: BatchRule,
    world_size: int,
) -> None:
    """Every stage's global batch (of ``schedule``, by ``rule``) splits into micro-batches x
    data-parallel ranks (and, with virtual pipeline stages, into the interleaved schedule's
    groups)."""
    mbs = t.micro_batch_size
    dp = world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )
    if isinstance(rule, ConstantBatch):
        if t.global_batch_size % (mbs * dp):
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by "
                f"micro_batch_size*dp = {mbs}*{dp} = {mbs * dp}: use a multiple of {mbs * dp}"
            )
        _check_interleaving(
            p, model, [("training.global_batch_size", t.global_batch_size)], mbs * dp
        )
        return
    batches = []
    for index, stage in enumerate(schedule.run_stages()):
        where = (
            f"batch stage {index} (from step {stage.first_step}, token "
            f"{stage.first_sample * schedule.seq_length:,})"
        )
        if stage.global_batch % (mbs * dp):
            raise ConfigError(
                f"{where}: global batch {stage.global_batch} is not divisible by "
                f"micro_batch_size*dp = {mbs}*{dp} = {mbs * dp}: make every stage's batch a "
                f"multiple of {mbs * dp}, or lower training.micro_batch_size"
            )
        batches.append((where, stage.global_batch))
    _check_interleaving(p, model, batches, mbs * dp)


def microbatch_group(m: ModelConfig, p: ParallelConfig) -> int:
    """The interleaved schedule's micro-batch group: megatron-core's
    ``microbatch_group_size_per_vp_stage`` (in ``model.transformer_config``), else the
    pipeline size (its default)."""
    given = m.transformer_config.get("microbatch_group_size_per_vp_stage")
    return int(given or p.pipeline_model_parallel_size)


def _check_interleaving(
    p: ParallelConfig, model: ModelConfig, batches: list[tuple[str, int]], per_microbatch: int
) -> None:
    """megatron-core's interleaved schedule runs the micro-batches of a step in groups of
    ``microbatch_group_size_per_vp_stage`` (default: the pipeline size) and refuses a step
    whose last group is shorter than the pipeline (a dependency bubble): each batch of
    ``batches`` (``(where, global batch)``) is checked here, before any rank starts."""
    if p.virtual_pipeline_model_parallel_size is None:
        return
    pp = p.pipeline_model_parallel_size
    group = microbatch_group(model, p)
    for where, batch in batches:
        count = batch // per_microbatch
        if count % group and count % group < pp:
            raise ConfigError(
                f"{where}: {count} micro-batches per pipeline rank in groups of {group} "
                f"(microbatch_group_size_per_vp_stage) leave {count % group}, fewer than the "
                f"{pp} pipeline stages, which megatron-core's interleaved schedule refuses: "
                f"make the micro-batch count a multiple of {group}"
            )


#: The ``megatron_ext.trainers`` entry point ``gpt`` (setup.py).
TRAINER = TrainerSpec(
    name="gpt",
    train="megatron_ext.gpt.trainer:train",
    check=check_gpt,
    recipe=GPTRecipe,
    plan="memory",
    token_schedule=True,
    converts_hf=True,
)
