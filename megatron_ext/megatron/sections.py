"""The recipe sections megatron-core's model is built from: ``model`` (GPT architecture, in
megatron-core ``TransformerConfig`` names) and ``parallel`` (model-parallel sizes).

The GPT trainer registers them among its sections (:mod:`megatron_ext.gpt.sections` re-exports
both); they live here, beside the builder that reads them (:mod:`.model`, :mod:`.parallel`), so
that megatron/ never imports the trainer above it. SOMA, DiPaCo, the planner and the converter
read them too.

No torch import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatron_ext.config.fields import spec
from megatron_ext.config.moe_presets import MOE_PRESETS

__all__ = ["ModelConfig", "ParallelConfig"]


@dataclass
class ModelConfig:
    """GPT architecture (megatron-core ``TransformerConfig`` names)."""

    num_layers: int = spec(2, ge=1)
    hidden_size: int = spec(128, ge=1)
    num_attention_heads: int = spec(4, ge=1)
    num_query_groups: int | None = spec(None, ge=1, help="GQA groups; None = MHA")
    ffn_hidden_size: int | None = spec(None, ge=1, help="None = 4*hidden (2/3 of it for SwiGLU)")
    kv_channels: int | None = spec(None, ge=1)
    vocab_size: int | None = spec(None, ge=1, help="None = tokenizer's vocabulary")
    make_vocab_size_divisible_by: int = spec(128, ge=1)
    normalization: Literal["RMSNorm", "LayerNorm"] = spec("RMSNorm")
    layernorm_epsilon: float = spec(1e-5, gt=0.0)
    position_embedding_type: Literal["rope", "learned_absolute"] = spec("rope")
    rotary_base: int = spec(10000, ge=1)
    rotary_percent: float = spec(
        1.0, gt=0.0, le=1.0, help="share of each head's channels that RoPE rotates (GPTModel's)"
    )
    activation: Literal["swiglu", "gelu"] = spec("swiglu")
    add_bias_linear: bool = False
    qk_layernorm: bool = False
    qk_layernorm_scope: Literal["head", "projection"] = spec(
        "head",
        help="q/k RMSNorm per head (Qwen3) or over the whole projection (OLMoE)",
    )
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = spec(0.02, gt=0.0)
    hidden_dropout: float = spec(0.0, ge=0.0, le=1.0)
    attention_dropout: float = spec(0.0, ge=0.0, le=1.0)
    transformer_impl: Literal["auto", "local", "transformer_engine"] = spec(
        "auto",
        help="auto = Transformer Engine when installed and on GPU",
    )
    # Mixture of experts (0 experts = dense); megatron_ext.config.moe_presets
    moe_preset: str = spec(
        "", choices=MOE_PRESETS, help="olmoe, qwen3_moe, deepseek_v3; explicit fields win"
    )
    num_moe_experts: int = spec(0, ge=0)
    moe_router_topk: int = spec(2, ge=1)
    moe_ffn_hidden_size: int | None = spec(None, ge=1)
    moe_router_score_function: Literal["softmax", "sigmoid"] = spec("softmax")
    moe_router_enable_expert_bias: bool = False
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"
    ] = spec("aux_loss", help="megatron-core's router balancing (sinkhorn: no auxiliary loss)")
    moe_aux_loss_coeff: float = spec(0.0, ge=0.0, help="megatron-core's, per MoE layer")
    moe_z_loss_coeff: float | None = spec(None, ge=0.0)
    moe_router_pre_softmax: bool = spec(False, help="softmax over all experts before top-k")
    moe_router_topk_scaling_factor: float | None = spec(None, gt=0.0)
    moe_router_bias_update_rate: float = spec(1e-3, ge=0.0)
    moe_router_num_groups: int | None = spec(None, ge=1)
    moe_router_group_topk: int | None = spec(None, ge=1)
    moe_router_dtype: Literal["fp32", "fp64"] | None = spec(
        "fp32", help="None = the model's dtype (Megatron-LM's default)"
    )
    moe_shared_expert_intermediate_size: int | None = spec(None, ge=1)
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_layer_freq: list[int] = spec(
        [], help="[] = every layer MoE; [N] = one in N; or a 0/1 pattern, one per layer"
    )
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = spec("alltoall")
    moe_grouped_gemm: bool = False
    # Every other megatron-core field, by its own name: what the fields above do not say
    transformer_config: dict[str, Any] = spec(
        {},
        help="further megatron-core TransformerConfig (MLATransformerConfig) fields by name, "
        "over what the fields above derive (activation_func by name: squared_relu, ...); "
        "names checked against megatron-core's dataclass when the model is built",
    )


@dataclass
class ParallelConfig:
    """Model-parallel sizes; data parallel is derived: dp = world / (tp * pp * cp)."""

    tensor_model_parallel_size: int = spec(1, ge=1)
    pipeline_model_parallel_size: int = spec(1, ge=1)
    context_parallel_size: int = spec(1, ge=1)
    expert_model_parallel_size: int = spec(1, ge=1)
    sequence_parallel: bool = False
    recompute_granularity: Literal["none", "selective", "full"] = spec(
        "none",
        help="activation recomputation (megatron-core's): selective = core attention, full = "
        "every layer from its input (uniform, one layer per checkpoint)",
    )
    backend: Literal["auto", "nccl", "gloo"] = spec(
        "auto", help="auto = nccl with CUDA, gloo without"
    )
