"""The planner's parameter list (megatron_ext.planner.params) equals the real model's.

Each case builds megatron-core's GPTModel with this project's builder (local spec, CPU) and
compares ``named_parameters()`` -- name, shard shape, ``allreduce=False``,
``tensor_model_parallel`` -- with :func:`gpt_parameters`, exactly and in order: one rank
in-process, and TP=2 / EP=2 / PP=2 under torchrun (``tests/dist/planner_params.py``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.config.moe_presets import expand_moe_preset
from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
from megatron_ext.planner.params import gpt_parameters
from tests.conftest import DIST, run_torchrun
from tests.dist.planner_params import CASES, SEQ, VOCAB, WORLD, describe

_BASE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "transformer_impl": "local",
}

SINGLE: dict[str, dict[str, Any]] = {
    "dense_swiglu_gqa_untied": {**_BASE, "num_query_groups": 2},
    "dense_kv_channels_ffn": {**_BASE, "kv_channels": 12, "ffn_hidden_size": 40},
    "gelu_bias_layernorm_learned_tied": {
        **_BASE,
        "activation": "gelu",
        "add_bias_linear": True,
        "normalization": "LayerNorm",
        "position_embedding_type": "learned_absolute",
        "untie_embeddings_and_output_weights": False,
    },
    "qk_layernorm_head": {**_BASE, "num_query_groups": 2, "qk_layernorm": True},
    "qk_layernorm_head_layernorm": {
        **_BASE,
        "qk_layernorm": True,
        "normalization": "LayerNorm",
    },
    "qk_layernorm_projection": {
        **_BASE,
        "num_query_groups": 2,
        "qk_layernorm": True,
        "qk_layernorm_scope": "projection",
    },
    "moe_topk_ffn_pattern_shared_gate": {
        **_BASE,
        "num_layers": 3,
        "num_moe_experts": 4,
        "moe_router_topk": 3,
        "moe_ffn_hidden_size": 16,
        "moe_layer_freq": [1, 0, 1],
        "moe_shared_expert_intermediate_size": 24,
        "moe_shared_expert_gate": True,
    },
    "moe_one_in_two_bias_expert_bias": {
        **_BASE,
        "num_layers": 4,
        "num_moe_experts": 2,
        "moe_layer_freq": [2],
        "add_bias_linear": True,
        "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True,
    },
}

# Each preset expanded as the recipe loader expands it, at tiny sizes (explicit fields win).
PRESETS: dict[str, dict[str, Any]] = {
    "olmoe": {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16},
    "qwen3_moe": {
        "num_moe_experts": 4,
        "moe_router_topk": 2,
        "moe_ffn_hidden_size": 16,
        "num_query_groups": 2,
    },
    "deepseek_v3": {
        "num_moe_experts": 8,
        "moe_router_topk": 2,
        "moe_router_num_groups": 4,
        "moe_router_group_topk": 2,
        "moe_ffn_hidden_size": 16,
        "moe_shared_expert_intermediate_size": 32,
    },
}


def preset_model(name: str) -> ModelConfig:
    raw = {"model": {**_BASE, "moe_preset": name, **PRESETS[name]}}
    return ModelConfig(**expand_moe_preset(raw)["model"])


def planned(model: ModelConfig, parallel: ParallelConfig, pp_rank: int = 0) -> list[list[Any]]:
    params = gpt_parameters(model, parallel, vocab_size=VOCAB, pp_rank=pp_rank, seq_length=SEQ)
    return [
        [p.name, list(p.shape), p.is_expert, p.tensor_parallel, p.partition_dim] for p in params
    ]


def built(model: ModelConfig) -> Any:
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.megatron.model import build_gpt_model

    init_single_process()  # one-rank gloo group and parallel_state (idempotent)
    return build_gpt_model(model, ParallelConfig(), "fp32", VOCAB, SEQ)


def assert_same(model: ModelConfig, parallel: ParallelConfig, pp_rank: int, real: list) -> None:
    plan = planned(model, parallel, pp_rank)
    assert plan == real
    numel = sum(
        p.numel
        for p in gpt_parameters(model, parallel, vocab_size=VOCAB, pp_rank=pp_rank, seq_length=SEQ)
    )
    shapes = [row[1] for row in real]
    assert numel == sum(_product(s) for s in shapes)


def _product(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("case", sorted(SINGLE))
def test_one_rank_matches_the_built_model(case: str) -> None:
    model = ModelConfig(**SINGLE[case])
    assert_same(model, ParallelConfig(), 0, describe(built(model)))


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_each_moe_preset_matches_the_built_model(preset: str) -> None:
    model = preset_model(preset)
    assert model.num_moe_experts == PRESETS[preset]["num_moe_experts"]
    assert_same(model, ParallelConfig(), 0, describe(built(model)))


@pytest.fixture(scope="module")
def two_rank_params(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("planner_params")
    run_torchrun(DIST / "planner_params.py", WORLD, str(out))
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_match_each_ranks_model(case: str, two_rank_params: list[dict]) -> None:
    fields, sizes = CASES[case]
    model, parallel = ModelConfig(**fields), ParallelConfig(**sizes)
    stages = set()
    for rank in two_rank_params:
        got = rank[case]
        stages.add(got["pp_rank"])
        assert_same(model, parallel, got["pp_rank"], got["params"])
    assert stages == set(range(parallel.pipeline_model_parallel_size))  # every stage compared


# (model fields, parallel fields, the field the planner names, what the builder says)
REFUSED: dict[str, tuple[dict[str, Any], dict[str, int], str, str]] = {
    "topk1_softmax": (
        {**_BASE, "num_moe_experts": 2, "moe_router_topk": 1},
        {},
        "model.moe_router_topk",
        "pre-softmax",
    ),
    "layers_over_stages": (
        {**_BASE, "num_layers": 3},
        {"pipeline_model_parallel_size": 2},
        "model.num_layers",
        "divisible",
    ),
    "heads_over_tp": (
        {**_BASE},
        {"tensor_model_parallel_size": 3},
        "parallel.tensor_model_parallel_size",
        "tensor_model_parallel_size",
    ),
    "expert_bias_softmax": (
        {**_BASE, "num_moe_experts": 2, "moe_router_enable_expert_bias": True},
        {},
        "model.moe_router_enable_expert_bias",
        "sigmoid",
    ),
    "moe_bias_shared_expert": (
        {
            **_BASE,
            "num_moe_experts": 2,
            "add_bias_linear": True,
            "moe_shared_expert_intermediate_size": 16,
        },
        {},
        "model.add_bias_linear",
        "bias is not supported in the shared experts",
    ),
    "ep_without_experts": (
        {**_BASE},
        {"expert_model_parallel_size": 2},
        "parallel.expert_model_parallel_size",
        "num_moe_experts",
    ),
    "moe_bias_tp2": (
        {**_BASE, "num_moe_experts": 2, "add_bias_linear": True},
        {"tensor_model_parallel_size": 2},
        "model.add_bias_linear",
        "ETP==1",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_the_builder_refuses_is_refused_naming_the_field(case: str) -> None:
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.megatron.model import build_gpt_model

    init_single_process()  # a refusal the builder makes only while building the layers
    fields, sizes, field, builder_says = REFUSED[case]
    model, parallel = ModelConfig(**fields), ParallelConfig(**sizes)
    with pytest.raises((ValueError, AssertionError), match=builder_says):
        build_gpt_model(model, parallel, "fp32", VOCAB, SEQ)
    with pytest.raises(ValueError, match=re.escape(field)):
        gpt_parameters(model, parallel, vocab_size=VOCAB, seq_length=SEQ)


def test_unexpanded_preset_and_missing_seq_length_are_refused() -> None:
    with pytest.raises(ValueError, match=re.escape("model.moe_preset")):
        gpt_parameters(ModelConfig(moe_preset="olmoe"), ParallelConfig(), vocab_size=VOCAB)
    learned = ModelConfig(position_embedding_type="learned_absolute")
    with pytest.raises(ValueError, match="seq_length"):
        gpt_parameters(learned, ParallelConfig(), vocab_size=VOCAB)


#: (num_layers, stages, model.transformer_config): megatron-core's split rules without
#: virtual stages
SPLITS = [
    (8, 4, {}),
    (6, 4, {"account_for_embedding_in_pipeline_split": True,
            "account_for_loss_in_pipeline_split": True}),
    (7, 4, {"account_for_embedding_in_pipeline_split": True}),
    (3, 2, {"account_for_embedding_in_pipeline_split": True}),
    (10, 4, {"num_layers_in_first_pipeline_stage": 1, "num_layers_in_last_pipeline_stage": 3}),
    (8, 3, {"num_layers_in_first_pipeline_stage": 2}),
    (5, 2, {"num_layers_in_last_pipeline_stage": 1}),
]  # fmt: skip


@pytest.mark.parametrize(("layers", "stages", "fields"), SPLITS)
def test_stage_layers_are_megatron_cores_split(layers: int, stages: int, fields: dict) -> None:
    """Each stage's layers, as megatron-core's own ``get_num_layers_to_build`` and
    ``get_transformer_layer_offset`` give them for that rank (its uneven splits included)."""
    import torch
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    from megatron_ext.planner.params import stage_layers

    model = ModelConfig(num_layers=layers, hidden_size=64, transformer_config=fields)
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=stages,
        pipeline_dtype=torch.float32,
        **fields,
    )
    for rank in range(stages):
        offset = get_transformer_layer_offset(config, pp_rank=rank)
        count = get_num_layers_to_build(config, pp_rank=rank)
        assert stage_layers(model, stages, rank) == range(offset, offset + count), rank


def test_a_tied_embedding_over_stages_is_sharded_alone_as_the_trainer_does() -> None:
    """Tied word embeddings over two pipeline stages: the first stage's embedding and the last
    stage's output-layer copy are marked (megatron-core's ``shared_embedding``), and the
    planned element-sharded AdamW gives each a bucket of its own, as the trainer's
    ``ShardedAdamW`` does, so the two copies split alike over the data-parallel ranks."""
    from megatron_ext.planner.ownership import optimizer_layout

    model = ModelConfig(num_layers=2, untie_embeddings_and_output_weights=False)
    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    first, last = (
        gpt_parameters(model, parallel, vocab_size=VOCAB, pp_rank=r, seq_length=SEQ) for r in (0, 1)
    )
    tied = {p.name for p in first + last if p.shared_embedding}
    assert tied == {"embedding.word_embeddings.weight", "output_layer.weight"}
    splits = []
    for params, name in (
        (first, "embedding.word_embeddings.weight"),
        (last, "output_layer.weight"),
    ):
        layout = optimizer_layout(params, "adamw", {"adamw": {}}, dp=2, edp=2, bf16=False)
        (bucket,) = [b for b in layout.dense_shards if name in b.members]
        assert bucket.members == (name,)
        splits.append(bucket.counts)
    assert splits[0] == splits[1]
    untied = gpt_parameters(ModelConfig(num_layers=2), parallel, vocab_size=VOCAB, pp_rank=0)
    assert not any(p.shared_embedding for p in untied)  # untied, or one stage: nothing shared
