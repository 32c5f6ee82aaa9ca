"""``recipe from-megatron-args`` through Megatron-LM's own parser, field by field.

The reference is Megatron-LM itself (``megatron.training`` in the megatron-core wheel): its
``parse_args`` + ``validate_args`` on the same flags, ``core_transformer_config_from_args`` for
the ``TransformerConfig``, and ``GPTModelBuilder`` (from ``gpt_config_from_args``) for the
model whose parameters the recipe's model must count. Megatron-LM's kernel choices a CPU host
cannot run (fused RoPE, persistent LayerNorm, ...) are set to the CPU's in its namespace before
it builds: the one difference, named in ``HOST_FIELDS``. The flag lists are written here.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from argparse import Namespace
from typing import Any

import pytest
import torch

from megatron_ext.config.load import recipe_from_dict
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.from_megatron import convert
from megatron_ext.megatron.megatron_args import read_megatron_args
from megatron_ext.megatron.transformer_fields import HOST_FIELDS

BASE = """
torchrun --nproc_per_node 4 --nnodes 1 pretrain_gpt.py \\
  --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
  --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 \\
  --train-iters 10 --data-path data/x --vocab-size 256 \\
  --vocab-file v/gpt2-vocab.json --merge-file v/gpt2-merges.txt \\
"""
#: the newly accepted models, each a tiny one
CASES = {
    # partial rotary, squared ReLU, SP at TP=1 (Megatron-LM turns it off), GPT-2 BPE default
    "partial_rotary_squared_relu": BASE
    + "--position-embedding-type rope --rotary-percent 0.5 --squared-relu --sequence-parallel "
    "--bf16",
    # zero-centred gamma: megatron-core builds it on Transformer Engine's norms only
    "zero_centred_gamma": BASE + "--apply-layernorm-1p",
    # Llama-style at TP=2 with sequence parallelism (kept), GQA, SwiGLU, untied
    "llama_tp2_sp": "export CUDA_DEVICE_MAX_CONNECTIONS=1\n"
    + BASE
    + "--tensor-model-parallel-size 2 --sequence-parallel --group-query-attention "
    "--num-query-groups 2 --swiglu --normalization RMSNorm --disable-bias-linear "
    "--untie-embeddings-and-output-weights --position-embedding-type rope --rotary-base 500000 "
    "--attention-dropout 0 --hidden-dropout 0 --bf16",
    # DeepSeek-V3-style MoE: MTP, sigmoid router with pre-softmax (megatron-core ignores it)
    "mtp_moe": BASE
    + "--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
    "--mtp-num-layers 1 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
    "--moe-router-score-function sigmoid --moe-router-pre-softmax "
    "--moe-router-enable-expert-bias --moe-aux-loss-coeff 1e-3 "
    "--moe-shared-expert-intermediate-size 32 --moe-token-dispatcher-type alltoall",
    # multi-latent attention: megatron-core's local core attention has no MLA head dims
    "mla": BASE + "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
    "--qk-pos-emb-head-dim 8 --v-head-dim 16 --position-embedding-type rope --swiglu "
    "--normalization RMSNorm --disable-bias-linear",
}
#: Megatron-LM's namespace with this host's kernel choices (all need CUDA and TE or apex)
CPU_KERNELS = {
    "apply_rope_fusion": False,
    "bias_gelu_fusion": False,
    "bias_swiglu_fusion": False,
    "masked_softmax_fusion": False,
    "bias_dropout_fusion": False,
    "no_persist_layer_norm": True,
    "gradient_accumulation_fusion": False,
    "use_cpu_initialization": True,
    "transformer_impl": "local",
}


@pytest.fixture(scope="module")
def converted() -> dict[str, Any]:
    """Each case converted once: (recipe, Megatron-LM's namespace)."""
    out = {}
    for name, text in CASES.items():
        conversion = convert(read_megatron_args(text))
        recipe = recipe_from_dict(conversion.recipe)
        out[name] = (recipe, conversion)
    return out


def megatron_on_cpu(parsed: Namespace) -> Namespace:
    args = copy.copy(parsed)
    for key, value in CPU_KERNELS.items():
        setattr(args, key, value)
    return args


def comparable(value: Any) -> Any:
    if isinstance(value, functools.partial):  # init methods: normal_(mean, std)
        return (value.func, value.args, tuple(sorted(value.keywords.items())))
    return value


@pytest.mark.parametrize("case", list(CASES))
def test_transformer_config_is_megatron_lms_field_by_field(converted, case: str) -> None:
    """Every field of the trainer's TransformerConfig equals Megatron-LM's own
    (core_transformer_config_from_args on the same flags); so do the parallel sizes, the batch
    and the optimizer's fields."""
    from megatron_ext.megatron.megatron_parse import megatron_transformer_config
    from megatron_ext.megatron.model import transformer_config

    recipe, conversion = converted[case]
    parsed = conversion.megatron
    recipe.check(parsed.world_size)
    mine = transformer_config(recipe.model, recipe.parallel, recipe.training.precision)
    theirs = megatron_transformer_config(megatron_on_cpu(parsed), post_init=True)
    assert type(mine) is type(theirs)
    differ = []
    for f in dataclasses.fields(theirs):
        if f.name in HOST_FIELDS:
            continue
        if f.name.startswith("num_layers_at_") and not theirs.first_last_layers_bf16:
            continue  # read only with first_last_layers_bf16
        a, b = comparable(getattr(mine, f.name)), comparable(getattr(theirs, f.name))
        if a != b:
            differ.append((f.name, a, b))
    assert differ == []
    p, t, o = recipe.parallel, recipe.training, recipe.optimizer
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (
        parsed.tensor_model_parallel_size,
        parsed.pipeline_model_parallel_size,
    )
    assert (p.expert_model_parallel_size, p.sequence_parallel) == (
        parsed.expert_model_parallel_size,
        parsed.sequence_parallel,
    )
    assert (t.micro_batch_size, t.global_batch_size, t.steps, t.seq_length) == (
        parsed.micro_batch_size,
        parsed.global_batch_size,
        parsed.train_iters,
        parsed.seq_length,
    )
    assert (o.lr, o.min_lr, o.weight_decay, o.clip_grad) == (
        parsed.lr,
        parsed.min_lr,
        parsed.weight_decay,
        parsed.clip_grad,
    )
    assert (o.adam_beta1, o.adam_beta2, o.adam_eps) == (
        parsed.adam_beta1,
        parsed.adam_beta2,
        parsed.adam_eps,
    )


def test_sequence_parallel_at_tp1_is_turned_off_as_megatron_lm_does(converted) -> None:
    recipe, conversion = converted["partial_rotary_squared_relu"]
    assert recipe.parallel.sequence_parallel is False
    assert any("sequence_parallel: False" in n for n in conversion.notes)
    assert converted["llama_tp2_sp"][0].parallel.sequence_parallel is True


def test_the_new_models_flags_are_mapped_not_refused(converted) -> None:
    for _, conversion in converted.values():
        assert conversion.model_changing == []
    recipe, _ = converted["partial_rotary_squared_relu"]
    assert recipe.model.rotary_percent == 0.5
    assert recipe.model.transformer_config["activation_func"] == "squared_relu"
    gamma = converted["zero_centred_gamma"][0].model.transformer_config
    assert gamma["layernorm_zero_centered_gamma"] is True
    assert converted["mtp_moe"][0].model.transformer_config["mtp_num_layers"] == 1
    mla = converted["mla"][0].model.transformer_config
    assert (mla["multi_latent_attention"], mla["kv_lora_rank"]) == (True, 16)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--frobnicate-the-widgets 3", "unrecognized arguments: --frobnicate-the-widgets 3"),
        ("--rotary-bse 500000", "unrecognized arguments: --rotary-bse 500000"),
        ("--tensor-model-parallel-size 3", "world size (4) is not divisible by"),
    ],
)
def test_megatron_lms_refusals_are_the_converters(flags: str, message: str) -> None:
    with pytest.raises(ConfigError, match="Megatron-LM's") as err:
        convert(read_megatron_args(BASE + flags))
    assert message in str(err.value)


