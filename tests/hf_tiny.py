"""Tiny random Hugging Face models for the conversion tests: built in the test (nothing is
downloaded), weights drawn after ``torch.manual_seed(0)`` so every test sees the same model."""

from __future__ import annotations

from typing import Any

import torch

# The dense sizes every tiny conversion model shares (Llama, OLMoE, Qwen3-MoE).
TINY_SIZES: dict[str, Any] = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    tie_word_embeddings=False,
)
# The Qwen3-MoE shape the conversion tests share (k = 2 < E = 8); each test overrides fields.
TINY_QWEN3_MOE: dict[str, Any] = dict(
    **TINY_SIZES,
    moe_intermediate_size=16,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
)


def tiny_qwen3_moe(**fields: Any) -> torch.nn.Module:
    """A ``Qwen3MoeForCausalLM`` of :data:`TINY_QWEN3_MOE` with ``fields`` overridden, seeded
    with 0, in eval mode."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY_QWEN3_MOE, **fields})).eval()
