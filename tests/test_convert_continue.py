"""Continue training a converted model: a tiny random HF OLMoE (byte vocabulary) -> ``convert
hf-to-mcore`` -> ``megatron-ext train OUT/recipe.yaml`` with Muon. The first step's loss is the
HF model's loss on the same batch (so the trainer started from the converted weights), and a few
steps lower it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import OlmoeConfig, OlmoeForCausalLM

from megatron_ext.config.load import read_recipe
from megatron_ext.convert.cli import convert_main
from megatron_ext.data import build_tokenizer
from megatron_ext.gpt.setup import build_data
from megatron_ext.run.metrics import read_jsonl
from megatron_ext.schedules.plan import training_schedule
from tests.conftest import run_torchrun

STEPS = 8


def _hf_olmoe(vocab_size: int) -> OlmoeForCausalLM:
    torch.manual_seed(0)
    config = OlmoeConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        tie_word_embeddings=False,
        pad_token_id=None,
        eos_token_id=None,
        # far from megatron-core's init (std 0.02): a fresh model would not give the HF loss
        initializer_range=0.1,
    )
    return OlmoeForCausalLM(config).eval()


def _hf_loss(hf: torch.nn.Module, samples: list[dict]) -> float:
    """The batch's mean loss per token (float64 cross entropy of the HF logits, loss mask)."""
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).double()
    with torch.no_grad():
        logits = hf(input_ids=tokens).logits.double()  # [b, s, vocab]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return float((ce * mask).sum() / mask.sum())


def test_training_continues_from_a_converted_olmoe(tmp_path: Path) -> None:
    tokenizer = build_tokenizer("byte", "")
    hf = _hf_olmoe(tokenizer.vocab_size)
    hf_dir, out = tmp_path / "hf", tmp_path / "mcore"
    hf.save_pretrained(hf_dir)
    args = argparse.Namespace(convert_command="hf-to-mcore", hf_dir=hf_dir, out=out)
    assert convert_main(args) == 0
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        f"data.path={tmp_path / 'data' / 'stdlib'}",
        "data.source=[python-stdlib]",
        "optimizer.name=muon",
        "optimizer.lr=0.01",
        f"training.steps={STEPS}",
        "training.micro_batch_size=4",
        "training.global_batch_size=4",
        "training.seq_length=64",
        "training.lr_warmup_steps=0",
        "training.eval_iters=0",
        "checkpoint.save_at_end=false",
    ]
    recipe = read_recipe(out / "recipe.yaml", overrides)
    assert recipe.checkpoint.load == str((out / "step_000000").resolve())
    assert recipe.model.num_moe_experts == 8 and recipe.model.qk_layernorm_scope == "projection"
    proc = run_torchrun(
        "megatron_ext.launch.cli", 1, "train", str(out / "recipe.yaml"), *overrides, module=True
    )
    assert f"initial weights from {out / 'step_000000'}" in proc.stdout
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == STEPS

    # The same first batch as the trainer's (its dataset, built by the trainer's own function)
    train_data, _ = build_data(recipe, tokenizer, training_schedule(recipe))
    expected = _hf_loss(hf, [train_data[i] for i in range(4)])
    print(f"first loss {losses[0]:.7f}, HF {expected:.7f}; after {STEPS} steps {losses[-1]:.4f}")
    assert losses[0] == pytest.approx(expected, rel=1e-5, abs=1e-5)  # fp32 forward
    assert losses[-1] < losses[0] - 0.3, losses