def test_gpt2_bpe_is_the_default_tokenizer_as_in_pretrain_gpt() -> None:
    conversion = convert(read_megatron_args(BASE))
    assert conversion.megatron.tokenizer_type == "GPT2BPETokenizer"
    assert conversion.recipe["data"] == {
        "path": "data/x",
        "split": "969,30,1",
        "tokenizer": "huggingface",
        "tokenizer_model": "v/gpt2-vocab.json",
    }


def megatron_lms_model(parsed: Namespace) -> torch.nn.Module:
    """Megatron-LM's own GPT model for ``parsed`` (GPTModelBuilder), single process."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.argument_utils import gpt_config_from_args

    config = gpt_config_from_args(megatron_on_cpu(parsed))
    config.vocab_size = parsed.vocab_size
    config.should_pad_vocab = True
    builder = config.builder.rsplit(".", 1)
    import importlib

    cls = getattr(importlib.import_module(builder[0]), builder[1])
    return cls(config).build_model(ProcessGroupCollection.use_mpu_process_groups())


@pytest.mark.parametrize(
    ("case", "refusal"),
    [
        ("partial_rotary_squared_relu", None),
        ("mtp_moe", None),
        ("zero_centred_gamma", "zero_centered_gamma not supported by torch LayerNorm"),
        ("mla", "multi-latent attention"),
    ],
)
def test_the_new_models_train_on_cpu_or_are_refused_with_the_reason(converted, case, refusal):
    """At one rank: megatron-core builds the model without Transformer Engine, its parameters
    count as Megatron-LM's own model's (GPTModelBuilder), and four steps lower the loss on a
    fixed batch; or the build is refused at launch with the reason."""
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.gpt.sections import ParallelConfig
    from megatron_ext.megatron.from_megatron_parsed import megatron_words
    from megatron_ext.megatron.megatron_parse import parse_megatron
    from megatron_ext.megatron.model import build_gpt_model

    init_single_process()
    recipe, _ = converted[case]
    torch.manual_seed(0)
    if refusal is not None:
        with pytest.raises(ConfigError, match=refusal) as err:
            build_gpt_model(recipe.model, ParallelConfig(), "fp32", 256, 32)
        assert "Transformer Engine" in str(err.value)
        return
    gpt = build_gpt_model(recipe.model, ParallelConfig(), "fp32", 256, 32)
    parsed = parse_megatron(megatron_words(read_megatron_args(CASES[case])), 1)
    theirs = megatron_lms_model(parsed)
    assert sum(p.numel() for p in gpt.parameters()) == sum(p.numel() for p in theirs.parameters())
    tokens = torch.randint(0, 256, (2, 32))
    positions = torch.arange(32).expand(2, 32)
    opt = torch.optim.Adam(gpt.parameters(), lr=3e-3)
    losses = []
    for _ in range(4):
        loss = gpt(tokens, positions, None, labels=tokens).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_bad_input_is_one_line_exit_2_nothing_written(tmp_path) -> None:
    """An unreadable (binary) file, a missing output folder, an output that is a folder."""
    import subprocess
    import sys
    from pathlib import Path

    cli = Path(sys.executable).with_name("megatron-ext")
    (tmp_path / "binary.sh").write_bytes(b"\x7fELF\x00\x01--num-layers 2")
    (tmp_path / "ok.sh").write_text(CASES["partial_rotary_squared_relu"])
    (tmp_path / "folder").mkdir()
    cases = [
        ("binary.sh", "r.yaml", "binary.sh: a binary file, not a launch script"),
        ("ok.sh", "missing/r.yaml", "the folder missing does not exist"),
        ("ok.sh", "folder", "-o folder is a folder"),
    ]
    for source, output, message in cases:
        proc = subprocess.run(
            [str(cli), "recipe", "from-megatron-args", source, "-o", output],
            capture_output=True,
            text=True,
            cwd=tmp_path,
            timeout=600,
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert message in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["binary.sh", "folder", "ok.sh"]
    assert list((tmp_path / "folder").iterdir()) == []


def test_transformer_engine_is_written_at_conversion_and_refused_at_launch() -> None:
    """A script asking for Transformer Engine converts on a CPU host; the build refuses it."""
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.gpt.sections import ParallelConfig
    from megatron_ext.megatron.model import build_gpt_model

    conversion = convert(read_megatron_args(BASE + "--transformer-impl transformer_engine"))
    recipe = recipe_from_dict(conversion.recipe)
    recipe.check()
    assert recipe.model.transformer_impl == "transformer_engine"
    init_single_process()
    with pytest.raises(ConfigError, match="needs Transformer Engine and a CUDA GPU"):
        build_gpt_model(recipe.model, ParallelConfig(), "fp32", 256, 32)
