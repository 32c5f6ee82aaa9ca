"""Hugging Face -> megatron-core: the config mapping and the weight layout (OLMoE, Qwen3-MoE,
dense Llama-style GPT).

Weights, per layer ``i`` (megatron-core local spec, ``SequentialMLP`` experts):

- q/k/v projections -> ``linear_qkv`` in megatron-core's per-group layout: for each query group
  ``g`` the rows ``[q heads of g; k_g; v_g]``;
- ``gate_proj``/``up_proj`` (or HF 5's fused ``gate_up_proj`` [E, 2I, H], gate rows first) ->
  ``linear_fc1 = [gate; up]``; ``down_proj`` -> ``linear_fc2``;
- the router ``gate.weight`` -> ``mlp.router.weight``; norms one to one.

The RMSNorm epsilon comes from the HF ``config.json``, else the family's HF class default
(:data:`megatron_ext.config.moe_presets.FAMILY_EPSILON`), never a global default; the choice is
returned so the command can say it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_ext.config.moe_presets import FAMILY_EPSILON, mcore_aux_loss_coeff
from megatron_ext.errors import ConfigError

FAMILIES = ("olmoe", "qwen3_moe", "llama")
# HF class defaults of the RMSNorm epsilon (the dense family: LlamaConfig's).
HF_EPSILON = {"olmoe": FAMILY_EPSILON["olmoe"], "qwen3_moe": FAMILY_EPSILON["qwen3_moe"]}
HF_EPSILON["llama"] = 1e-6


@dataclass(frozen=True)
class EpsilonChoice:
    """The epsilon a conversion used and where it came from (``config.json`` or the default)."""

    value: float
    source: str


def read_hf_config(hf_dir: Path) -> dict[str, Any]:
    """``config.json`` of an HF model directory; a missing or unsupported one is a ConfigError."""
    path = Path(hf_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{hf_dir}: no config.json (not a Hugging Face model directory)")
    from megatron_ext.convert.inputs import read_json

    raw = read_json(path, "give a Hugging Face model folder with its config.json as written")
    if raw.get("model_type") not in FAMILIES:
        raise ConfigError(
            f"{path}: model_type={raw.get('model_type')!r} is not supported; "
            f"convert one of {', '.join(FAMILIES)}"
        )
    return raw


def choose_epsilon(raw: dict[str, Any]) -> EpsilonChoice:
    """``rms_norm_eps`` from the config file, else the family's HF class default."""
    family = raw["model_type"]
    if raw.get("rms_norm_eps") is not None:
        return EpsilonChoice(float(raw["rms_norm_eps"]), "config.json rms_norm_eps")
    return EpsilonChoice(HF_EPSILON[family], f"the {family} HF class default (config has none)")


def model_fields(raw: dict[str, Any], eps: float) -> dict[str, Any]:
    """The recipe's ``model:`` fields (megatron-core names) for an HF config mapping."""
    family = raw["model_type"]
    heads = raw["num_attention_heads"]
    rope = raw.get("rope_parameters") or {}
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_type={rope['rope_type']!r} is not supported (only 'default')")
    if raw.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported")
    fields: dict[str, Any] = {
        "num_layers": raw["num_hidden_layers"],
        "hidden_size": raw["hidden_size"],
        "num_attention_heads": heads,
        "num_query_groups": raw.get("num_key_value_heads") or heads,
        "kv_channels": raw.get("head_dim") or raw["hidden_size"] // heads,
        "ffn_hidden_size": raw["intermediate_size"],
        "vocab_size": raw["vocab_size"],
        "make_vocab_size_divisible_by": 1,
        "normalization": "RMSNorm",
        "layernorm_epsilon": eps,
        "position_embedding_type": "rope",
        "rotary_base": int(theta),
        "activation": "swiglu",
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not raw.get("tie_word_embeddings", False),
        "transformer_impl": "local",
    }
    if family == "llama":
        return fields
    experts = raw.get("num_experts") or raw.get("num_local_experts") or 0
    topk = raw["num_experts_per_tok"]
    layers = raw["num_hidden_layers"]
    sparse = _qwen3_sparse_layers(raw) if family == "qwen3_moe" else set(range(layers))
    fields.update(
        qk_layernorm=True,
        qk_layernorm_scope="projection" if family == "olmoe" else "head",
        num_moe_experts=experts,
        moe_router_topk=topk,
        moe_ffn_hidden_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
        moe_router_score_function="softmax",
        # renormalised top-k == softmax over the chosen k (megatron-core's default order)
        moe_router_pre_softmax=not raw.get("norm_topk_prob", False),
        moe_router_load_balancing_type="aux_loss",
        # HF's loss concatenates the router logits of the MoE layers only
        moe_aux_loss_coeff=mcore_aux_loss_coeff(
            float(raw.get("router_aux_loss_coef", 0.0)), topk, len(sparse)
        ),
        moe_token_dispatcher_type="alltoall",
    )
    if family == "qwen3_moe" and len(sparse) != layers:
        fields["moe_layer_freq"] = [int(i in sparse) for i in range(layers)]
    return fields


