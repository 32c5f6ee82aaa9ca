"""Megatron-LM 0.19's example launch scripts through ``recipe from-megatron-args``.

Each case holds the flags of one of ``examples/`` at the core_v0.19.0 tag (read there and
written here as flag lists, their shell variables resolved as the script's defaults resolve
them) and what Megatron-LM makes of them, written by hand from its ``arguments.py`` and
``training.py``: the recipe fields, the step count and the learning rate at chosen steps
(against megatron-core's ``OptimizerParamScheduler``), or Megatron-LM's own refusal, or the
model-changing flag that makes the converter refuse. The table of these scripts in
docs/megatron-lm.md is this file's cases.
"""

from __future__ import annotations

import pytest

from megatron_ext.config.load import recipe_from_dict
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.from_megatron import convert
from megatron_ext.megatron.megatron_args import read_megatron_args
from megatron_ext.schedules.plan import run_steps, training_schedule

# examples/mixtral/train_mixtral_8x7b_distributed.sh
MIXTRAL = """
torchrun --nproc_per_node 8 --nnodes 1 --node_rank 0 --master_addr localhost
  --master_port 29500 pretrain_gpt.py
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32
--init-method-std 0.01 --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
--position-embedding-type rope --swiglu --untie-embeddings-and-output-weights
--group-query-attention --num-query-groups 8 --no-masked-softmax-fusion --no-position-embedding
--rotary-base 1000000
--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss
--moe-aux-loss-coeff 1e-2 --moe-grouped-gemm --moe-token-dispatcher-type alltoall
--overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model tok.model --data-path data/mix_text_document
--split 99990,8,2
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000
--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
--lr-warmup-iters 500 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
--use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save ckpt
--load ckpt --tensorboard-dir ckpt/tensorboard --no-load-optim --no-load-rng
"""

# examples/gpt3/train_gpt3_175b_distributed.sh (its batch flags)
GPT3_175B = """
torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 96 --hidden-size 12288
--num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
--attention-backend auto --micro-batch-size 1 --global-batch-size 1536
--step-batch-size-schedule "0:16 2.4B:320 4.8B:624 7.2B:928 9.6B:1232 12B:1536"
--train-iters 500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--init-method-std 0.006 --clip-grad 1.0 --fp16 --lr 6.0e-5 --lr-decay-style cosine
--min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000 --data-path data/gpt
"""

# examples/llama/train_llama3_8b_h100_fp8.sh (model and training flags)
LLAMA3_8B = """
torchrun --nproc_per_node 8 pretrain_gpt.py --use-mcore-models --num-layers 32
--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention
--num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
--position-embedding-type rope --rotary-base 1000000 --rotary-percent 1.0
--attention-dropout 0.0 --hidden-dropout 0.0 --swiglu --normalization RMSNorm
--init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000
--lr-decay-samples 1949218748 --lr-warmup-samples 3906252 --lr 0.00015 --min-lr 0.00001
--lr-decay-style cosine --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
--decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --bf16 --data-path data/llama
"""

# examples/gptoss/02_train.sh (its model flags)
GPT_OSS = """
torchrun --nproc_per_node 8 pretrain_gpt.py --num-layers 24 --hidden-size 2880
--num-attention-heads 64 --seq-length 4096 --max-position-embeddings 4096
--micro-batch-size 1 --global-batch-size 8
--train-iters 100 --lr 1e-4 --data-path data/oss --quick-geglu --glu-linear-offset 1.0
--softmax-type learnable --window-size 127,0 --window-attn-skip-freq 2
--activation-func-clamp-value 7.0 --enable-gpt-oss
"""


def _recipe(flags: str):
    conversion = convert(read_megatron_args(flags))
    recipe = recipe_from_dict(conversion.recipe)
    recipe.check()
    return recipe, conversion


