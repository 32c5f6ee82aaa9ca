"""``megatron-ext recipe from-megatron-args``: Megatron-LM flags (a launch script in the style
of Megatron-LM's examples, written here) -> a recipe; every flag mapped, for the launcher, or
listed as not mapped; a missing required flag is exit 2; the recipe's own ``--dry-run`` shows
the script's batch stages (against megatron-core's calculator), steps and LR positions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from megatron_ext.config.load import load_recipe
from megatron_ext.megatron.from_megatron import convert
from megatron_ext.megatron.megatron_args import read_megatron_args
from megatron_ext.megatron.megatron_flags import MEGATRON_DEFAULTS
from megatron_ext.optimizers.muon_spec import MuonOptions
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
        timeout=600,
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
    assert (o.flat()["muon_coefficient_type"], o.match_update_rms) == ("polar_express", False)
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
    assert m.transformer_config["layernorm_zero_centered_gamma"] is True  # --apply-layernorm-1p
    assert "--apply-layernorm-1p" not in text  # mapped: no comment
    assert t.batch_lr_scaling == "none"  # Megatron-LM never scales the LR with the batch
    assert "--nproc-per-node 8 --nnodes 4 --rdzv-endpoint node001:29611" in text
    assert "3 not mapped" in proc.stderr


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
        # the script's data and tokenizer are not on this machine (the dry run checks them)
        "data.source=[python-stdlib]",
        "data.tokenizer=byte",
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
        "megatron-ext: error: args.txt: required Megatron-LM flag(s) missing: "
        "--num-attention-heads, "
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
    update_train_iters loop on megatron-core's calculator); --lr-*-samples stay sample counts
    (training.lr_*_samples), so the LR at every chosen step is megatron-core's scheduler's at
    the samples Megatron-LM's loop has consumed, though 901 samples end inside a step."""
    from megatron.core.num_microbatches_calculator import StepBatchsizeNumMicroBatchesCalculator

    from megatron_ext.megatron.megatron_compare import compare

    flags = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 "
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
    assert run_steps(recipe.training) == iterations  # train_tokens: the plan's step count
    t = recipe.training
    assert (t.lr_warmup_samples, t.lr_decay_samples, t.lr_wsd_decay_samples) == (40, 901, 160)
    assert compare(recipe, conversion.megatron, conversion.megatron.world_size) == {}


def load_recipe_dict(raw: dict):
    from megatron_ext.config.load import recipe_from_dict

    recipe = recipe_from_dict(raw)
    recipe.check()
    return recipe