def _qwen3_sparse_layers(raw: dict[str, Any]) -> set[int]:
    step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or [])
    return {i for i in range(raw["num_hidden_layers"]) if i not in dense and (i + 1) % step == 0}


def qkv_weight(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """megatron-core's fused ``linear_qkv`` weight: per group ``[q heads; k; v]`` rows."""
    hidden = q.shape[1]
    qg = q.reshape(groups, -1, hidden)
    kg, vg = k.reshape(groups, -1, hidden), v.reshape(groups, -1, hidden)
    return torch.cat([qg, kg, vg], dim=1).reshape(-1, hidden)


def split_qkv(
    qkv: torch.Tensor, groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of :func:`qkv_weight`: (q, k, v) HF projection weights."""
    hidden = qkv.shape[1]
    per_group = qkv.reshape(groups, -1, hidden)
    q_rows = per_group.shape[1] - 2 * head_dim
    q, k, v = per_group.split([q_rows, head_dim, head_dim], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def hf_to_mcore_state(hf: dict[str, torch.Tensor], fields: dict[str, Any]) -> dict[str, Any]:
    """megatron-core ``GPTModel`` state-dict entries from an HF state dict (names as HF saves
    them, ``model.`` prefix); experts from either the per-expert or the fused 3-D layout."""
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]
    }
    groups, experts = fields["num_query_groups"], fields.get("num_moe_experts", 0)
    for i in range(fields["num_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = qkv_weight(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], groups
        )
        out[m + "self_attention.linear_proj.weight"] = hf[a + "o_proj.weight"]
        if fields.get("qk_layernorm"):
            out[m + "self_attention.q_layernorm.weight"] = hf[a + "q_norm.weight"]
            out[m + "self_attention.k_layernorm.weight"] = hf[a + "k_norm.weight"]
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"]
        if experts and h + "mlp.gate.weight" in hf:
            out[m + "mlp.router.weight"] = hf[h + "mlp.gate.weight"]
            for e, (fc1, fc2) in enumerate(_experts(hf, h + "mlp.experts.", experts)):
                out[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = fc1
                out[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = fc2
        else:
            p = h + "mlp."
            out[m + "mlp.linear_fc1.weight"] = torch.cat(
                [hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]]
            )
            out[m + "mlp.linear_fc2.weight"] = hf[p + "down_proj.weight"]
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if fields["untie_embeddings_and_output_weights"]:
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def _experts(
    hf: dict[str, torch.Tensor], prefix: str, experts: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(fc1 = [gate; up], fc2) per expert, from HF 5's fused tensors or per-expert linears."""
    if prefix + "gate_up_proj" in hf:
        gate_up, down = hf[prefix + "gate_up_proj"], hf[prefix + "down_proj"]
        return [(gate_up[e], down[e]) for e in range(experts)]
    return [
        (
            torch.cat([hf[f"{prefix}{e}.gate_proj.weight"], hf[f"{prefix}{e}.up_proj.weight"]]),
            hf[f"{prefix}{e}.down_proj.weight"],
        )
        for e in range(experts)
    ]
