"""``megatron-ext recipe from-megatron-args``: Megatron-LM flags (a launch script in the style
of Megatron-LM's examples, written here) -> a recipe; every flag mapped, for the launcher, or
listed as not mapped; a missing required flag is exit 2; the recipe's own ``--dry-run`` shows
the script's batch stages (against megatron-core's calculator), steps and LR positions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ext.config.from_megatron import convert
from megatron_ext.config.load import load_recipe
from megatron_ext.config.megatron_args import read_megatron_args
from megatron_ext.config.megatron_flags import MEGATRON_DEFAULTS
from megatron_ext.schedules.plan import run_steps

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")

SCRIPT = r"""#!/bin/bash
# A MoE GPT in the style of Megatron-LM's examples/*/train_*.sh
export CUDA_DEVICE_MAX_CONNECTIONS=1
GPUS_PER_NODE=8
NNODES=${SLURM_NNODES:-"4"}
CHECKPOINT_PATH=$1
DATA_PATH=$2
TOKENIZER_MODEL=${3:-"tok/spm.model"}

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE --nnodes $NNODES
    --master_addr node001 --master_port 29611
)
MODEL_ARGS=(
    --use-mcore-models
    --num-layers 8 --hidden-size 512 --ffn-hidden-size 1536
    --num-attention-heads 8 --group-query-attention --num-query-groups 2
    --seq-length 1024 --max-position-embeddings 1024
    --position-embedding-type rope --rotary-base 500000
    --swiglu --normalization RMSNorm --norm-epsilon 1e-6
    --disable-bias-linear --untie-embeddings-and-output-weights
    --attention-dropout 0.0 --hidden-dropout 0.0 --init-method-std 0.01
    --apply-layernorm-1p  # not in megatron-ext
)
MOE_ARGS=(
    --num-experts 8 --moe-router-topk 2 --moe-ffn-hidden-size 256
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-token-dispatcher-type alltoall --moe-grouped-gemm
)
TRAINING_ARGS=(
    --micro-batch-size 2
    --step-batch-size-schedule "0:64 20M:128 60M:256"
    --train-iters 2000
    --optimizer muon --muon-momentum 0.95 --muon-scale-mode spectral
    --muon-coefficient-type polar_express --muon-num-ns-steps 5
    --lr 3e-3 --min-lr 3e-4 --weight-decay 0.1 --adam-beta2 0.95 --clip-grad 1.0
    --lr-decay-style WSD --lr-wsd-decay-style minus_sqrt --lr-wsd-decay-iters 400
    --lr-warmup-iters 100
    --bf16
    --manual-gc
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
    --expert-model-parallel-size 4 --sequence-parallel
)
if [ "$MOCK" == "1" ]; then
    DATA_ARGS=( --mock-data --split 99,1,0 )
else
    DATA_ARGS=(
        "--data-path $DATA_PATH"
        --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model ${TOKENIZER_MODEL}
        --split 98,2,0
    )
fi
LOGGING_ARGS=(
    --log-interval 10 --eval-interval 200 --eval-iters 4 --save-interval 500 \
    --save $CHECKPOINT_PATH --load $CHECKPOINT_PATH --wandb-project moe
)
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py ${MODEL_ARGS[@]} ${MOE_ARGS[@]} \
    ${TRAINING_ARGS[@]} ${PARALLEL_ARGS[@]} ${DATA_ARGS[@]} ${LOGGING_ARGS[@]}