def test_megatron_defaults_are_megatron_cores() -> None:
    """The defaults the converter writes for absent flags, against megatron-core's dataclasses
    (Megatron-LM's argparse defaults for the rest are not importable here); the model fields
    named as in TransformerConfig and the optimizer's named as in OptimizerConfig are Megatron-LM's
    parsed values, with no table."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    tc = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1)
    oc = OptimizerConfig()
    assert (MEGATRON_DEFAULTS["model.activation"] == "gelu") == (not tc.gated_linear_unit)
    # TransformerConfig's own fields come from Megatron-LM's config, not from the table
    model = convert(read_megatron_args(BASE + "--global-batch-size 8 --train-iters 10"))
    model_section = model.recipe["model"]
    for name in ("normalization", "add_bias_linear", "hidden_dropout", "attention_dropout"):
        assert f"model.{name}" not in MEGATRON_DEFAULTS
        assert model_section[name] == getattr(tc, name), name
    assert model_section["moe_token_dispatcher_type"] == tc.moe_token_dispatcher_type
    # so are the optimizer fields named as in OptimizerConfig: Megatron-LM's parsed values
    for name in ("adam_beta2", "weight_decay", "adam_beta1", "adam_eps", "clip_grad"):
        assert f"optimizer.{name}" not in MEGATRON_DEFAULTS
        assert load_recipe_dict(model.recipe).optimizer.__dict__[name] == getattr(oc, name), name
    assert (model.recipe["optimizer"]["adam_beta2"], model.recipe["optimizer"]["lr"]) == (
        0.999,
        1e-3,
    )
    assert "--lr 1e-3" in model.mapped and model.unmapped == []
    assert yaml.safe_load(yaml.safe_dump(MEGATRON_DEFAULTS)) == MEGATRON_DEFAULTS


# ------------------------------------------------------------------ Megatron-LM's meaning
# Expectations written from Megatron-LM 0.19's megatron/training/arguments.py and training.py
# (update_train_iters, validate_args) and megatron-core 0.19's OptimizerConfig.

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
    "--max-position-embeddings 128 "
    "--micro-batch-size 1 --lr 1e-3 --data-path d "
)


def _convert(flags: str):
    return convert(read_megatron_args(BASE + flags))


def test_a_muon_script_gets_megatron_lms_muon_defaults() -> None:
    """No --muon-* flag: Megatron-LM's defaults, each in megatron-ext's spelling: momentum 0.9
    (its argparse default; megatron-core's OptimizerConfig says 0.95, which the script never
    sees), its 'quintic' schedule and TP mode blockwise (megatron-core's too)."""
    from megatron.core.optimizer import OptimizerConfig

    from megatron_ext.optimizers.muon_spec import MUON_COEFFICIENTS

    theirs = OptimizerConfig()
    o = load_recipe_dict(_convert("--global-batch-size 8 --train-iters 10 --optimizer muon").recipe)
    o = SimpleNamespace(**o.optimizer.flat())
    assert o.muon_momentum == 0.9
    assert o.muon_coefficient_type == MUON_COEFFICIENTS[theirs.muon_coefficient_type]
    assert o.muon_coefficient_type == "quintic_schedule"
    assert o.tp_mode == theirs.muon_tp_mode == "blockwise"
    given = "--optimizer muon --muon-coefficient-type simple --muon-tp-mode duplicated"
    o = load_recipe_dict(_convert(f"--global-batch-size 8 --train-iters 10 {given}").recipe)
    muon = o.optimizer.of(MuonOptions)
    assert (muon.coefficient_type, o.optimizer.tp_mode) == ("quintic", "duplicated")


def test_train_samples_round_down_at_a_constant_batch_as_megatron_lm() -> None:
    """update_train_iters: train_samples // global_batch_size (a step schedule counts steps
    until the samples are reached: test_sample_counts_follow_the_stage_table)."""
    conversion = _convert("--global-batch-size 8 --train-samples 1001")
    recipe = load_recipe_dict(conversion.recipe)
    assert run_steps(recipe.training) == 1001 // 8 == 125
    assert any("rounded down as Megatron-LM does" in n for n in conversion.notes)


def test_a_step_schedule_with_a_global_batch_is_refused_as_megatron_lm_does() -> None:
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match="Cannot specify both --step-batch-size-schedule"):
        _convert("--global-batch-size 8 --step-batch-size-schedule '0:8 1M:16' --train-iters 9")


def test_moe_fields_that_exist_are_mapped() -> None:
    """The DeepSeek-V3-style routing flags reach their fields (they were listed unmapped)."""
    flags = (
        "--global-batch-size 8 --train-iters 10 --num-experts 8 --moe-router-topk 4 "
        "--moe-layer-freq ([0]*1+[1]*1) --moe-shared-expert-intermediate-size 32 "
        "--moe-router-pre-softmax --moe-router-num-groups 4 --moe-router-group-topk 2 "
        "--moe-router-topk-scaling-factor 2.5 --moe-router-bias-update-rate 1e-4 "
        "--moe-router-dtype fp64 --moe-z-loss-coeff 1e-3 "
        "--exit-interval 7 --exit-duration-in-mins 30"
    )
    conversion = _convert(flags)
    assert conversion.unmapped == []
    recipe = load_recipe_dict(conversion.recipe)
    m, t = recipe.model, recipe.training
    assert m.moe_layer_freq == [0, 1]
    assert (m.moe_shared_expert_intermediate_size, m.moe_router_pre_softmax) == (32, True)
    assert (m.moe_router_num_groups, m.moe_router_group_topk) == (4, 2)
    assert (m.moe_router_topk_scaling_factor, m.moe_router_bias_update_rate) == (2.5, 1e-4)
    assert (m.moe_router_dtype, m.moe_z_loss_coeff) == ("fp64", 1e-3)
    assert (t.exit_interval, t.exit_duration_in_mins) == (7, 30.0)


