"""``model.moe_preset``: expansion into megatron-core fields (explicit fields win), the aux-loss
translation, the epsilon warning, up-front validation (ConfigError in-process, exit 2 from the
command line) and the ``TransformerConfig`` megatron-core builds from each preset."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from megatron_ext.config.load import read_recipe
from megatron_ext.config.moe_presets import (
    hf_aux_loss_coeff,
    mcore_aux_loss_coeff,
    mcore_layer_freq,
    moe_layer_count,
)
from megatron_ext.errors import ConfigError

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")

TINY = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.num_attention_heads=4",
    "model.num_moe_experts=8",
    "model.moe_router_topk=2",
    "model.moe_ffn_hidden_size=32",
]


def _recipe(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no epsilon warning unless a test asks for one
        recipe = read_recipe("tiny_cpu_gpt", list(overrides))
    recipe.check()
    return recipe


def test_olmoe_preset_expands_and_explicit_fields_win() -> None:
    m = _recipe("model.moe_preset=olmoe", "model.num_layers=16").model
    assert (m.num_moe_experts, m.moe_router_topk) == (64, 8)
    assert m.moe_router_pre_softmax and m.moe_router_score_function == "softmax"
    assert m.qk_layernorm and m.qk_layernorm_scope == "projection"
    assert m.layernorm_epsilon == 1e-5
    # HF 0.01 over 16 concatenated layers, k=8 -> megatron-core 0.01 * 8 / 16 per layer
    assert m.moe_aux_loss_coeff == pytest.approx(0.005)
    m = _recipe("model.moe_preset=olmoe", *TINY, "model.moe_aux_loss_coeff=0.5").model
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_aux_loss_coeff) == (8, 2, 0.5)


def test_qwen3_and_deepseek_presets() -> None:
    q = _recipe("model.moe_preset=qwen3_moe", "model.num_layers=48").model
    assert (q.num_moe_experts, q.moe_router_topk, q.qk_layernorm_scope) == (128, 8, "head")
    assert not q.moe_router_pre_softmax and q.layernorm_epsilon == 1e-6
    assert q.moe_aux_loss_coeff == pytest.approx(0.001 * 8 / 48)
    d = _recipe("model.moe_preset=deepseek_v3", "model.layernorm_epsilon=1e-6").model
    assert d.moe_router_score_function == "sigmoid" and d.moe_router_enable_expert_bias
    assert d.moe_router_load_balancing_type == "seq_aux_loss" and d.moe_aux_loss_coeff == 1e-4
    assert (d.moe_router_num_groups, d.moe_router_group_topk) == (8, 4)
    assert d.moe_shared_expert_intermediate_size == 2048


def test_aux_coefficient_translation_round_trips() -> None:
    assert mcore_aux_loss_coeff(0.01, 8, 16) == pytest.approx(0.005)
    assert hf_aux_loss_coeff(mcore_aux_loss_coeff(0.003, 6, 27), 6, 27) == pytest.approx(0.003)
    assert mcore_layer_freq([]) == 1 and mcore_layer_freq([2]) == 2
    assert mcore_layer_freq([0, 1]) == [0, 1]


def test_the_aux_translation_counts_moe_layers_only() -> None:
    """HF concatenates the router logits of the MoE layers: L is their count."""
    assert moe_layer_count([], 6) == 6 and moe_layer_count([2], 5) == 3
    assert moe_layer_count([1, 0, 1, 1], 4) == 3
    q = _recipe("model.moe_preset=qwen3_moe", "model.num_layers=4", "model.moe_layer_freq=[2]")
    assert q.model.moe_aux_loss_coeff == pytest.approx(0.001 * 8 / 2)  # layers 1 and 3


def test_epsilon_differing_from_family_default_warns_with_both_values() -> None:
    with pytest.warns(UserWarning, match=r"=1e-06 .*olmoe.* 1e-05"):
        read_recipe("tiny_cpu_gpt", ["model.moe_preset=olmoe", "model.layernorm_epsilon=1e-6"])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.moe_router_topk=9"], "exceeds model.num_moe_experts=8"),
        (["model.moe_router_enable_expert_bias=true"], "needs model.moe_router_score_function"),
        (
            ["model.moe_router_num_groups=3", "model.moe_router_group_topk=1"],
            "does not divide",
        ),
        (["model.moe_router_num_groups=4"], "go together"),
        (
            [
                "model.moe_router_num_groups=4",
                "model.moe_router_group_topk=1",
                "model.moe_router_topk=3",
            ],
            "best 1 groups",
        ),
        (["model.moe_shared_expert_overlap=true"], "needs model.moe_shared_expert_inter"),
        (["model.moe_layer_freq=[1,0,1]"], "3 entries for 2 layers"),
        (["parallel.expert_model_parallel_size=3"], "not divisible"),
    ],
)
def test_bad_moe_fields_stop_up_front(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        _recipe(*TINY, *overrides)


def test_pre_softmax_with_sigmoid_scores_is_accepted_as_megatron_core_ignores_it() -> None:
    """megatron-core's topk_routing_with_score_function reads use_pre_softmax only for softmax
    scores (the DeepSeek-V3 scripts pass both): no rule of megatron-ext's own refuses it."""
    recipe = _recipe(
        *TINY, "model.moe_router_pre_softmax=true", "model.moe_router_score_function=sigmoid"
    )
    assert recipe.model.moe_router_pre_softmax is True


def test_unknown_preset_is_refused() -> None:
    with pytest.raises(ConfigError, match="moe_preset"):
        _recipe("model.moe_preset=mixtral")


def test_bad_preset_recipe_exits_2_before_any_process(tmp_path: Path) -> None:
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(
        yaml.safe_dump({"model": {"moe_preset": "qwen3_moe", "moe_router_topk": 200}})
    )
    proc = subprocess.run(
        [str(MEGATRON_EXT), "launch", str(recipe), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "moe_router_topk=200 exceeds model.num_moe_experts=128" in proc.stderr


@pytest.mark.parametrize("preset", ["olmoe", "qwen3_moe", "deepseek_v3"])
def test_megatron_core_accepts_each_preset(preset: str) -> None:
    from megatron_ext.megatron.model import transformer_config

    extra = ["model.moe_router_num_groups=4", "model.moe_router_group_topk=2"]
    recipe = _recipe(
        f"model.moe_preset={preset}",
        *TINY,
        "model.moe_shared_expert_intermediate_size=32",
        *(extra if preset == "deepseek_v3" else []),
    )
    config = transformer_config(recipe.model, recipe.parallel, "fp32")
    m = recipe.model
    assert config.num_moe_experts == 8 and config.moe_router_topk == 2
    assert config.moe_router_pre_softmax == m.moe_router_pre_softmax
    assert config.moe_router_score_function == m.moe_router_score_function
    assert config.moe_router_enable_expert_bias == m.moe_router_enable_expert_bias
    assert config.moe_z_loss_coeff == m.moe_z_loss_coeff
    assert config.moe_aux_loss_coeff == m.moe_aux_loss_coeff


def test_describe_names_each_expanded_field_and_its_source() -> None:
    from megatron_ext.config.moe_presets import describe_moe_preset

    text = describe_moe_preset(_recipe("model.moe_preset=olmoe", *TINY).model)
    assert "model.moe_router_pre_softmax=True (preset)" in text
    assert "model.num_moe_experts=8 (recipe; preset 64)" in text
    assert describe_moe_preset(_recipe().model) == ""
