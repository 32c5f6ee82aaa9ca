"""Build megatron-core's ``GPTModel`` (dense or MoE) from a recipe's ``ModelConfig``.

The layer spec is megatron-core's own: Transformer Engine's when it is installed and the model
runs on CUDA (``transformer_impl: auto``), else the local spec with :class:`SdpaAttention` as
core attention, which runs on CPU and GPU alike.

Precision (:mod:`megatron_ext.run.precision`) as Megatron-LM runs it: the config's dtypes and
FP8/FP4 fields come from the one mapping, and a half model (every precision but fp32) is
wrapped in megatron-core's ``Float16Module`` (:func:`half_precision_module`), which casts every
parameter to bf16 (fp16 for ``fp16``), norms included. FP8/FP4 build only on Transformer
Engine's layers.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_ext.config.moe_presets import moe_transformer_fields
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.attention import SdpaAttention
from megatron_ext.megatron.qk_norm import ProjectionKNorm, ProjectionQNorm
from megatron_ext.run.precision import precision_spec, transformer_config_fields

if TYPE_CHECKING:  # the recipe sections this module reads (never builds)
    from megatron_ext.megatron.sections import ModelConfig, ParallelConfig


def have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def use_transformer_engine(model: ModelConfig) -> bool:
    """Resolve ``model.transformer_impl``; asking for TE where it cannot run is an error."""
    available = have_transformer_engine() and torch.cuda.is_available()
    if model.transformer_impl == "transformer_engine" and not available:
        raise ConfigError(
            "model.transformer_impl=transformer_engine needs Transformer Engine "
            "and a CUDA GPU (use the NGC container), or set it to 'local'/'auto'"
        )
    return model.transformer_impl == "transformer_engine" or (
        model.transformer_impl == "auto" and available
    )


def recompute_fields(parallel: ParallelConfig) -> dict[str, Any]:
    """megatron-core's recompute fields for ``parallel.recompute_*``: ``selective`` recomputes
    ``recompute_modules``; ``full`` checkpoints whole layers (``recompute_method``, with
    ``recompute_num_layers``)."""
    granularity = parallel.recompute_granularity
    if granularity == "none":
        return {}
    if granularity == "selective":
        return {
            "recompute_granularity": "selective",
            "recompute_modules": list(parallel.recompute_modules),
        }
    return {
        "recompute_granularity": "full",
        "recompute_method": parallel.recompute_method,
        "recompute_num_layers": parallel.recompute_num_layers,
    }


def transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: str,
    bf16_layers: tuple[int, int] = (0, 0),
    fp8_format: str | None = None,
    params_dtype: str | None = None,
) -> TransformerConfig:
    """megatron-core ``TransformerConfig`` (``MLATransformerConfig`` for multi-latent
    attention) for the recipe: :func:`transformer_kwargs` under ``model.transformer_config``
    (:mod:`.transformer_fields`); ``bf16_layers``: the first/last layers an FP8/FP4 precision
    keeps in BF16; ``fp8_format``, ``params_dtype``: ``training.fp8_format``,
    ``training.params_dtype``."""
    import dataclasses

    from megatron_ext.megatron import transformer_fields

    named = tuple(f.name for f in dataclasses.fields(model))
    kwargs = transformer_kwargs(model, parallel, precision, bf16_layers, fp8_format, params_dtype)
    kwargs |= transformer_fields.resolve(model.transformer_config, named)
    return transformer_fields.config_class(model.transformer_config)(**kwargs)


def transformer_kwargs(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: str,
    bf16_layers: tuple[int, int] = (0, 0),
    fp8_format: str | None = None,
    params_dtype: str | None = None,
) -> dict[str, Any]:
    """The ``TransformerConfig`` keyword arguments the recipe's named fields derive (fusions
    off where they need CUDA), before ``model.transformer_config``."""
    cuda = torch.cuda.is_available()
    swiglu = model.activation == "swiglu"
    ffn = model.ffn_hidden_size or (
        int(8 * model.hidden_size / 3 + 63) // 64 * 64 if swiglu else 4 * model.hidden_size
    )
    moe = model.num_moe_experts > 0
    return dict(
        transformer_impl="transformer_engine" if use_transformer_engine(model) else "local",
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=ffn,
        kv_channels=model.kv_channels,
        normalization=model.normalization,
        layernorm_epsilon=model.layernorm_epsilon,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else F.gelu,
        add_bias_linear=model.add_bias_linear,
        qk_layernorm=model.qk_layernorm,
        init_method_std=model.init_method_std,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        **recompute_fields(parallel),
        **transformer_config_fields(precision, *bf16_layers, fp8_format, params_dtype),
        # CPU hosts: create weights on the CPU; the fused kernels below need CUDA (and apex/TE).
        use_cpu_initialization=not cuda,
        bias_activation_fusion=False,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        num_moe_experts=model.num_moe_experts if moe else None,
        moe_router_topk=model.moe_router_topk if moe else 2,
        moe_ffn_hidden_size=(model.moe_ffn_hidden_size or ffn) if moe else None,
        moe_router_score_function=model.moe_router_score_function,
        moe_router_enable_expert_bias=model.moe_router_enable_expert_bias if moe else False,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_grouped_gemm=model.moe_grouped_gemm,
        moe_router_dtype=model.moe_router_dtype if moe else None,
        **(moe_transformer_fields(model) if moe else {}),
    )


def block_spec(model: ModelConfig, config: TransformerConfig, vp_stage: int | None = None) -> Any:
    """The decoder's spec: one layer spec for every layer, or -- a MoE ``moe_layer_freq`` with
    dense layers -- this pipeline stage's layers (of its virtual stage ``vp_stage``) each with
    its own (MoE or dense MLP), under megatron-core's default final norm (what it builds from a
    single layer spec)."""
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    freq = config.moe_layer_freq
    n = config.num_layers
    pattern = [int(i % freq == 0) for i in range(n)] if isinstance(freq, int) else list(freq)
    if not model.num_moe_experts or all(pattern):
        return layer_spec(model)
    specs = {1: layer_spec(model), 0: layer_spec(model, dense=True)}
    offset = get_transformer_layer_offset(config, vp_stage)
    here = pattern[offset : offset + transformer_block.get_num_layers_to_build(config, vp_stage)]
    return transformer_block.TransformerBlockSubmodules(
        layer_specs=[specs[moe] for moe in here], layer_norm=transformer_block.LayerNormImpl
    )


def layer_spec(model: ModelConfig, dense: bool = False) -> ModuleSpec:
    """megatron-core's GPT layer spec: TE's, or the local one with SDPA core attention
    (``dense``: a MoE model's dense-MLP layers)."""
    experts = None if dense else model.num_moe_experts or None
    projection_norm = model.qk_layernorm and model.qk_layernorm_scope == "projection"
    if use_transformer_engine(model) and projection_norm:
        raise ConfigError(
            "model.qk_layernorm_scope=projection (OLMoE) is built on the local spec; "
            "set model.transformer_impl=local"
        )
    mla = bool(model.transformer_config.get("multi_latent_attention"))
    if mla and not use_transformer_engine(model):
        raise ConfigError(
            "multi-latent attention (model.transformer_config.multi_latent_attention) needs "
            "Transformer Engine's core attention: megatron-core 0.19's local DotProductAttention "
            "takes no separate key/value head dims (k_channels, v_channels); run it where "
            "Transformer Engine and a GPU are"
        )
    if use_transformer_engine(model):
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts,
            moe_grouped_gemm=model.moe_grouped_gemm,
            qk_layernorm=model.qk_layernorm,
            multi_latent_attention=mla,
        )
    spec = get_gpt_layer_local_spec(
        num_experts=experts,
        moe_grouped_gemm=model.moe_grouped_gemm,
        qk_layernorm=model.qk_layernorm,
        normalization=model.normalization,
    )
    spec.submodules.self_attention.submodules.core_attention = SdpaAttention
    if projection_norm:
        spec.submodules.self_attention.submodules.q_layernorm = ProjectionQNorm
        spec.submodules.self_attention.submodules.k_layernorm = ProjectionKNorm
    return spec


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Round the vocabulary up so every tensor-parallel shard has a multiple of ``divisible_by``."""
    multiple = divisible_by * tp
    return (vocab_size + multiple - 1) // multiple * multiple


def _check_layout_chunks(config: TransformerConfig, parallel: ParallelConfig) -> None:
    """A pipeline layout's stages are the model chunks: pipeline ranks x virtual stages.
    megatron-core builds what it is asked to, so a layout with more stages than that (virtual
    stages implied, ``parallel.virtual_pipeline_model_parallel_size`` not set) would build only
    the first chunk's layers on each rank: refused here, before."""
    layout = config.pipeline_model_parallel_layout
    if layout is None:
        return
    per_rank = getattr(layout, "virtual_pipeline_model_parallel_size", 1) or 1
    # (megatron-core's __post_init__ writes the layout's count into the config: the recipe's)
    chunks = parallel.virtual_pipeline_model_parallel_size or 1
    if per_rank != chunks:
        raise ConfigError(
            f"model.transformer_config.pipeline_model_parallel_layout={layout!r} puts "
            f"{per_rank} stage(s) on each pipeline rank, and the recipe builds {chunks} model "
            f"chunk(s) per rank: set parallel.virtual_pipeline_model_parallel_size="
            f"{per_rank if per_rank > 1 else 'null'} (Megatron-LM derives it from the layout)"
        )