@pytest.mark.parametrize(
    ("text", "layers"),
    [("([0]*3+[1]*5)", [0, 0, 0, 1, 1, 1, 1, 1]), ("([1]*2+[0]*1)*2", [1, 1, 0, 1, 1, 0])],
)
def test_layer_patterns_are_megatron_lms(text: str, layers: list[int]) -> None:
    from megatron_ext.megatron.from_megatron_groups import layer_pattern

    assert layer_pattern(text) == layers


@pytest.mark.parametrize("bad", ["__import__('os')", "[2]*3", "[0]*x", "([0]*3"])
def test_a_layer_pattern_is_never_evaluated_as_code(bad: str) -> None:
    from megatron_ext.megatron.from_megatron_groups import layer_pattern

    with pytest.raises(ValueError):
        layer_pattern(bad)


def test_a_model_changing_flag_is_exit_2_unless_allowed(tmp_path: Path, monkeypatch) -> None:
    from megatron_ext.launch.cli import main

    (tmp_path / "args.txt").write_text(
        BASE + "--global-batch-size 8 --train-iters 10 --fp16 --fp8-format hybrid\n"
    )
    proc = _cli("recipe", "from-megatron-args", "args.txt", "-o", "r.yaml", cwd=tmp_path)
    assert proc.returncode == 2 and not (tmp_path / "r.yaml").exists()
    assert proc.stderr.strip() == (
        "megatron-ext: error: the script trains a model, or reads data, that megatron-ext "
        "cannot express: "
        "--fp8-format hybrid (fp8=hybrid, fp8_recipe=delayed with fp16 parameters is not one "
        "of megatron-ext's precisions (fp32, bf16, fp8_tensorwise, fp8_delayed, fp8_blockwise, "
        "mxfp8, nvfp4, fp16: run/precision.py)); nothing written (pass --allow-unmapped to "
        "write the recipe without them, as comments in it)"
    )
    # the same command with --allow-unmapped, in this process (the exit code path ran above)
    monkeypatch.chdir(tmp_path)
    argv = ["recipe", "from-megatron-args", "args.txt", "-o", "r.yaml", "--allow-unmapped"]
    assert main(argv) == 0
    text = (tmp_path / "r.yaml").read_text()
    assert text.count("-- DROPPED: the recipe trains another model") == 1


def test_decoupled_lr_is_the_optimizer_section_s() -> None:
    """``--decoupled-lr`` / ``--decoupled-min-lr`` as Megatron-LM's parser reads them, mapped
    (not refused); ``--decoupled-min-lr`` alone, which megatron-core ignores, stays unmapped."""
    flags = BASE + "--global-batch-size 8 --train-iters 10 "
    out = convert(read_megatron_args(flags + "--decoupled-lr 5e-4 --decoupled-min-lr 4e-5"))
    assert out.recipe["optimizer"]["decoupled_lr"] == 5e-4
    assert out.recipe["optimizer"]["decoupled_min_lr"] == 4e-5
    assert {"--decoupled-lr 5e-4", "--decoupled-min-lr 4e-5"} <= set(out.mapped)
    alone = convert(read_megatron_args(flags + "--decoupled-min-lr 4e-5"))
    assert "decoupled_min_lr" not in alone.recipe.get("optimizer", {})
    assert [text for text, _ in alone.unmapped] == ["--decoupled-min-lr 4e-5"]


def test_another_entry_script_than_gpt_is_refused() -> None:
    from megatron_ext.errors import ConfigError

    script = f"torchrun --nproc_per_node 8 pretrain_bert.py {BASE} --global-batch-size 8 "
    with pytest.raises(ConfigError, match=r"runs pretrain_bert.py, not Megatron-LM's GPT"):
        convert(read_megatron_args(script + "--train-iters 10"))
    gpt = convert(read_megatron_args(script.replace("bert", "gpt") + "--train-iters 10"))
    assert gpt.launcher == ["--nproc_per_node 8"]  # the entry script is no flag value


