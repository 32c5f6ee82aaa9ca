"""megatron-core -> Hugging Face: the inverse of :func:`megatron_ext.convert.hf.hf_to_mcore_state`.

Experts come out in the fused 3-D layout transformers 5 keeps in memory and saves
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]); ``linear_qkv`` is split
back from megatron-core's per-group layout.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_ext.convert.hf import split_qkv


def mcore_to_hf_state(mc: dict[str, torch.Tensor], fields: dict[str, Any]) -> dict[str, Any]:
    """HF state-dict entries (``model.`` prefix, ``lm_head``) from a megatron-core GPTModel's."""
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": mc["embedding.word_embeddings.weight"]
    }
    groups, head_dim = fields["num_query_groups"], fields["kv_channels"]
    for i in range(fields["num_layers"]):
        h, m = f"model.layers.{i}.", f"decoder.layers.{i}."
        a = h + "self_attn."
        out[h + "input_layernorm.weight"] = mc[m + "input_layernorm.weight"]
        q, k, v = split_qkv(mc[m + "self_attention.linear_qkv.weight"], groups, head_dim)
        out[a + "q_proj.weight"], out[a + "k_proj.weight"], out[a + "v_proj.weight"] = q, k, v
        out[a + "o_proj.weight"] = mc[m + "self_attention.linear_proj.weight"]
        if fields.get("qk_layernorm"):
            out[a + "q_norm.weight"] = mc[m + "self_attention.q_layernorm.weight"]
            out[a + "k_norm.weight"] = mc[m + "self_attention.k_layernorm.weight"]
        out[h + "post_attention_layernorm.weight"] = mc[m + "pre_mlp_layernorm.weight"]
        if m + "mlp.router.weight" in mc:
            out[h + "mlp.gate.weight"] = mc[m + "mlp.router.weight"]
            e = m + "mlp.experts.local_experts."
            n = fields["num_moe_experts"]
            out[h + "mlp.experts.gate_up_proj"] = torch.stack(
                [mc[f"{e}{j}.linear_fc1.weight"] for j in range(n)]
            )
            out[h + "mlp.experts.down_proj"] = torch.stack(
                [mc[f"{e}{j}.linear_fc2.weight"] for j in range(n)]
            )
        else:
            gate, up = mc[m + "mlp.linear_fc1.weight"].chunk(2)
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
            out[h + "mlp.down_proj.weight"] = mc[m + "mlp.linear_fc2.weight"]
    out["model.norm.weight"] = mc["decoder.final_layernorm.weight"]
    if fields["untie_embeddings_and_output_weights"]:
        out["lm_head.weight"] = mc["output_layer.weight"]
    return out
