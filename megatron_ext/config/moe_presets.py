"""MoE routing presets (``model.moe_preset``) in megatron-core ``TransformerConfig`` terms.

A preset names a published model family's routing and expands, at recipe load, into the
``model:`` fields megatron-core reads; a field the recipe gives explicitly wins over the preset.

- ``olmoe``: softmax over all experts, then top-k, weights not renormalised
  (``moe_router_pre_softmax``); 64 experts, top-8, SwiGLU experts, Switch aux loss, z-loss;
  q/k RMSNorm over the whole projection (``qk_layernorm_scope: projection``).
- ``qwen3_moe``: top-k then softmax over the chosen k, which is softmax over all and
  renormalising the top-k (HF ``norm_topk_prob: true``, as the released checkpoints set it);
  128 experts, top-8, q/k RMSNorm per head, aux loss.
- ``deepseek_v3``: sigmoid scores, an expert bias used for selection only (updated from the
  load, not by gradients), sequence aux loss 1e-4, one shared expert, grouped top-k (8 groups,
  best 4), scores scaled by 2.5.

Aux-loss conventions. Hugging Face computes one Switch loss over all layers' router logits
concatenated, ``coef * E * sum_e f_e P_e`` with ``f_e`` the fraction of (token, slot) pairs sent to
``e`` (summing to k); megatron-core adds one loss per MoE layer and divides each by k. For equal
gradients ``mcore = hf * k / L`` (L = MoE layers; exact when every layer has the same load
statistics): :func:`mcore_aux_loss_coeff`. A preset holds the Hugging Face coefficient and
translates it with the recipe's own k and L.

This module must not import torch (the launcher validates recipes before any process starts).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal, get_args

from megatron_ext.errors import ConfigError

MoePreset = Literal["", "olmoe", "qwen3_moe", "deepseek_v3"]
MOE_PRESETS: tuple[MoePreset, ...] = get_args(MoePreset)

# The RMSNorm epsilon of each family's Hugging Face config class (its default when a config file
# omits it): the conversion and the preset warning use these, never a global default.
FAMILY_EPSILON: dict[str, float] = {"olmoe": 1e-5, "qwen3_moe": 1e-6, "deepseek_v3": 1e-6}

# Each preset's fields; "hf_router_aux_loss_coef" is translated into moe_aux_loss_coeff.
_PRESETS: dict[str, dict[str, Any]] = {
    "olmoe": {
        "num_moe_experts": 64,
        "moe_router_topk": 8,
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "layernorm_epsilon": FAMILY_EPSILON["olmoe"],
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": True,
        "moe_router_load_balancing_type": "aux_loss",
        "hf_router_aux_loss_coef": 0.01,
        "moe_z_loss_coeff": 0.001,
        "qk_layernorm": True,
        "qk_layernorm_scope": "projection",
    },
    "qwen3_moe": {
        "num_moe_experts": 128,
        "moe_router_topk": 8,
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "layernorm_epsilon": FAMILY_EPSILON["qwen3_moe"],
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": False,
        "moe_router_load_balancing_type": "aux_loss",
        "hf_router_aux_loss_coef": 0.001,
        "qk_layernorm": True,
        "qk_layernorm_scope": "head",
    },
    "deepseek_v3": {
        "num_moe_experts": 256,
        "moe_router_topk": 8,
        "activation": "swiglu",
        "normalization": "RMSNorm",
        "layernorm_epsilon": FAMILY_EPSILON["deepseek_v3"],
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
        "moe_router_bias_update_rate": 1e-3,
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_aux_loss_coeff": 1e-4,
        "moe_router_num_groups": 8,
        "moe_router_group_topk": 4,
        "moe_router_topk_scaling_factor": 2.5,
        "moe_shared_expert_intermediate_size": 2048,
        "moe_ffn_hidden_size": 2048,
    },
}


def mcore_aux_loss_coeff(hf_coef: float, topk: int, moe_layers: int) -> float:
    """megatron-core's per-layer ``moe_aux_loss_coeff`` equal to Hugging Face's concatenated
    ``router_aux_loss_coef`` (see the module docstring): ``hf * k / L``."""
    return hf_coef * topk / moe_layers


def moe_layer_count(freq: list[int] | int, num_layers: int) -> int:
    """The MoE layers of ``model.moe_layer_freq`` ([]: all, [N] or N: one in N from the first,
    or a 0/1 pattern) -- the L of the aux-loss translation."""
    freq = [freq] if isinstance(freq, int) else list(freq)
    if not freq:
        return num_layers
    if len(freq) == 1:
        return len(range(0, num_layers, int(freq[0])))
    return sum(int(x) for x in freq)


def hf_aux_loss_coeff(mcore_coef: float, topk: int, moe_layers: int) -> float:
    """The inverse of :func:`mcore_aux_loss_coeff`: ``mcore * L / k``."""
    return mcore_coef * moe_layers / topk


def preset_fields(name: str, model: dict[str, Any]) -> dict[str, Any]:
    """The megatron-core fields preset ``name`` sets, given the recipe's ``model`` mapping
    (its ``num_layers`` / ``moe_router_topk`` translate the aux coefficient)."""
    if name not in _PRESETS:
        raise ConfigError(
            f"model.moe_preset={name!r} is not a preset; choose one of "
            f"{', '.join(p for p in MOE_PRESETS if p)} (or leave it empty)"
        )
    fields = dict(_PRESETS[name])
    hf_coef = fields.pop("hf_router_aux_loss_coef", None)
    if hf_coef is not None:
        topk = int(model.get("moe_router_topk", fields["moe_router_topk"]))
        layers = int(model.get("num_layers", 2))  # the schema's default
        fields["moe_aux_loss_coeff"] = mcore_aux_loss_coeff(
            hf_coef, topk, moe_layer_count(model.get("moe_layer_freq") or [], layers)
        )
    return fields


def expand_moe_preset(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` (a whole recipe mapping) with ``model.moe_preset`` expanded into ``model``'s
    fields; the recipe's explicit fields win. Warns once when the recipe's
    ``layernorm_epsilon`` differs from the family's Hugging Face default."""
    model = raw.get("model")
    if not isinstance(model, dict) or not model.get("moe_preset"):
        return raw
    name = str(model["moe_preset"])
    merged = {**preset_fields(name, model), **model}
    family_eps = FAMILY_EPSILON[name]
    eps = _number(merged["layernorm_epsilon"])
    if eps is not None and eps != family_eps:
        warnings.warn(
            f"model.layernorm_epsilon={eps:g} differs from the {name} family's Hugging Face "
            f"default {family_eps:g}; a converted checkpoint's logits will "
            "not match the reference model",
            stacklevel=2,
        )
    return {**raw, "model": merged}


