"""The GPT FLOP model: training FLOPs per token (the log line's TFLOP/s/rank)."""

from __future__ import annotations

from megatron_ext.gpt.sections import ModelConfig

__all__ = ["gpt_train_flops_per_token"]


def gpt_train_flops_per_token(
    model: ModelConfig, seq_length: int, vocab_size: int, ffn_hidden_size: int, kv_channels: int
) -> float:
    """Training FLOPs per token of the standard GPT estimate (matmuls only).

    forward = 2 FLOPs per multiply-add over every weight matmul a token passes through
    (QKV, output projection, MLP or its top-k experts plus the router, the logits) plus the
    attention score and value products, 2·2·s·d_attn per layer (full, not causal-halved, as in
    Megatron's convention); training = 3 × forward (backward costs two forwards).
    """
    h, n_layers = model.hidden_size, model.num_layers
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    attn_dim = heads * kv_channels
    qkv = h * (attn_dim + 2 * groups * kv_channels)
    proj = attn_dim * h
    mlp_mats = 3 if model.activation == "swiglu" else 2
    if model.num_moe_experts:
        expert_ffn = model.moe_ffn_hidden_size or ffn_hidden_size
        mlp = model.moe_router_topk * mlp_mats * h * expert_ffn + h * model.num_moe_experts
    else:
        mlp = mlp_mats * h * ffn_hidden_size
    per_layer = 2 * (qkv + proj + mlp) + 2 * 2 * seq_length * attn_dim
    forward = n_layers * per_layer + 2 * h * vocab_size
    return 3.0 * forward