"""
SCRIPT_ARGS = ("runs/moe", "data/moe_text_document")


GPT_READS = (
    "trainer=gpt reads model, optimizer, data, training, parallel, "
    "and run_dir, seed, logging, checkpoint, launch"
)


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MEGATRON_EXT), *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
        env={"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    root = tmp_path_factory.mktemp("from_megatron")
    (root / "train_moe.sh").write_text(SCRIPT)
    proc = _cli(
        "recipe",
        "from-megatron-args",
        "train_moe.sh",
        "-o",
        "moe.yaml",
        "--script-args",
        *SCRIPT_ARGS,
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    return root, proc


def test_every_flag_is_mapped_for_the_launcher_or_listed() -> None:
    args = read_megatron_args(SCRIPT, SCRIPT_ARGS)
    conversion = convert(args)
    listed = [*conversion.mapped, *conversion.launcher, *(f for f, _ in conversion.unmapped)]
    last = {f.name.replace("_", "-"): f.text for f in args.flags}  # one entry per flag
    assert sorted(listed) == sorted(last.values())
    assert dict(conversion.unmapped) == {
        "--apply-layernorm-1p": "no megatron-ext counterpart",
        "--manual-gc": "no megatron-ext counterpart",
        "--mock-data": "megatron-ext trains on an indexed dataset (data.path)",
        "--wandb-project moe": "no W&B logging",
    }
    assert conversion.launcher == [
        "--nproc_per_node 8",
        "--nnodes 4",
        "--master_addr node001",
        "--master_port 29611",
    ]
    assert any("--split is given 2 times ('99,1,0', '98,2,0')" in n for n in conversion.notes)


def test_the_recipe_has_the_scripts_values(converted) -> None:
    root, proc = converted
    recipe = load_recipe(root / "moe.yaml")
    m, t, o, p, d = recipe.model, recipe.training, recipe.optimizer, recipe.parallel, recipe.data
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (
        8,
        512,
        1536,
        8,
    )
    assert (m.num_query_groups, m.rotary_base, m.layernorm_epsilon, m.activation) == (
        2,
        500000,
        1e-6,
        "swiglu",
    )
    assert (m.normalization, m.add_bias_linear, m.untie_embeddings_and_output_weights) == (
        "RMSNorm",
        False,
        True,
    )
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size) == (8, 2, 256)
    assert (m.moe_aux_loss_coeff, m.moe_token_dispatcher_type, m.moe_grouped_gemm) == (
        0.01,
        "alltoall",
        True,
    )
    assert (t.steps, t.micro_batch_size, t.seq_length, t.precision) == (2000, 2, 1024, "bf16")
    assert t.step_batch_size_schedule == "0:64 20M:128 60M:256"
    assert (t.lr_decay_style, t.lr_wsd_decay_style, t.lr_wsd_decay_steps) == (
        "WSD",
        "minus_sqrt",
        400,
    )
    assert (t.lr_warmup_steps, t.eval_interval, t.eval_iters) == (100, 200, 4)
    assert (o.name, o.lr, o.min_lr, o.weight_decay, o.adam_beta2) == ("muon", 3e-3, 3e-4, 0.1, 0.95)
    assert (o.muon_coefficient_type, o.match_update_rms) == ("polar_express", False)
    assert (p.tensor_model_parallel_size, p.pipeline_model_parallel_size) == (2, 2)
    assert (p.expert_model_parallel_size, p.sequence_parallel) == (4, True)
    assert (d.path, d.tokenizer, d.tokenizer_model, d.split) == (
        "data/moe_text_document",
        "sentencepiece",
        "tok/spm.model",
        "98,2,0",
    )
    assert (recipe.run_dir, recipe.checkpoint.load, recipe.checkpoint.save_interval) == (
        "runs/moe",
        "auto",
        500,
    )
    assert recipe.launch.master_port == 29611
    text = (root / "moe.yaml").read_text()
    assert "#   --apply-layernorm-1p: no megatron-ext counterpart" in text
    assert "--nproc-per-node 8 --nnodes 4 --rdzv-endpoint node001:29611" in text
    assert "4 not mapped" in proc.stderr


def test_round_trip_the_recipes_dry_run_shows_the_scripts_schedule(converted) -> None:
    """The dry run at the script's 4 x 8 ranks: megatron-core's calculator, driven as
    Megatron-LM drives it, gives the same stages; 2000 steps; warmup ends after 100 steps and
    the WSD window covers the last 400."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    root, _ = converted
    proc = _cli(
        "launch",
        "moe.yaml",
        "--dry-run",
        *("--nnodes", "4", "--node-rank", "0", "--nproc-per-node", "8"),
        *("--rdzv-endpoint", "node001:29611"),
        cwd=root,
    )
    assert proc.returncode == 0, proc.stderr
    dp = 32 // (2 * 2)
    theirs = StepBatchsizeNumMicroBatchesCalculator(2, dp, False, 1, "0:64 20M:128 60M:256", 1024)
    consumed, stages, tokens = 0, [], []
    for step in range(2000):
        theirs.update(consumed, consistency_check=True)
        batch = theirs.get_current_global_batch_size()
        if not stages or stages[-1][3] != batch:
            stages.append([str(len(stages)), f"{step:,}", f"{consumed * 1024:,}", batch])
            stages[-1] += [theirs.get()]
        tokens.append(consumed * 1024)
        consumed += batch
    reads, *lines = proc.stderr.splitlines()
    assert reads == GPT_READS  # what the trainer reads, first
    assert lines[0].startswith(f"batch schedule: 2,000 steps, {consumed * 1024:,} tokens")
    rows = [line.split()[:5] for line in lines[2 : 2 + len(stages)]]
    assert rows == [[i, s, tok, str(b), str(n)] for i, s, tok, b, n in stages]
    window = tokens[2000 - 400]
    assert lines[2 + len(stages)] == (
        f"lr WSD: warmup ends at token {tokens[100]:,}; minus_sqrt decay from token "
        f"{window:,} to {consumed * 1024:,}, the run's last token"
    )