def _number(value: Any) -> float | None:
    """``value`` as a float, None when it is none (the schema reports the bad value later)."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def check_moe_fields(model: Any, expert_parallel: int) -> None:
    """Cross-field MoE rules on a built ``ModelConfig``; raises ``ConfigError``."""
    m = model
    if not m.num_moe_experts:
        if m.moe_preset:
            raise ConfigError(f"model.moe_preset={m.moe_preset!r} needs model.num_moe_experts > 0")
        return
    e, k = m.num_moe_experts, m.moe_router_topk
    if k > e:
        raise ConfigError(f"model.moe_router_topk={k} exceeds model.num_moe_experts={e}")
    if m.moe_router_enable_expert_bias and m.moe_router_score_function != "sigmoid":
        raise ConfigError(
            "model.moe_router_enable_expert_bias needs model.moe_router_score_function=sigmoid "
            "(the expert bias is DeepSeek-V3's selection-only bias on sigmoid scores)"
        )
    # moe_router_pre_softmax with sigmoid scores: megatron-core ignores it (no rule here)
    groups, group_topk = m.moe_router_num_groups, m.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ConfigError(
            "model.moe_router_num_groups and model.moe_router_group_topk go together "
            "(grouped top-k); set both or neither"
        )
    if groups is not None and group_topk is not None:
        if e % groups:
            raise ConfigError(
                f"model.moe_router_num_groups={groups} does not divide model.num_moe_experts={e}"
            )
        if group_topk > groups:
            raise ConfigError(
                f"model.moe_router_group_topk={group_topk} exceeds "
                f"model.moe_router_num_groups={groups}"
            )
        if k > group_topk * (e // groups):
            raise ConfigError(
                f"model.moe_router_topk={k} exceeds the experts in the best {group_topk} "
                f"groups ({group_topk * (e // groups)})"
            )
    if m.moe_shared_expert_overlap and not m.moe_shared_expert_intermediate_size:
        raise ConfigError(
            "model.moe_shared_expert_overlap needs model.moe_shared_expert_intermediate_size"
        )
    if m.moe_shared_expert_gate and not m.moe_shared_expert_intermediate_size:
        raise ConfigError("model.moe_shared_expert_gate needs a shared expert")
    freq = m.moe_layer_freq
    if len(freq) > 1 and len(freq) != m.num_layers:
        raise ConfigError(f"model.moe_layer_freq has {len(freq)} entries for {m.num_layers} layers")
    if len(freq) > 1 and (set(freq) - {0, 1} or not any(freq)):
        raise ConfigError("model.moe_layer_freq as a list is a 0/1 pattern with at least one 1")
    if len(freq) == 1 and not 1 <= freq[0] <= m.num_layers:
        raise ConfigError(f"model.moe_layer_freq={freq[0]} must be in 1..{m.num_layers}")
    if e % expert_parallel:
        raise ConfigError(
            f"model.num_moe_experts={e} is not divisible by "
            f"parallel.expert_model_parallel_size={expert_parallel}"
        )


def mcore_layer_freq(freq: list[int]) -> int | list[int]:
    """``model.moe_layer_freq`` as megatron-core takes it: [] = every layer (1), [N] = N."""
    if not freq:
        return 1
    return freq[0] if len(freq) == 1 else list(freq)


def moe_transformer_fields(model: Any) -> dict[str, Any]:
    """The ``TransformerConfig`` keyword arguments of the MoE fields added for the presets
    (the older ones are mapped in :func:`megatron_ext.megatron.model.transformer_config`)."""
    return {
        "moe_router_pre_softmax": model.moe_router_pre_softmax,
        "moe_router_topk_scaling_factor": model.moe_router_topk_scaling_factor,
        "moe_z_loss_coeff": model.moe_z_loss_coeff,
        "moe_router_bias_update_rate": model.moe_router_bias_update_rate,
        "moe_router_num_groups": model.moe_router_num_groups,
        "moe_router_group_topk": model.moe_router_group_topk,
        "moe_shared_expert_intermediate_size": model.moe_shared_expert_intermediate_size,
        "moe_shared_expert_gate": model.moe_shared_expert_gate,
        "moe_shared_expert_overlap": model.moe_shared_expert_overlap,
        "moe_layer_freq": mcore_layer_freq(model.moe_layer_freq),
    }


def describe_moe_preset(model: Any) -> str:
    """The expanded preset of a built ``ModelConfig``, one ``field=value (source)`` per line,
    for ``--dry-run``; '' without a preset. A value differing from the preset's came from the
    recipe."""
    if not model.moe_preset:
        return ""
    fields = preset_fields(model.moe_preset, vars(model))
    lines = [f"model.moe_preset={model.moe_preset} expands to (megatron-core fields):"]
    for name, value in fields.items():
        got = getattr(model, name)
        source = "preset" if got == value else f"recipe; preset {value!r}"
        lines.append(f"  model.{name}={got!r} ({source})")
    return "\n".join(lines)