def test_an_lr_schedule_longer_than_the_run_runs_as_in_megatron_lm(tmp_path: Path) -> None:
    """Megatron-LM's own Muon test configs: 100 steps of a 3,200-step warmup and a 320,000-step
    decay. Accepted; the dry run says where the run stops; the LR of every step is megatron-core's
    OptimizerParamScheduler's."""
    from megatron_ext.schedules.plan import training_schedule
    from tests.mcore_lr import megatron_core_lrs

    flags = (
        "--global-batch-size 8 --train-iters 100 --lr-warmup-iters 3200 "
        "--lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1e-5"
    )
    (tmp_path / "args.txt").write_text(BASE + flags + "\n")
    proc = _cli("recipe", "from-megatron-args", "args.txt", "-o", "r.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    # the flags' dataset is not here: the dry run checks it, so build one from a source
    dry = _cli(
        "launch",
        "r.yaml",
        "data.source=[python-stdlib]",
        "--dry-run",
        "--nproc-per-node",
        "1",
        cwd=tmp_path,
    )
    assert dry.returncode == 0, dry.stderr
    note = [line for line in dry.stderr.splitlines() if line.startswith("note: the LR")]
    assert note == [
        "note: the LR schedule is longer than the run, which stops at token 102,400 inside the "
        "warmup (it ends at token 3,276,800): its last step's lr is 3.094e-05 (0.0309 x "
        "optimizer.lr), as Megatron-LM runs such a schedule"
    ]
    loaded = load_recipe(tmp_path / "r.yaml")
    schedule = training_schedule(loaded.training, loaded.optimizer)

    theirs = megatron_core_lrs(
        range(100), max_lr=1e-3, min_lr=1e-5, warmup=3200, decay=320000, style="cosine"
    )
    for step, lr in theirs.items():
        assert schedule.lr_at(step) == pytest.approx(lr, rel=1e-12), step


def test_no_position_embedding_is_megatron_lms_rope_only_flag() -> None:
    """Megatron-LM 0.19 refuses it without RoPE (deprecated) and it changes nothing with RoPE."""
    from megatron_ext.errors import ConfigError

    flags = "--global-batch-size 8 --train-iters 10 --no-position-embedding"
    rope = _convert(flags + " --position-embedding-type rope")
    assert "--no-position-embedding" in rope.mapped and rope.unmapped == []
    with pytest.raises(ConfigError, match="--no-position-embedding is deprecated"):
        _convert(flags)  # validate_args's own message


OWN_PARSER = r"""#!/bin/bash
DATA="MOCK"
CKPT="none"
while [[ $# -gt 0 ]]; do
    case $1 in
        --data)
            DATA="$2"
            shift 2
            ;;
        -c|--checkpoint-path) CKPT="$2"; shift 2;;
        --fast) LAYERS=2; shift;;
        -h|--help)
            echo "  --data PATH        the data prefix"
            echo "  --num-layers N     not a flag of this script"
            exit 0
            ;;
    esac
done
LAYERS=${LAYERS:-4}
srun --ntasks-per-node 1 --cpus-per-task 16 torchrun --nproc_per_node 8 pretrain_gpt.py \
    --num-layers $LAYERS --hidden-size 64 --num-attention-heads 4 --seq-length 128 \
    --max-position-embeddings 128 \
    --micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 1e-3 \
    --data-path $DATA --save $CKPT --save-interval 100
"""


def test_a_scripts_own_option_parser_is_driven_by_script_options() -> None:
    """``case`` labels are the script's options, not Megatron-LM flags; the options given set
    the script's variables ("$2" or a literal), the others keep its defaults; ``echo`` text and
    srun's options are not read as Megatron-LM's."""
    given = ["--data", "data/doc", "-c", "runs/x"]
    args = read_megatron_args(OWN_PARSER, script_options=given)
    names = [f.name for f in args.flags]
    assert names[:2] == ["nproc_per_node", "num-layers"]  # no label, no help text, no srun option
    assert args.other_commands == [("srun", "--ntasks-per-node 1 --cpus-per-task 16")]
    recipe = load_recipe_dict(convert(args).recipe)
    assert (recipe.data.path, recipe.run_dir, recipe.model.num_layers) == ("data/doc", "runs/x", 4)
    fast = load_recipe_dict(
        convert(read_megatron_args(OWN_PARSER, script_options=["--fast"])).recipe
    )
    assert (fast.data.path, fast.run_dir, fast.model.num_layers) == ("MOCK", "none", 2)
    notes = convert(args).notes
    assert (
        "srun --ntasks-per-node 1 --cpus-per-task 16: srun's options, not Megatron-LM's: not read"
        in notes
    )


def test_script_options_on_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "train.sh").write_text(OWN_PARSER)
    proc = _cli(
        "recipe", "from-megatron-args", "train.sh", "-o", "r.yaml",
        "--script-options", "--data data/doc --checkpoint-path runs/y", cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    recipe = load_recipe(tmp_path / "r.yaml")
    assert (recipe.data.path, recipe.run_dir) == ("data/doc", "runs/y")


def test_a_tokenizer_megatron_ext_cannot_read_is_refused_not_swapped() -> None:
    """A dataset of another tokenizer's ids read with the byte tokenizer would be other tokens:
    a tokenizer megatron-ext does not read counts as model-changing (exit 2 in the CLI unless
    --allow-unmapped); GPT-2's files and Hugging Face folders are read (test_tokenizers_hf)."""
    flags = (
        "--global-batch-size 8 --train-iters 10 --tokenizer-type TikTokenizer "
        "--tokenizer-model tok.tiktoken"
    )
    assert _convert(flags).model_changing == [
        "--tokenizer-type TikTokenizer",
        "--tokenizer-model tok.tiktoken",
    ]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ("--train-iters 10 --train-samples 80", "expected iteration-based training"),
        ("--train-iters 10 --lr-decay-samples 80", "expected iteration-based learning rate decay"),
        ("--train-samples 80 --lr-warmup-iters 2", "expected sample-based learnig rate warmup"),
        ("--train-iters 10 --lr-warmup-fraction 0.1 --lr-warmup-iters 2", "can only specify one"),
    ],
)
def test_megatron_lms_counting_rules_are_applied(flags: str, message: str) -> None:
    """validate_args itself: iteration- and sample-counted flags do not mix (its messages)."""
    from megatron_ext.errors import ConfigError

    with pytest.raises(
        ConfigError, match=f"Megatron-LM's validate_args refuses the flags .*: {message}"
    ):
        _convert("--global-batch-size 8 " + flags)