def test_mixtral_8x7b_is_the_scripts_model_and_schedule() -> None:
    """Converted whole (7 flags listed unmapped with the reason, none model-changing); its LR
    is megatron-core's OptimizerParamScheduler's at every chosen step, the decay ending at
    320,000 of 500,000."""
    from tests.mcore_lr import megatron_core_lrs

    recipe, conversion = _recipe(MIXTRAL)
    m, t, o, p, d = recipe.model, recipe.training, recipe.optimizer, recipe.parallel, recipe.data
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (
        32,
        4096,
        14336,
        32,
    )
    assert (m.num_query_groups, m.normalization, m.activation, m.rotary_base) == (
        8,
        "RMSNorm",
        "swiglu",
        1000000,
    )
    assert (
        m.position_embedding_type,
        m.add_bias_linear,
        m.untie_embeddings_and_output_weights,
    ) == (
        "rope",
        False,
        True,
    )
    assert (m.hidden_dropout, m.attention_dropout, m.init_method_std) == (0.0, 0.0, 0.01)
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_aux_loss_coeff) == (8, 2, 0.01)
    assert (m.moe_router_load_balancing_type, m.moe_token_dispatcher_type) == (
        "aux_loss",
        "alltoall",
    )
    assert (t.seq_length, t.micro_batch_size, t.global_batch_size, t.precision) == (
        4096,
        1,
        256,
        "bf16",
    )
    assert run_steps(recipe.training) == 500000 and t.batch_lr_scaling == "none"
    assert (o.name, o.lr, o.min_lr, o.weight_decay, o.clip_grad) == ("adamw", 1e-4, 1e-5, 0.1, 1.0)
    assert (o.adam_beta1, o.adam_beta2) == (0.9, 0.999)  # Megatron-LM's defaults
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (1, 4)
    assert (p.expert_model_parallel_size, p.sequence_parallel) == (8, False)  # TP=1
    assert (d.tokenizer, d.tokenizer_model, d.split) == ("sentencepiece", "tok.model", "99990,8,2")
    assert conversion.model_changing == []
    assert [flag.split()[0] for flag, _ in conversion.unmapped] == [
        "--no-masked-softmax-fusion",
        "--overlap-param-gather",
        "--overlap-grad-reduce",
        "--use-distributed-optimizer",
        "--tensorboard-dir",
        "--no-load-optim",
        "--no-load-rng",
    ]

    schedule = training_schedule(recipe.training, recipe.optimizer)
    steps = (0, 1, 250, 500, 501, 100000, 319999, 320000, 400000, 499999)
    theirs = megatron_core_lrs(
        steps, max_lr=1e-4, min_lr=1e-5, warmup=500, decay=320000, style="cosine"
    )
    for step, lr in theirs.items():
        assert schedule.lr_at(step) == pytest.approx(lr, rel=1e-12), step


def test_gpt3_175b_is_refused_as_megatron_lm_refuses_it() -> None:
    """Its --global-batch-size beside --step-batch-size-schedule: validate_args raises."""
    with pytest.raises(ConfigError, match="Cannot specify both"):
        convert(read_megatron_args(GPT3_175B))


def test_llama3_8b_converts_with_zero_centred_norms() -> None:
    """--apply-layernorm-1p is megatron-core's zero-centred gamma, carried in
    model.transformer_config; --train-samples counted as Megatron-LM counts them (rounded
    down); the warmup's 3,906,252 samples end inside step 30,518 and stay a sample count, as
    Megatron-LM's scheduler counts them; its decoupled LR is the optimizer section's."""
    from megatron_ext.megatron.megatron_compare import compare

    conversion = convert(read_megatron_args(LLAMA3_8B))
    assert conversion.model_changing == []
    recipe = recipe_from_dict(conversion.recipe)
    recipe.check()
    assert recipe.model.transformer_config["layernorm_zero_centered_gamma"] is True
    assert run_steps(recipe.training) == 1953125000 // 128
    t = recipe.training
    assert (recipe.model.kv_channels, t.lr_warmup_samples) == (128, 3906252)
    assert (t.lr_warmup_steps, t.lr_decay_samples) == (0, 1949218748)
    assert (recipe.optimizer.decoupled_lr, recipe.optimizer.decoupled_min_lr) == (5e-4, 4.5e-5)
    # the LR at chosen steps (the decoupled group's too), batch, parallel sizes and
    # TransformerConfig: Megatron-LM's
    assert compare(recipe, conversion.megatron, conversion.megatron.world_size) == {}


def test_gpt_oss_is_refused_by_megatron_lms_parser() -> None:
    """examples/gptoss/02_train.sh passes --enable-gpt-oss, which Megatron-LM 0.19.2's parser
    does not have: its refusal is the converter's."""
    with pytest.raises(ConfigError, match="unrecognized arguments: --enable-gpt-oss"):
        convert(read_megatron_args(GPT_OSS))
