"""Hugging Face <-> megatron-core checkpoints (OLMoE, Qwen3-MoE, Llama-style GPT)."""