@pytest.mark.parametrize(
    ("flags", "precision"),
    [
        ("--bf16 --fp8-format hybrid --fp8-recipe tensorwise", "fp8_tensorwise"),
        ("--bf16 --fp8-format hybrid", "fp8_delayed"),  # megatron-core's recipe default
        ("--bf16 --fp8-format e4m3 --fp8-recipe blockwise", "fp8_blockwise"),
        ("--bf16 --fp8-format e4m3 --fp8-recipe mxfp8", "mxfp8"),
        ("--bf16 --fp4-format e2m1", "nvfp4"),
    ],
)
def test_fp8_and_fp4_flags_are_the_precision_with_those_fields(flags: str, precision: str) -> None:
    """The precision whose megatron-core fields (run/precision.py) are the flags' values."""
    from megatron_ext.run.precision import SPECS

    conversion = _convert("--global-batch-size 8 --train-iters 10 " + flags)
    assert conversion.unmapped == [] and conversion.recipe["training"]["precision"] == precision
    spec = SPECS[precision]
    assert (spec.fp8 or spec.fp4) in flags


@pytest.mark.parametrize(
    ("flags", "precision", "fp8_format"),
    [
        ("--bf16 --fp8-format e4m3", "fp8_delayed", "e4m3"),
        ("--bf16 --fp8-format hybrid --fp8-recipe blockwise", "fp8_blockwise", "hybrid"),
        ("--bf16 --fp8-format e4m3 --fp8-recipe tensorwise", "fp8_tensorwise", "e4m3"),
    ],
)
def test_another_fp8_format_is_the_recipes_fp8_format(flags, precision, fp8_format) -> None:
    """A format other than the precision's is training.fp8_format, and the TransformerConfig
    the trainer builds equals Megatron-LM's field by field (megatron-core takes any format with
    any FP8 recipe; Megatron-LM's functional tests run hybrid + blockwise)."""
    from megatron_ext.config.load import recipe_from_dict
    from megatron_ext.megatron.megatron_compare import compare

    conversion = _convert("--global-batch-size 8 --train-iters 10 " + flags)
    training = conversion.recipe["training"]
    assert (training["precision"], training["fp8_format"]) == (precision, fp8_format)
    assert conversion.unmapped == [] and conversion.model_changing == []
    recipe = recipe_from_dict(conversion.recipe)
    assert compare(recipe, conversion.megatron, conversion.megatron.world_size) == {}


