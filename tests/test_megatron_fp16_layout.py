"""fp16 with loss scaling and pipeline layouts through ``recipe from-megatron-args``, each
compared field by field with what Megatron-LM builds from the same flags
(:func:`megatron_ext.megatron.megatron_compare.compare`: TransformerConfig, optimizer, LR at
chosen steps, batch, parallel sizes).

- ``--fp16``: written as ``training.precision: fp16`` (megatron-core's ``fp16=True`` and
  float16 dtypes, as Megatron-LM's) and its loss-scale flags into the optimizer section
  (megatron-core's ``OptimizerConfig`` fields, compared with Megatron-LM's); it launches on
  every machine (the GPT trainer's fp16 run: tests/test_training.py). Without ``--fp16`` the
  loss-scale flags are not mapped: Megatron-LM ignores them.
- ``--num-layers-per-virtual-pipeline-stage``: the virtual stages Megatron-LM derives, into
  ``parallel.virtual_pipeline_model_parallel_size`` (with its default ``overlap_p2p_comm`` in
  ``model.transformer_config``); the GPT trainer builds a chunk per virtual stage
  (tests/test_virtual_pipeline.py trains them). ``--pipeline-model-parallel-layout`` is carried
  in ``model.transformer_config``; a layout whose stages are not the recipe's chunks is refused
  when the model is built.
"""

from __future__ import annotations

import pytest

from megatron_ext.config.load import recipe_from_dict
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.from_megatron import convert
from megatron_ext.megatron.megatron_args import read_megatron_args
from megatron_ext.megatron.megatron_compare import compare

BASE = """export CUDA_DEVICE_MAX_CONNECTIONS=1
torchrun --nproc_per_node 4 pretrain_gpt.py \\
  --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
  --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 1e-3 \\
  --train-iters 10 --lr-warmup-fraction 0.15 --data-path data/x --vocab-size 256 \\
  --vocab-file v/gpt2-vocab.json --merge-file v/gpt2-merges.txt \\
"""
CASES = {
    "fp16": BASE + "--fp16 --loss-scale 1024 --hysteresis 2",
    "fp16_dynamic": BASE + "--fp16 --initial-loss-scale 65536 --min-loss-scale 4 "
    "--loss-scale-window 500 --hysteresis 3",
    "bf16_scale": BASE + "--bf16 --loss-scale-window 500",
    "virtual_pipeline": BASE + "--pipeline-model-parallel-size 2 "
    "--num-layers-per-virtual-pipeline-stage 1 --bf16",
    "pipeline_layout": BASE + "--pipeline-model-parallel-size 2 "
    "--pipeline-model-parallel-layout 'Et*2|t*2L' --bf16",
    # 6 layers + the embedding + the loss over 4 stages: megatron-core's uneven split
    "uneven_split": BASE + "--num-layers 6 --pipeline-model-parallel-size 4 --bf16 "
    "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
    "recompute_modules": BASE + "--bf16 --recompute-granularity selective "
    "--recompute-modules core_attn mlp",
    "recompute_block": BASE + "--bf16 --recompute-granularity full --recompute-method block "
    "--recompute-num-layers 2",
    "warmup_init": BASE + "--bf16 --lr-warmup-init 1e-4",
    "flex": BASE + "--bf16 --num-experts 4 --expert-model-parallel-size 2 "
    "--moe-token-dispatcher-type flex",
}


@pytest.fixture(scope="module")
def converted() -> dict:
    out = {}
    for name, text in CASES.items():
        conversion = convert(read_megatron_args(text))
        recipe = recipe_from_dict(conversion.recipe)
        recipe.check(conversion.megatron.world_size)  # converts: nothing refused here
        out[name] = (recipe, conversion)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_recipe_is_megatron_lms_run(converted, case: str) -> None:
    """Every compared field is Megatron-LM's (the warmup fraction of 10 steps: 1.5 steps of
    samples, not a whole step)."""
    recipe, conversion = converted[case]
    assert conversion.model_changing == []
    assert compare(recipe, conversion.megatron, conversion.megatron.world_size) == {}
    assert recipe.training.lr_warmup_fraction == 0.15


