"""HF -> megatron-core parity on tiny random models (fp32, CPU): logits max abs diff <= 1e-4,
cosine >= 0.99999, identical argmax, identical selected experts per layer; the reference is
Hugging Face transformers' own model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
)

from megatron_ext.convert.hf import hf_to_mcore_state, model_fields
from megatron_ext.convert.parity import build_mcore, compare
from tests.hf_tiny import TINY_SIZES, tiny_qwen3_moe

SIZES = dict(**TINY_SIZES, head_dim=8, rms_norm_eps=1e-6)


def _qwen3(norm_topk_prob: bool = True, rms_norm_eps: float = 1e-6) -> torch.nn.Module:
    return tiny_qwen3_moe(
        head_dim=8,
        rms_norm_eps=rms_norm_eps,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _olmoe() -> torch.nn.Module:
    """OLMoE: q/k norm over the whole projection, softmax then top-k without renormalising."""
    torch.manual_seed(0)
    sizes = {k: v for k, v in SIZES.items() if k != "head_dim"}
    config = OlmoeConfig(
        **{**sizes, "rms_norm_eps": 1e-5, "intermediate_size": 16},
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        pad_token_id=None,
        eos_token_id=None,
    )
    return OlmoeForCausalLM(config).eval()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**SIZES)).eval()


def _convert(hf: torch.nn.Module) -> torch.nn.Module:
    raw = hf.config.to_dict()
    fields = model_fields(raw, raw["rms_norm_eps"])
    return build_mcore(fields, hf_to_mcore_state(hf.state_dict(), fields))


@pytest.mark.parametrize(
    "make",
    [_llama, _qwen3, lambda: _qwen3(norm_topk_prob=False), _olmoe],
    ids=["llama", "qwen3", "qwen3-no-renorm", "olmoe"],
)
def test_hf_to_mcore_logit_and_routing_parity(make) -> None:
    hf = make()
    gpt = _convert(hf)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    figures = compare(hf, gpt, tokens)
    print(figures)
    assert figures["max_abs_diff"] <= 1e-4, figures
    assert figures["cosine"] >= 0.99999, figures
    assert figures["argmax_agreement"] == 1.0, figures
    assert all(a == 1.0 for a in figures["expert_selection_agreement"]), figures


def _gate(figures: dict) -> bool:
    """The scale-free part of the parity gate (cosine, argmax): the absolute tolerance depends
    on the logits' size, which the variance changes."""
    return figures["cosine"] >= 0.99999 and figures["argmax_agreement"] == 1.0


@pytest.mark.parametrize(("variance", "gate_passes"), [(1e-5, False), (1e-2, True)])
def test_epsilon_ten_times_too_small_fails_the_gate_only_near_epsilon_variance(
    variance: float, gate_passes: bool
) -> None:
    """Negative control: HF says 1e-5 (OLMoE's default), the engine assumes 1e-6. With the
    embedding variance near the epsilon (as in OLMoE's real weights) the gate must fail; with
    variance 1e-2 the epsilon must not matter."""
    hf = _qwen3(rms_norm_eps=1e-5)
    with torch.no_grad():
        embed = hf.model.embed_tokens.weight
        embed.mul_(variance**0.5 / embed.std())
    fields = model_fields(hf.config.to_dict(), eps=1e-6)
    gpt = build_mcore(fields, hf_to_mcore_state(hf.state_dict(), fields))
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    figures = compare(hf, gpt, tokens)
    print(variance, figures)
    assert _gate(figures) is gate_passes, figures
    # the failure is the cosine itself, not only the absolute tolerance
    assert (figures["cosine"] >= 0.99999) is gate_passes, figures


@pytest.mark.parametrize("make", [_llama, _qwen3, _olmoe], ids=["llama", "qwen3", "olmoe"])
def test_round_trip_mcore_hf_mcore_is_bit_identical(make) -> None:
    """HF -> mcore -> HF gives HF's own tensors back, and the HF model built from the
    converted-back state loads it strictly and equals the original bit for bit."""
    from megatron_ext.convert.to_hf import mcore_to_hf_state

    hf = make()
    fields = model_fields(hf.config.to_dict(), hf.config.rms_norm_eps)
    gpt = build_mcore(fields, hf_to_mcore_state(hf.state_dict(), fields))
    mc = {k: v for k, v in gpt.state_dict().items() if not k.endswith("_extra_state")}
    back = mcore_to_hf_state(mc, fields)
    original = hf.state_dict()
    assert set(back) == set(original)
    assert all(torch.equal(back[k], original[k]) for k in original)
    again = hf_to_mcore_state(back, fields)
    assert set(again) == set(mc) - {k for k in mc if "expert_bias" in k}
    assert all(torch.equal(again[k], mc[k]) for k in again)