def test_fp8_over_fp32_parameters_is_the_recipes_params_dtype() -> None:
    """FP8 without --bf16 (Megatron-FSDP's functional tests run e4m3 + tensorwise so) keeps
    fp32 parameters: training.params_dtype float32, and the TransformerConfig equals
    Megatron-LM's (bf16 off, float32 dtypes); over fp16 parameters it is refused."""
    from megatron_ext.config.load import recipe_from_dict
    from megatron_ext.megatron.megatron_compare import compare

    flags = "--global-batch-size 8 --train-iters 10 --fp8-format e4m3 --fp8-recipe tensorwise"
    conversion = _convert(flags)
    training = conversion.recipe["training"]
    assert (training["precision"], training["fp8_format"], training["params_dtype"]) == (
        "fp8_tensorwise",
        "e4m3",
        "float32",
    )
    assert conversion.unmapped == [] and conversion.model_changing == []
    recipe = recipe_from_dict(conversion.recipe)
    assert compare(recipe, conversion.megatron, conversion.megatron.world_size) == {}
    half = _convert(flags.replace("--fp8-format", "--fp16 --fp8-format"))
    assert half.model_changing == ["--fp8-format e4m3", "--fp8-recipe tensorwise"]
    alone = _convert("--global-batch-size 8 --train-iters 10 --fp8-recipe tensorwise")
    assert alone.model_changing == [] and len(alone.unmapped) == 1


def test_the_distributed_timeout_becomes_the_collective_timeout_in_seconds() -> None:
    """--distributed-timeout-minutes (Megatron-LM's process groups' timeout) is the recipe's
    launch.collective_timeout_s (issue 42), in seconds."""
    args = read_megatron_args(
        SCRIPT.replace("--manual-gc", "--manual-gc --distributed-timeout-minutes 3"), SCRIPT_ARGS
    )
    conversion = convert(args)
    assert conversion.recipe["launch"]["collective_timeout_s"] == 180.0
    assert "--distributed-timeout-minutes 3" in conversion.mapped


def test_flags_named_as_recipe_fields_come_from_megatron_lms_parser() -> None:
    """A flag whose namespace attribute (Megatron-LM's own parser's dest) is named as a recipe
    field is that field with no hand-written row; the table keeps only renamed flags, and the
    flags read together with others (or negated) are not taken one field each."""
    from megatron_ext.megatron.from_megatron import same_name_flags
    from megatron_ext.megatron.megatron_flags import PLAIN, READ_TOGETHER
    from megatron_ext.megatron.megatron_parse import megatron_flag_dests

    same = same_name_flags()
    assert same["num-layers"] == ("model.num_layers", int)
    assert same["norm-epsilon"] == ("model.layernorm_epsilon", float)  # dest layernorm_epsilon
    assert same["lr-warmup-init"] == ("training.lr_warmup_init", float)
    assert same["qk-layernorm"] == ("model.qk_layernorm", None)  # a switch
    assert same["split"] == ("data.split", str) and same["seed"] == ("seed", int)
    assert not READ_TOGETHER & set(same)
    assert "disable-bias-linear" not in same  # store_false into add_bias_linear: a special
    dests = megatron_flag_dests()
    for flag, (path, _) in PLAIN.items():
        assert dests[flag][0] != path.rsplit(".", 1)[-1], f"--{flag}: named as its field"