def test_a_missing_required_flag_is_exit_2(tmp_path: Path) -> None:
    (tmp_path / "args.txt").write_text("--num-layers 2 --hidden-size 64\n--seq-length 128\n")
    proc = _cli("recipe", "from-megatron-args", "args.txt", "-o", "r.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "r.yaml").exists()
    assert proc.stderr.strip() == (
        "megatron-ext: error: required Megatron-LM flag(s) missing: --num-attention-heads, "
        "--micro-batch-size, --lr, --data-path, --train-iters or --train-samples, "
        "--global-batch-size or --step-batch-size-schedule"
    )
    proc = _cli("recipe", "from-megatron-args", "train.sh", "-o", "r.yaml", cwd=tmp_path)
    assert proc.returncode == 2  # no such file
    (tmp_path / "train.sh").write_text(SCRIPT)
    proc = _cli("recipe", "from-megatron-args", "train.sh", "-o", "r.yaml", cwd=tmp_path)
    assert proc.returncode == 2
    assert "unresolved shell variables: --data-path $2" in proc.stderr


def test_sample_counts_follow_the_stage_table() -> None:
    """--train-samples under a step schedule gives Megatron-LM's iteration count (its
    update_train_iters loop on megatron-core's calculator); --lr-*-samples become steps of the
    stage table, rounded up and noted when they end inside a step."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    flags = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--micro-batch-size 1 --step-batch-size-schedule '0:8 10K:16' --train-samples 1000 "
        "--lr 1e-3 --data-path d --lr-warmup-samples 40 --lr-decay-samples 901 "
        "--lr-decay-style WSD --lr-wsd-decay-samples 160"
    )
    conversion = convert(read_megatron_args(flags))
    calc = StepBatchsizeNumMicroBatchesCalculator(1, 1, False, 1, "0:8 10K:16", 128)
    iterations, consumed = 0, 0
    while consumed < 1000:
        calc.update(consumed, False)
        consumed += calc.get_current_global_batch_size()
        iterations += 1
    recipe = load_recipe_dict(conversion.recipe)
    assert run_steps(recipe) == iterations  # train_tokens: the plan's step count
    # 10K tokens = 78 samples: 10 steps of 8 (80), then 16 per step
    assert recipe.training.lr_warmup_steps == 5  # 40 samples exactly
    assert recipe.training.lr_decay_steps == 10 + 52  # 80 + 52*16 = 912 >= 901
    assert recipe.training.lr_wsd_decay_steps == 10  # from 912 - 160 = 752: 10 + 42 steps
    assert any("--lr-decay-samples 901 samples ends inside step 62" in n for n in conversion.notes)


def load_recipe_dict(raw: dict):
    from megatron_ext.config.load import recipe_from_dict

    recipe = recipe_from_dict(raw)
    recipe.check()
    return recipe


def test_megatron_defaults_are_megatron_cores() -> None:
    """The defaults the converter writes for absent flags, against megatron-core's dataclasses
    (Megatron-LM's argparse defaults for the rest are not importable here)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    oc = OptimizerConfig()
    assert MEGATRON_DEFAULTS["model.normalization"] == tc.normalization
    assert MEGATRON_DEFAULTS["model.add_bias_linear"] == tc.add_bias_linear
    assert MEGATRON_DEFAULTS["model.hidden_dropout"] == tc.hidden_dropout
    assert MEGATRON_DEFAULTS["model.attention_dropout"] == tc.attention_dropout
    assert (MEGATRON_DEFAULTS["model.activation"] == "gelu") == (not tc.gated_linear_unit)
    assert MEGATRON_DEFAULTS["model.moe_token_dispatcher_type"] == tc.moe_token_dispatcher_type
    assert MEGATRON_DEFAULTS["optimizer.adam_beta2"] == oc.adam_beta2
    assert MEGATRON_DEFAULTS["optimizer.weight_decay"] == oc.weight_decay
    assert yaml.safe_load(yaml.safe_dump(MEGATRON_DEFAULTS)) == MEGATRON_DEFAULTS