def _check_recompute_on_host(parallel: ParallelConfig) -> None:
    """Norm recomputation needs Transformer Engine: megatron-core 0.19's
    ``CheckpointWithoutOutput`` (tensor_parallel/random.py) reads TE's FP8 state on every
    checkpoint, FP8 or not, so without TE the first forward stops on a NameError."""
    selective = parallel.recompute_granularity == "selective"
    if selective and "layernorm" in parallel.recompute_modules and not have_transformer_engine():
        raise ConfigError(
            "parallel.recompute_modules: layernorm needs Transformer Engine (megatron-core "
            "0.19 recomputes norms through TE's FP8 state, FP8 or not): run it in the NGC "
            "container, or recompute the other modules here"
        )


def build_gpt_model(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: str,
    vocab_size: int,
    seq_length: int,
    bf16_layers: tuple[int, int] = (0, 0),
    fp8_format: str | None = None,
    params_dtype: str | None = None,
) -> GPTModel:
    """This pipeline stage's ``GPTModel`` on the current device (CPU without CUDA); the last
    pipeline stage computes the per-token loss when given labels. Train it inside
    :func:`half_precision_module`. ``bf16_layers``, ``fp8_format``, ``params_dtype``: the
    training section's (:func:`transformer_config`). With virtual pipeline stages a stage is
    several chunks: :func:`build_gpt_chunks`."""
    if parallel.virtual_pipeline_model_parallel_size:
        raise ValueError(
            "parallel.virtual_pipeline_model_parallel_size is set: a pipeline stage is "
            "several model chunks, built by build_gpt_chunks"
        )
    return build_gpt_chunks(
        model, parallel, precision, vocab_size, seq_length, bf16_layers, fp8_format, params_dtype
    )[0]


