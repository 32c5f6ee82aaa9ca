"""megatron-core -> Hugging Face from a GPT-trainer checkpoint (``run_dir/checkpoints/step_N``)
and the recipe that wrote it: the HF config is built from the recipe's model fields (the inverse
of :func:`megatron_ext.convert.hf.model_fields`), the weights are loaded from the checkpoint
into one fp32 process (any data/expert-parallel layout reshards on load), then
:func:`megatron_ext.convert.to_hf.mcore_to_hf_state` maps them.

The family: ``model.moe_preset`` (``olmoe``, ``qwen3_moe``); without one, a MoE model's q/k norm
scope (``projection``: OLMoE, ``head``: Qwen3-MoE) and a dense one is Llama-style. Fields the
family's HF class cannot express (sigmoid scores, expert bias, shared experts, grouped top-k, a
top-k scaling factor, biases, LayerNorm, GELU, learned positions, OLMoE without q/k norm or
with dense layers) are a ``ConfigError`` naming each.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from megatron_ext.config.moe_presets import hf_aux_loss_coeff
from megatron_ext.config.schema import Recipe
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.sections import ModelConfig

__all__ = ["hf_config_fields", "hf_family", "load_trainer_model"]


def hf_family(m: ModelConfig) -> str:
    """``olmoe``, ``qwen3_moe`` or ``llama`` for the recipe's model."""
    if m.moe_preset in ("olmoe", "qwen3_moe"):
        return m.moe_preset
    if m.moe_preset:
        raise ConfigError(f"model.moe_preset={m.moe_preset!r} has no Hugging Face family here")
    if not m.num_moe_experts:
        return "llama"
    return "olmoe" if m.qk_layernorm_scope == "projection" else "qwen3_moe"


def _refusals(m: ModelConfig, family: str, pattern: list[int]) -> list[str]:
    checks = [
        (m.normalization != "RMSNorm", f"normalization={m.normalization}"),
        (m.activation != "swiglu", f"activation={m.activation}"),
        (m.add_bias_linear, "add_bias_linear=true"),
        (
            m.position_embedding_type != "rope",
            f"position_embedding_type={m.position_embedding_type}",
        ),
    ]
    if m.num_moe_experts:
        checks += [
            (m.moe_router_score_function != "softmax", "moe_router_score_function=sigmoid"),
            (m.moe_router_enable_expert_bias, "moe_router_enable_expert_bias=true"),
            (bool(m.moe_shared_expert_intermediate_size), "a shared expert"),
            (m.moe_router_num_groups is not None, "grouped top-k (moe_router_num_groups)"),
            (m.moe_router_topk_scaling_factor is not None, "moe_router_topk_scaling_factor"),
            (
                m.moe_router_load_balancing_type not in ("aux_loss", "none"),
                f"moe_router_load_balancing_type={m.moe_router_load_balancing_type}",
            ),
        ]
    if family == "olmoe":
        checks += [
            (
                not m.qk_layernorm or m.qk_layernorm_scope != "projection",
                "OLMoE needs q/k norm "
                "over the projection (qk_layernorm=true, qk_layernorm_scope=projection)",
            ),
            (not all(pattern), "OLMoE has no dense layers (moe_layer_freq)"),
        ]
    if family == "qwen3_moe":
        checks.append(
            (
                not m.qk_layernorm or m.qk_layernorm_scope != "head",
                "Qwen3-MoE needs q/k norm per head (qk_layernorm=true, scope head)",
            )
        )
    if family == "llama":
        checks.append((m.qk_layernorm, "a Llama-style model has no q/k norm"))
    return [what for bad, what in checks if bad]


def hf_config_fields(recipe: Recipe, config: Any, vocab_size: int) -> tuple[str, dict[str, Any]]:
    """(model_type, HF config keyword arguments) for the recipe's model. ``config``: the built
    model's megatron-core ``TransformerConfig`` (resolved ffn size, kv channels, groups);
    ``vocab_size``: the model's (padded) embedding rows."""
    m = recipe.model
    family = hf_family(m)
    freq = config.moe_layer_freq
    layers = config.num_layers
    pattern = [int(i % freq == 0) for i in range(layers)] if isinstance(freq, int) else freq
    refused = _refusals(m, family, list(pattern) if m.num_moe_experts else [1])
    if refused:
        raise ConfigError(
            f"mcore-to-hf: the {family} HF config cannot express: {'; '.join(refused)}"
        )
    heads = config.num_attention_heads
    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": config.num_query_groups,
        "head_dim": config.kv_channels,
        "hidden_act": "silu",
        "max_position_embeddings": recipe.training.seq_length,
        "rms_norm_eps": m.layernorm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": float(m.rotary_base)},
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
        "attention_bias": False,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    if family == "llama":
        return family, fields
    topk, moe_layers = m.moe_router_topk, sum(pattern)
    fields.update(
        num_experts=m.num_moe_experts,
        num_experts_per_tok=topk,
        # megatron-core's softmax over the chosen k == HF's renormalised top-k
        norm_topk_prob=not m.moe_router_pre_softmax,
        router_aux_loss_coef=hf_aux_loss_coeff(m.moe_aux_loss_coeff, topk, moe_layers),
    )
    if family == "olmoe":
        if config.kv_channels * heads != config.hidden_size:
            raise ConfigError(
                "mcore-to-hf: OLMoE has no head_dim: kv_channels must be "
                f"hidden_size / heads = {config.hidden_size // heads}"
            )
        del fields["head_dim"]
        fields["intermediate_size"] = config.moe_ffn_hidden_size  # OLMoE's experts' size
    else:
        fields["moe_intermediate_size"] = config.moe_ffn_hidden_size
        fields["decoder_sparse_step"] = 1
        fields["mlp_only_layers"] = [i for i, moe in enumerate(pattern) if not moe]
    return family, fields


def load_trainer_model(ckpt: Path, recipe: Recipe) -> tuple[Any, dict[str, Any]]:
    """The fp32 GPTModel of GPT-trainer checkpoint ``ckpt`` (one process), and the fields
    :func:`~megatron_ext.convert.to_hf.mcore_to_hf_state` reads."""
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.data import build_tokenizer
    from megatron_ext.gpt.checkpoint import load_model_weights
    from megatron_ext.gpt.sections import ParallelConfig
    from megatron_ext.megatron.model import build_gpt_model

    init_single_process()
    tokenizer = build_tokenizer(
        recipe.data.tokenizer, recipe.data.tokenizer_model, recipe.model.vocab_size
    )
    gpt = build_gpt_model(
        recipe.model,
        ParallelConfig(),
        "fp32",
        vocab_size=tokenizer.vocab_size,
        seq_length=recipe.training.seq_length,
    )
    load_model_weights(ckpt, gpt)
    c = gpt.config
    fields = {
        "num_layers": c.num_layers,
        "num_query_groups": c.num_query_groups,
        "kv_channels": c.kv_channels,
        "qk_layernorm": c.qk_layernorm,
        "num_moe_experts": c.num_moe_experts or 0,
        "untie_embeddings_and_output_weights": recipe.model.untie_embeddings_and_output_weights,
    }
    return gpt.eval(), fields
