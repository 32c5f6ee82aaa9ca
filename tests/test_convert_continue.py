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
from tests.hf_tiny import tiny_qwen3_moe

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


def hf_batch_loss(hf: torch.nn.Module, samples: list[dict]) -> float:
    """The batch's mean loss per token (float64 cross entropy of the HF logits, loss mask)."""
    tokens = torch.stack([torch.as_tensor(s["tokens"]) for s in samples]).long()
    labels = torch.stack([torch.as_tensor(s["labels"]) for s in samples]).long()
    mask = torch.stack([torch.as_tensor(s["loss_mask"]) for s in samples]).double()
    with torch.no_grad():
        logits = hf(input_ids=tokens).logits.double()  # [b, s, vocab]
    ce = torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none")
    return float((ce * mask).sum() / mask.sum())


def _continue(tmp_path: Path, hf: torch.nn.Module, source: str) -> list[float]:
    """Convert ``hf`` (saved in tmp_path/hf beside whatever tokenizer files are there), train
    STEPS from OUT/recipe.yaml on ``source``, and check the first loss against the HF model's
    on the trainer's own first batch (built with the recipe's tokenizer); returns the losses."""
    hf_dir, out = tmp_path / "hf", tmp_path / "mcore"
    hf.save_pretrained(hf_dir)
    args = argparse.Namespace(convert_command="hf-to-mcore", hf_dir=hf_dir, out=out)
    assert convert_main(args) == 0
    overrides = [
        f"run_dir={tmp_path / 'run'}",
        f"data.path={tmp_path / 'data' / 'corpus'}",
        f"data.source=[{source}]",
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
    proc = run_torchrun(
        "megatron_ext.launch.cli", 1, "train", str(out / "recipe.yaml"), *overrides, module=True
    )
    assert f"initial weights from {out / 'step_000000'}" in proc.stdout
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(losses) == STEPS

    # The same first batch as the trainer's (its dataset, built by the trainer's own function)
    tokenizer = build_tokenizer(recipe.data.tokenizer, recipe.data.tokenizer_model)
    train_data, _ = build_data(
        recipe, tokenizer, training_schedule(recipe.training, recipe.optimizer)
    )
    expected = hf_batch_loss(hf, [train_data[i] for i in range(4)])
    print(f"first loss {losses[0]:.7f}, HF {expected:.7f}; after {STEPS} steps {losses[-1]:.4f}")
    assert losses[0] == pytest.approx(expected, rel=1e-5, abs=1e-5)  # fp32 forward
    return losses


def test_training_continues_from_a_converted_olmoe(tmp_path: Path) -> None:
    hf = _hf_olmoe(build_tokenizer("byte", "").vocab_size)
    losses = _continue(tmp_path, hf, "python-stdlib")
    recipe = read_recipe(tmp_path / "mcore" / "recipe.yaml")
    assert recipe.model.num_moe_experts == 8 and recipe.model.qk_layernorm_scope == "projection"
    assert recipe.data.tokenizer == "byte"  # no tokenizer files came with the model
    assert losses[-1] < losses[0] - 0.3, losses


def test_a_converted_model_continues_on_real_text_with_its_own_tokenizer(tmp_path: Path) -> None:
    """The HF folder holds the model's tokenizer (a BPE trained here, saved by
    save_pretrained): hf-to-mcore copies it to OUT/tokenizer, the recipe reads it, the run
    builds its dataset of python-docs text with it, and the first loss is the HF model's on
    that batch of the tokenizer's ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from megatron_ext.data.corpus import iter_documents

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<|endoftext|>"])
    bpe.train_from_iterator(list(iter_documents(["python-docs"]))[:300], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.save_pretrained(tmp_path / "hf")
    hf = _hf_olmoe(len(fast))
    out = tmp_path / "mcore"
    losses = _continue(tmp_path, hf, "python-docs")
    recipe = read_recipe(out / "recipe.yaml")
    assert (recipe.data.tokenizer, recipe.data.tokenizer_model) == (
        "huggingface",
        str((out / "tokenizer").resolve()),
    )
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (
        tmp_path / "hf" / "tokenizer.json"
    ).read_bytes()
    assert losses[-1] < losses[0], losses


def test_mcore_to_hf_from_a_recipe_and_its_checkpoint_round_trips_qwen3_moe(tmp_path) -> None:
    """The --recipe path on a qwen3_moe preset recipe (a dense layer, renormalised top-k,
    head_dim != hidden/heads): hf-to-mcore's weights folder is a dist_checkpointing checkpoint
    with the GPT trainer's ``model`` keys; converting it back with the recipe alone gives the
    original HF config fields and bit-identical weights."""
    from transformers import Qwen3MoeForCausalLM

    hf = tiny_qwen3_moe(
        head_dim=16, mlp_only_layers=[1], router_aux_loss_coef=0.02, rms_norm_eps=1e-6
    )
    hf_dir, out, back = tmp_path / "hf", tmp_path / "mcore", tmp_path / "back"
    hf.save_pretrained(hf_dir)
    to_mcore = argparse.Namespace(convert_command="hf-to-mcore", hf_dir=hf_dir, out=out)
    assert convert_main(to_mcore) == 0
    recipe = [str(out / "recipe.yaml"), "model.moe_preset=qwen3_moe"]
    to_hf = argparse.Namespace(
        convert_command="mcore-to-hf", mcore_ckpt=out / "step_000000", out=back, recipe=recipe
    )
    assert convert_main(to_hf) == 0
    got = Qwen3MoeForCausalLM.from_pretrained(back)
    for key in (
        "hidden_size", "intermediate_size", "moe_intermediate_size", "num_key_value_heads",
        "head_dim", "num_experts", "num_experts_per_tok", "norm_topk_prob", "mlp_only_layers",
        "rms_norm_eps", "tie_word_embeddings", "vocab_size",
    ):  # fmt: skip
        assert getattr(got.config, key) == getattr(hf.config, key), key
    assert got.config.router_aux_loss_coef == pytest.approx(0.02, rel=1e-12)
    # the dense layer (mlp_only_layers) is a dense MLP in megatron-core too: logit parity
    from megatron_ext.convert.cli import load_mcore
    from megatron_ext.convert.parity import compare

    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    figures = compare(got.eval(), load_mcore(out), tokens)
    assert figures["max_abs_diff"] <= 1e-4 and figures["argmax_agreement"] == 1.0, figures
    assert figures["expert_selection_agreement"] == [1.0], figures  # the one MoE layer
    original = Qwen3MoeForCausalLM.from_pretrained(hf_dir).state_dict()
    state = got.state_dict()
    assert set(state) == set(original)
    assert all(torch.equal(state[k], original[k]) for k in original)


def test_mcore_to_hf_refuses_what_the_hf_family_cannot_express() -> None:
    from types import SimpleNamespace

    from megatron_ext.convert.from_trainer import hf_config_fields
    from megatron_ext.errors import ConfigError

    built = SimpleNamespace(moe_layer_freq=1, num_layers=2)
    deepseek = read_recipe("moe_tiny_cpu", ["model.moe_preset=deepseek_v3"])
    with pytest.raises(ConfigError, match=r"deepseek_v3.*no Hugging Face family"):
        hf_config_fields(deepseek, built, 384)
    sigmoid = read_recipe(
        "moe_tiny_cpu", ["model.moe_router_score_function=sigmoid", "model.moe_layer_freq=[1,0]"]
    )
    with pytest.raises(ConfigError, match=r"sigmoid.*OLMoE has no dense layers"):
        hf_config_fields(sigmoid, SimpleNamespace(moe_layer_freq=[1, 0], num_layers=2), 384)
