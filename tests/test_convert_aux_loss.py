"""The aux-loss convention translation: HF's concatenated Switch loss times
``router_aux_loss_coef`` equals megatron-core's per-layer loss times the translated
``moe_aux_loss_coeff = hf * k / L`` (one MoE layer: exact)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from megatron_ext.convert.hf import hf_to_mcore_state, model_fields
from megatron_ext.convert.parity import build_mcore, mcore_logits
from tests.hf_tiny import tiny_qwen3_moe


def test_aux_loss_equal_after_translation() -> None:
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

    hf = tiny_qwen3_moe(num_hidden_layers=1, router_aux_loss_coef=0.01)
    fields = model_fields(hf.config.to_dict(), 1e-6)
    assert fields["moe_aux_loss_coeff"] == pytest.approx(0.01 * 2 / 1)
    gpt = build_mcore(fields, hf_to_mcore_state(hf.state_dict(), fields))
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_aux = hf(input_ids=tokens, output_router_logits=True).aux_loss
    tracker = get_moe_metrics_tracker()
    tracker.clear()
    gpt.train()  # megatron-core computes the aux loss only when training with grad
    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    gpt(tokens, positions, attention_mask=None)
    recorded = tracker.metrics["load_balancing_loss"].values  # per layer, without the coeff
    gpt.eval()
    hf_total = hf.config.router_aux_loss_coef * float(hf_aux)
    mcore_total = fields["moe_aux_loss_coeff"] * float(recorded.sum())
    print(hf_total, mcore_total)
    assert mcore_total == pytest.approx(hf_total, rel=1e-5)
    assert mcore_logits(gpt, tokens).shape[:2] == (2, 12)