def test_fp16_and_its_loss_scale_are_written_and_launch(converted) -> None:
    from megatron_ext.megatron.model import transformer_config
    from megatron_ext.run.hardware import DeviceDescription, check_precision_before_launch

    recipe, conversion = converted["fp16"]
    assert recipe.training.precision == "fp16"
    config = transformer_config(recipe.model, recipe.parallel, "fp16")
    assert (config.fp16, config.bf16, str(config.params_dtype)) == (True, False, "torch.float16")
    assert {"--loss-scale 1024", "--hysteresis 2"} <= set(conversion.mapped)
    assert (recipe.optimizer.loss_scale, recipe.optimizer.hysteresis) == (1024.0, 2)
    check_precision_before_launch(recipe.training.precision, DeviceDescription())  # no GPU
    dynamic = converted["fp16_dynamic"][0].optimizer
    assert (dynamic.loss_scale, dynamic.initial_loss_scale, dynamic.min_loss_scale) == (
        None, 65536.0, 4.0
    )  # fmt: skip
    assert (dynamic.loss_scale_window, dynamic.hysteresis) == (500, 3)


def test_the_loss_scale_without_fp16_is_not_mapped(converted) -> None:
    """Megatron-LM reads --loss-scale-window only with --fp16: the bf16 recipe keeps the
    default and says why the flag was left."""
    recipe, conversion = converted["bf16_scale"]
    assert recipe.optimizer.loss_scale_window == 1000
    assert "only with --fp16" in dict(conversion.unmapped)["--loss-scale-window 500"]


def test_pipeline_layouts_are_carried(converted) -> None:
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.gpt.sections import ParallelConfig
    from megatron_ext.megatron.model import build_gpt_model

    virtual = converted["virtual_pipeline"][0]
    assert virtual.parallel.virtual_pipeline_model_parallel_size == 2
    assert "virtual_pipeline_model_parallel_size" not in virtual.model.transformer_config
    # Megatron-LM's default with virtual stages, which PP=2 needs (tests/test_virtual_pipeline)
    assert virtual.model.transformer_config["overlap_p2p_comm"] is True
    layout = converted["pipeline_layout"][0].model.transformer_config
    assert "pipeline_model_parallel_layout" in layout
    init_single_process()
    # a layout with more stages than pipeline ranks x chunks (virtual stages implied, not set)
    # is refused: megatron-core would build the first chunk's layers only
    import dataclasses

    model = converted["pipeline_layout"][0].model
    fields = {**model.transformer_config, "pipeline_model_parallel_layout": "Et|t|t|tL"}
    model = dataclasses.replace(model, transformer_config=fields)
    with pytest.raises(ConfigError, match=r"puts 4 stage\(s\) on each pipeline rank"):
        build_gpt_model(model, ParallelConfig(), "bf16", 256, 32)


def test_recomputation_forms_uneven_splits_and_warmup_init_are_written(converted) -> None:
    """Each lands in its recipe field (and not in the unmapped list)."""
    modules, conversion = converted["recompute_modules"]
    assert modules.parallel.recompute_modules == ["core_attn", "mlp"]
    assert "--recompute-modules core_attn mlp" in conversion.mapped
    block = converted["recompute_block"][0].parallel
    assert (block.recompute_method, block.recompute_num_layers) == ("block", 2)
    assert converted["warmup_init"][0].training.lr_warmup_init == 1e-4
    uneven = converted["uneven_split"][0]
    assert uneven.model.transformer_config["account_for_embedding_in_pipeline_split"] is True
    assert uneven.model.num_layers % uneven.parallel.pipeline_model_parallel_size


def test_the_flex_dispatcher_is_written_and_refused_on_a_cpu_host(converted) -> None:
    """megatron-core's flex dispatcher (DeepEP/HybridEP kernels) needs CUDA: the recipe has it,
    the build on this host says why it stops."""
    import torch

    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.megatron.model import build_gpt_model

    recipe = converted["flex"][0]
    assert recipe.model.moe_token_dispatcher_type == "flex"
    if torch.cuda.is_available():
        pytest.skip("a CUDA host: megatron-core decides")
    init_single_process()
    with pytest.raises(ConfigError, match="flex dispatcher runs on CUDA GPUs only"):
        build_gpt_model(recipe.model, recipe.parallel, "bf16", 256, 32)