def build_gpt_chunks(
    model: ModelConfig,
    parallel: ParallelConfig,
    precision: str,
    vocab_size: int,
    seq_length: int,
    bf16_layers: tuple[int, int] = (0, 0),
    fp8_format: str | None = None,
    params_dtype: str | None = None,
) -> list[GPTModel]:
    """This pipeline rank's model chunks, as Megatron-LM's ``get_model`` builds them: one
    ``GPTModel`` per virtual stage (``parallel.virtual_pipeline_model_parallel_size``; one
    without virtual stages), all on one ``TransformerConfig``. Chunk ``v`` of pipeline rank
    ``r`` holds model stage ``v·PP + r`` (megatron-core's layer offsets); the embedding is on
    the first rank's first chunk, the output layer and loss on the last rank's last chunk."""
    config = transformer_config(model, parallel, precision, bf16_layers, fp8_format, params_dtype)
    _check_recompute_on_host(parallel)
    _check_layout_chunks(config, parallel)
    if model.moe_token_dispatcher_type == "flex" and not torch.cuda.is_available():
        raise ConfigError(
            "model.moe_token_dispatcher_type=flex: megatron-core's flex dispatcher runs on "
            "CUDA GPUs only (DeepEP, HybridEP or NCCL-EP kernels); on this host use alltoall"
        )
    if precision_spec(precision).quantized:
        _require_quantized_layers(model, precision)
    vocab = padded_vocab_size(
        model.vocab_size or vocab_size,
        model.make_vocab_size_divisible_by,
        parallel.tensor_model_parallel_size,
    )
    vp = parallel.virtual_pipeline_model_parallel_size
    stages = [None] if vp is None else list(range(vp))
    return [_build_chunk(model, config, vocab, seq_length, stage) for stage in stages]


