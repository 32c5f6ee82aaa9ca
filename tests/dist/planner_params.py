"""Run under torchrun (gloo, 2 ranks): the parameters real GPT models hold at TP=2, EP=2, PP=2
(also with virtual stages).

For each case of :data:`CASES` every rank joins megatron-core's model-parallel groups at the
case's sizes, builds the model with :func:`megatron_ext.megatron.model.build_gpt_chunks` (local
spec; tied embeddings over stages without the initial weight copy, see :func:`_no_embedding_copy`)
and records ``named_parameters()`` as :func:`describe` does, then leaves the groups for
the next case. Rank r writes ``OUT_DIR/rank{r}.json``: ``{case: {"pp_rank": int, "params":
[[name, shape, allreduce is False, tensor_model_parallel], ...]}}``; the test compares each
with :func:`megatron_ext.planner.params.gpt_parameters` for that rank's stage.

Usage: planner_params.py OUT_DIR
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

VOCAB, SEQ = 100, 16  # tokenizer vocabulary (padded by the builder), sequence length (tokens)
WORLD = 2

_BASE: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "transformer_impl": "local",
}
_MOE: dict[str, Any] = {"num_moe_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16}
#: virtual stages on 2 pipeline ranks need it (megatron_ext.gpt.recipe)
_OVERLAP = {"overlap_p2p_comm": True, "batch_p2p_comm": False}

#: case -> (ModelConfig fields, ParallelConfig fields)
CASES: dict[str, tuple[dict[str, Any], dict[str, int]]] = {
    "tp2_swiglu_gqa_qk_projection": (
        {**_BASE, "qk_layernorm": True, "qk_layernorm_scope": "projection"},
        {"tensor_model_parallel_size": 2},
    ),
    "tp2_gelu_bias_layernorm_learned_tied_qk_head": (
        {
            **_BASE,
            "activation": "gelu",
            "add_bias_linear": True,
            "normalization": "LayerNorm",
            "position_embedding_type": "learned_absolute",
            "untie_embeddings_and_output_weights": False,
            "qk_layernorm": True,
        },
        {"tensor_model_parallel_size": 2},
    ),
    "tp2_moe_shared_gate_pattern": (
        {
            **_BASE,
            **_MOE,
            "moe_layer_freq": [0, 1],
            "moe_shared_expert_intermediate_size": 24,
            "moe_shared_expert_gate": True,
        },
        {"tensor_model_parallel_size": 2},
    ),
    "ep2_moe_bias_expert_bias": (
        {
            **_BASE,
            **_MOE,
            "add_bias_linear": True,
            "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True,
        },
        {"expert_model_parallel_size": 2},
    ),
    "ep2_moe_shared_gate": (
        {
            **_BASE,
            **_MOE,
            "moe_shared_expert_intermediate_size": 24,
            "moe_shared_expert_gate": True,
        },
        {"expert_model_parallel_size": 2},
    ),
    "pp2_dense_untied": ({**_BASE, "num_layers": 4}, {"pipeline_model_parallel_size": 2}),
    "pp2_moe_pattern": (
        {**_BASE, **_MOE, "num_layers": 4, "moe_layer_freq": [1, 0, 0, 1]},
        {"pipeline_model_parallel_size": 2},
    ),
    "pp2_tied_learned": (
        {
            **_BASE,
            "num_layers": 4,
            "untie_embeddings_and_output_weights": False,
            "position_embedding_type": "learned_absolute",
        },
        {"pipeline_model_parallel_size": 2},
    ),
    # virtual stages: 2 chunks per rank (layers 0, 2 | 1, 3 ... of 8), a MoE pattern, tied
    "pp2_vp2_tied_moe_pattern": (
        {
            **_BASE,
            **_MOE,
            "num_layers": 8,
            "moe_layer_freq": [1, 0, 0, 1, 1, 0, 1, 0],
            "untie_embeddings_and_output_weights": False,
            "transformer_config": _OVERLAP,
        },
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
    ),
    # 6 layers + the embedding + the loss over 2 x 4 chunks: one holds only the embedding
    "pp2_vp4_embedding_and_loss_counted": (
        {
            **_BASE,
            "num_layers": 6,
            "transformer_config": {
                **_OVERLAP,
                "account_for_embedding_in_pipeline_split": True,
                "account_for_loss_in_pipeline_split": True,
            },
        },
        {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 4},
    ),
}


def describe(module: Any) -> list[list[Any]]:
    """``module.named_parameters()`` as [name, shape, allreduce is False, tensor_model_parallel,
    partition_dim (None unless split)]."""
    return [
        [
            name,
            list(p.shape),
            not getattr(p, "allreduce", True),
            bool(getattr(p, "tensor_model_parallel", False)),
            p.partition_dim if getattr(p, "tensor_model_parallel", False) else None,
        ]
        for name, p in module.named_parameters()
    ]


def _no_embedding_copy(model: Any, parallel: Any) -> contextlib.AbstractContextManager:
    """Tied embeddings over pipeline stages: megatron-core copies the first stage's word
    embedding into the last stage's output layer with an all-reduce on ``weight.data.cuda()``,
    which a CPU host cannot run; skipping that copy changes values only, no parameter."""
    if model.untie_embeddings_and_output_weights or parallel.pipeline_model_parallel_size == 1:
        return contextlib.nullcontext()
    from megatron.core.models.common.language_module.language_module import LanguageModule

    return mock.patch.object(LanguageModule, "_is_in_embd_group", lambda self: False)


def main(out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
    from megatron_ext.megatron.cpu_compat import apply_cpu_compat
    from megatron_ext.megatron.model import build_gpt_chunks
    from megatron_ext.megatron.optimizer_factories import chunk_root
    from tests.dist.ending import leave

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    apply_cpu_compat()
    got: dict[str, Any] = {}
    for case, (fields, sizes) in CASES.items():
        parallel = ParallelConfig(**sizes)
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
        )
        model_parallel_cuda_manual_seed(1234)
        model = ModelConfig(**fields)
        with _no_embedding_copy(model, parallel):
            chunks = build_gpt_chunks(model, parallel, "fp32", VOCAB, SEQ)
        got[case] = {
            "pp_rank": parallel_state.get_pipeline_model_parallel_rank(),
            "params": describe(chunk_root(chunks)),  # chunk<v>. names, as the trainer's
        }
        parallel_state.destroy_model_parallel()
    Path(out_dir, f"rank{dist.get_rank()}.json").write_text(json.dumps(got))
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
