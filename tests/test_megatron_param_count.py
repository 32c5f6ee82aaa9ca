"""The parameter count of converted examples against Megatron-LM's own model, on the meta device.

Megatron-LM's side: its namespace for the flags (``parse_args`` + ``validate_args``), then
``gpt_config_from_args`` and the GPT builder it names (``GPTModelBuilder``, what
``pretrain_gpt.py``'s model provider builds), under ``torch.device("meta")`` with weight
initialisation off: full-size models, no memory. megatron-ext's side: the converted recipe's
model built by the GPT trainer's ``build_gpt_model`` on the meta device too, and the planner's
count (``gpt_parameters``, no model built). The whole model is counted: each script's parallel
sizes set to 1 (they split, not change, the parameters); the tokenizer's vocabulary is given
with ``--vocab-size`` (the scripts read it from tokenizer files).
"""

from __future__ import annotations

import copy
import importlib
import os
from unittest import mock

import pytest
import torch

from megatron_ext.config.load import recipe_from_dict
from megatron_ext.megatron.from_megatron import convert
from megatron_ext.megatron.megatron_args import read_megatron_args
from tests.test_megatron_examples import LLAMA3_8B, MIXTRAL
from tests.test_megatron_parser import BASE, CPU_KERNELS

WHOLE = (
    " --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "
    "--expert-model-parallel-size 1"
)
CASES = {
    # examples/mixtral/train_mixtral_8x7b_distributed.sh: 8 experts of 14336, GQA, untied
    "mixtral_8x7b": MIXTRAL + WHOLE + " --vocab-size 32000",
    # examples/llama/train_llama3_8b_h100_fp8.sh; its zero-centred norms (TE only) have the
    # same parameters as torch's norms: left out so the local layers build it
    "llama3_8b": LLAMA3_8B.replace("--apply-layernorm-1p", "") + WHOLE + " --vocab-size 128256",
    # MTP, a shared expert, a sigmoid router with expert bias (a buffer, not a parameter)
    "mtp_moe": BASE
    + "--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
    "--mtp-num-layers 1 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
    "--moe-router-score-function sigmoid --moe-router-enable-expert-bias "
    "--moe-shared-expert-intermediate-size 32",
}


def megatron_lms_count(parsed) -> int:
    """Parameters of Megatron-LM's own GPT model for ``parsed``, built on the meta device."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args

    args = copy.copy(parsed)  # Megatron-LM's namespace, with this host's kernels
    for key, value in CPU_KERNELS.items():
        setattr(args, key, value)
    config = gpt_config_from_args(args)
    config.vocab_size = parsed.vocab_size
    config.should_pad_vocab = True
    module, name = config.builder.rsplit(".", 1)
    builder = getattr(importlib.import_module(module), name)(config)
    with torch.device("meta"):
        model = builder.build_model(ProcessGroupCollection.use_mpu_process_groups())
    return sum(p.numel() for p in model.parameters())


@pytest.fixture(autouse=True)
def _environment():
    """megatron-core's model setup exports NVTE_* attention-backend variables and checks them
    against the next model's --attention-backend: each case starts without them (another test
    of this process may have built a model) and leaves the environment as it found it."""
    with mock.patch.dict(os.environ):
        for name in ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN"):
            os.environ.pop(name, None)
        yield


@pytest.mark.parametrize("case", list(CASES))
def test_parameter_count_is_megatron_lms(case: str) -> None:
    import dataclasses

    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.gpt.sections import ParallelConfig
    from megatron_ext.megatron.model import build_gpt_model
    from megatron_ext.planner.params import gpt_parameters

    init_single_process()
    conversion = convert(read_megatron_args(CASES[case]))
    assert conversion.model_changing == []
    recipe = recipe_from_dict(conversion.recipe)
    theirs = megatron_lms_count(conversion.megatron)
    model, seq = recipe.model, recipe.training.seq_length
    model = dataclasses.replace(
        model,
        transformer_config={**model.transformer_config, "perform_initialization": False},
    )
    with torch.device("meta"):
        gpt = build_gpt_model(model, ParallelConfig(), "fp32", model.vocab_size, seq)
    assert sum(p.numel() for p in gpt.parameters()) == theirs
    if case != "mtp_moe":  # the planner lists the decoder and embeddings (no MTP block)
        planned = gpt_parameters(recipe.model, ParallelConfig(), vocab_size=model.vocab_size)
        assert sum(p.numel for p in planned) == theirs
    if case == "mixtral_8x7b":
        assert 46_000_000_000 < theirs < 47_000_000_000  # Mixtral 8x7B's 46.7 B