def _build_chunk(
    model: ModelConfig, config: TransformerConfig, vocab: int, seq_length: int, vp_stage: int | None
) -> GPTModel:
    """One model chunk (``vp_stage``: its virtual stage, None without virtual stages)."""
    from megatron.core import parallel_state

    first = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    decoder = block_spec(model, config, vp_stage)
    try:
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=decoder,
            vocab_size=vocab,
            max_sequence_length=seq_length,
            pre_process=first,
            post_process=last,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding_type,
            rotary_percent=model.rotary_percent,
            rotary_base=model.rotary_base,
            mtp_block_spec=mtp_spec(model, config, decoder, vp_stage),
            vp_stage=vp_stage,
        )
    except AssertionError as err:
        if use_transformer_engine(model):
            raise  # an internal error on TE's spec: keep the traceback
        raise ConfigError(  # megatron-core's own reason, e.g. torch norms: no (1 + γ)
            f"megatron-core cannot build this model with its local layers (no Transformer "
            f"Engine on this host): {err}; run it where Transformer Engine and a GPU are"
        ) from None
    if torch.cuda.is_available():
        gpt.cuda(torch.cuda.current_device())
    return gpt


def mtp_spec(
    model: ModelConfig, config: TransformerConfig, decoder: Any, vp_stage: int | None = None
) -> ModuleSpec | None:
    """megatron-core's multi-token-prediction block (``mtp_num_layers``) with the decoder's last
    layer spec, as Megatron-LM's ``gpt_builder`` makes it; None without MTP."""
    if not config.mtp_num_layers:
        return None
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    # a block spec lists this stage's layers (none: the plain layer spec, as gpt_builder
    # does); else one layer spec serves every layer
    layers = getattr(decoder, "layer_specs", None)
    last = decoder if layers is None else (layers[-1] if layers else layer_spec(model))
    return get_gpt_mtp_block_spec(
        config, last, use_transformer_engine=use_transformer_engine(model), vp_stage=vp_stage
    )


def half_precision_module(gpt: GPTModel) -> torch.nn.Module:
    """``gpt`` as Megatron-LM trains it: in megatron-core's ``Float16Module`` when its config is
    bf16 or fp16 (every parameter cast to that dtype, norms included; inputs cast on the first
    pipeline stage, outputs back to fp32 on the last), else ``gpt`` itself. Its state dict and
    sharded state dict are ``gpt``'s, so checkpoint keys do not change."""
    from megatron.core.transformer.module import Float16Module

    half = gpt.config.bf16 or gpt.config.fp16
    return Float16Module(gpt.config, gpt) if half else gpt


def _require_quantized_layers(model: ModelConfig, precision: str) -> None:
    """FP8/FP4 only where they take effect: megatron-core without Transformer Engine (or the
    local spec) turns the request into a no-op context and trains in BF16."""
    from megatron.core import fp4_utils, fp8_utils

    if not (use_transformer_engine(model) and fp8_utils.HAVE_TE and fp4_utils.HAVE_TE):
        raise ConfigError(
            f"training.precision={precision} needs Transformer Engine's layers on a GPU, and "
            "this process builds the local spec (megatron-core would silently train in BF16)"
        )
