"""``megatron-ext plan`` and the launcher's fit check: the command's text and JSON, its exit codes
and refusals, the first change that fits (which must then fit), and ``launch`` on a GPU host
refusing a job that does not fit unless ``--no-fit-check``.

Everything here is in-process and torch-free (the plan never imports torch: checked in a clean
interpreter). The figures themselves are checked against measured runs in
``test_planner_measure.py``; here the arithmetic of the model-parallel collectives is checked
against the formulas written out independently.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.config.load import read_recipe
from megatron_ext.errors import ConfigError
from megatron_ext.launch import launcher
from megatron_ext.launch.cli import main
from megatron_ext.launch.fit import check_fit, job_plan
from megatron_ext.launch.hosts import HostInfo
from megatron_ext.planner.gpus import gpu_kind, gpu_spec
from megatron_ext.planner.inputs import Cluster, plan_vocab_size
from megatron_ext.planner.plan import plan_recipe

H100_HOST = HostInfo(gpus=8, cpus=96, gpu_name="NVIDIA H100 80GB HBM3")
VOCAB = "model.vocab_size=128256"
#: gpt_8b at micro-batch 8 of 8192 tokens: ~400 GB of activations per rank at TP=4
TOO_BIG = [VOCAB, "training.micro_batch_size=8"]


def h100(nodes: int) -> Cluster:
    return Cluster(gpu_spec("h100"), nodes, 8)


def test_text_and_json_give_the_same_figures(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "gpt_8b", VOCAB, "optimizer.name=muon", "--nodes", "8"]
    assert main([*argv, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert figures["fits"] is True and text.rstrip().splitlines()[-1] == "FITS"
    assert f"{figures['peak_bytes'] / 1e9:8.2f} GB" in text
    assert figures["layout"] == {
        "tp": 4,
        "pp": 1,
        "cp": 1,
        "ep": 1,
        "dp": 16,
        "edp": 16,
        "sequence_parallel": True,
        "recompute": "none",
        "micro_batch": 1,
        "global_batch": 512,
        "seq": 8192,
        "recompute_method": "uniform",
        "recompute_num_layers": 1,
        "vp": 1,
        "vp_group": 1,
        "micro_batches": 32,
    }
    stage = figures["stages"][0]
    memory = stage["memory"]
    assert set(memory["optimizer_state"]) == {"muon", "adamw"}
    static = memory["parameters"] + memory["gradients"] + memory["masters"]
    assert memory["static"] == static + memory["optimizer_state_total"]
    assert memory["peak"] == memory["static"] + max(memory["activations"], memory["transient"])
    assert set(figures["baselines"]) == {"ours", "megatron_core_layerwise", "zero1"}
    assert figures["baselines"]["zero1"]["flops"] is None  # needs whole matrices


def test_tensor_parallel_bytes_follow_the_ring_formula() -> None:
    """gpt_8b, TP=4 with SP: per layer and micro-batch 2 all-gathers + 2 reduce-scatters
    forward and backward, each (tp-1)/tp of a tokens x hidden bf16 tensor."""
    plan = plan_recipe("gpt_8b", [VOCAB], h100(8))
    tokens, hidden, layers, micro = 8192, 4096, 32, 512 // 16
    ring = 2 * (4 - 1) * tokens * hidden * 2 // 4  # one all-reduce's worth per rank
    assert plan.stages[0].comm.tensor_parallel == (4 * ring * layers * micro,) * 2
    full = plan_recipe("gpt_8b", [VOCAB, "parallel.recompute_granularity=full"], h100(8))
    assert full.stages[0].comm.tensor_parallel[0] == 6 * ring * layers * micro  # forward again


def test_expert_all_to_all_and_pipeline_bytes() -> None:
    plan = plan_recipe("qwen3_30b_a3b", ["optimizer.name=muon"], h100(8))
    tokens, hidden, topk, ep, layers, micro = 4096, 2048, 8, 16, 48, 1024 // 32
    copies = tokens * topk * (ep - 1) // ep
    assert plan.stages[0].comm.expert_all_to_all[0] == 4 * copies * hidden * 2 * layers * micro
    pp = plan_recipe("gpt_8b", [VOCAB, "parallel.pipeline_model_parallel_size=2"], h100(8))
    micro = 512 // 8
    one = 8192 * 4096 * 2 // 4  # the activation, split over TP by sequence parallelism
    assert [s.comm.pipeline[0] for s in pp.stages] == [one * micro, one * micro]
    # 1F1B: the first stage keeps two micro-batches, the last one
    assert [s.in_flight for s in pp.stages] == [2, 1]


def test_a_layout_that_does_not_fit_names_a_change_that_fits(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["plan", "gpt_8b", *TOO_BIG, "--nodes", "8"]) == 1
    text = capsys.readouterr().out
    plan = plan_recipe("gpt_8b", TOO_BIG, h100(8))
    assert not plan.fits and plan.fix
    assert text.rstrip().splitlines()[-1] == f"DOES NOT FIT: first change that fits: {plan.fix}"
    fixed = plan_recipe("gpt_8b", [*TOO_BIG, *plan.fix.split()], h100(8))
    assert fixed.fits
    # the cheaper changes before it do not fit (it is the first)
    assert plan.fix == "parallel.recompute_granularity=full"
    selective = plan_recipe(
        "gpt_8b", [*TOO_BIG, "parallel.recompute_granularity=selective"], h100(8)
    )
    assert not selective.fits


def test_memory_falls_with_what_should_lower_it() -> None:
    base = plan_recipe("gpt_1b", [VOCAB, "optimizer.name=kl_soap"], h100(1)).worst.memory
    more_dp = plan_recipe("gpt_1b", [VOCAB, "optimizer.name=kl_soap"], h100(4)).worst.memory
    # the layer-wise plan shards the optimizer state over data-parallel ranks
    assert sum(more_dp.optimizer_state.values()) < sum(base.optimizer_state.values())
    assert more_dp.parameters == base.parameters and more_dp.gradients == base.gradients
    adamw_plan = plan_recipe("gpt_1b", [VOCAB], h100(4))
    adamw, dp = adamw_plan.worst.memory, adamw_plan.layout.dp
    # plain AdamW is element-sharded (ZeRO-1): a rank holds 1/dp of the moments (8 bytes per
    # element) and of the fp32 masters (4); the most loaded rank one element more per bucket
    elements, buckets = adamw.parameters // 2, 1000
    assert dp > 1
    assert 0 <= adamw.optimizer_state["adamw"] - 8 * elements / dp < 8 * buckets
    assert 0 <= adamw.masters - 4 * elements / dp < 4 * buckets


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gpt_1b", VOCAB, "--gpu", "v100"], "invalid choice"),
        (["gpt_8b", VOCAB, "--gpus-per-node", "3"], "not divisible by tp*pp*cp"),
        (["gpt_8b"], "model.vocab_size is unset"),
        (["soma_tiny"], "plans GPT runs"),
        (["gpt_1b", VOCAB, "--mfu", "1.5"], "--mfu 1.5"),
        (["gpt_1b", VOCAB, "--nodes", "0"], "--nodes 0"),
    ],
)
def test_bad_input_is_one_message_and_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        code = main(["plan", *argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_vocabulary_from_the_tokenizer(tmp_path: Path) -> None:
    assert plan_vocab_size(read_recipe("tiny_cpu_gpt")) == 258  # bytes + eod + pad
    from megatron_ext.data.tokenizers import ByteTokenizer

    assert ByteTokenizer().vocab_size == 258


def test_gpu_names_map_to_the_catalog() -> None:
    assert gpu_kind("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_kind("NVIDIA GB200") == "gb200" and gpu_kind("NVIDIA B200") == "b200"
    assert gpu_kind("NVIDIA A100-SXM4-80GB") == "a100"
    assert gpu_kind("Tesla V100-SXM2-32GB") is None


def test_launch_refuses_a_job_that_does_not_fit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(launcher, "probe_host", lambda: H100_HOST)
    run = [f"run_dir={tmp_path}", "--nnodes", "8", "--node-rank", "0"]
    # the recipe's dataset and tokenizer live on the cluster; the dry run checks them
    run += ["data.source=[python-stdlib]", "data.tokenizer=byte"]
    run += ["--rdzv-endpoint", "node0:29500", "--dry-run"]
    assert main(["launch", "gpt_8b", *TOO_BIG, *run]) == 2
    err = capsys.readouterr().err
    assert "DOES NOT FIT" in err  # the plan, printed by the dry run
    assert "error: the planned peak of" in err and "--no-fit-check" in err
    assert main(["launch", "gpt_8b", *TOO_BIG, *run, "--no-fit-check"]) == 0
    assert "DOES NOT FIT" in capsys.readouterr().err  # said, then launched anyway
    assert main(["launch", "gpt_8b", VOCAB, *run]) == 0
    assert capsys.readouterr().err.rstrip().endswith("\nFITS")


def test_no_plan_without_a_known_gpu() -> None:
    recipe = read_recipe("gpt_8b", [VOCAB])
    v100 = HostInfo(gpus=8, cpus=96, gpu_name="Tesla V100-SXM2-32GB")
    plan, why = job_plan(recipe, "gpt_8b", [VOCAB], 8, 8, v100)
    assert plan is None and "not in the plan's catalog" in why
    plan, why = job_plan(recipe, "gpt_8b", [VOCAB], 8, 8, HostInfo(gpus=0, cpus=8))
    assert plan is None and "no GPU" in why
    check_fit(None)  # nothing to check: no refusal
    plan, _ = job_plan(read_recipe("gpt_8b", TOO_BIG), "gpt_8b", TOO_BIG, 8, 8, H100_HOST)
    with pytest.raises(ConfigError, match=r"exceeds the 76\.0 GB usable"):
        check_fit(plan)


def test_the_plan_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch blocked')\n"
        "sys.meta_path.insert(0, Block())\n"
        "from megatron_ext.launch.cli import main\n"
        "code = main(['plan', 'qwen3_30b_a3b', 'optimizer.name=kl_soap', '--nodes', '4'])\n"
        "assert 'torch' not in sys.modules\n"
        "sys.exit(code)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode in (0, 1), proc.stderr
    assert "plan: qwen3_30b_a3b on 4 x 8" in proc.stdout


def test_a_dipaco_recipe_is_planned_as_its_outer_round(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_ext.planner.outer import plan_outer

    assert main(["plan", "dipaco_tiny", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    expected = plan_outer("dipaco_tiny").as_dict()
    assert figures == expected and figures["totals"]["store_bytes"] == 33_085_440
    assert main(["plan", "dipaco_tiny"]) == 0
    assert "(33,085,440 B)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["parallel.recompute_granularity=selective", "parallel.recompute_modules=[mlp]"],
            "recompute_modules=\\['mlp'\\]: the planner models selective recomputation of",
        ),
        (
            [
                "parallel.pipeline_model_parallel_size=2",
                "model.transformer_config={pipeline_model_parallel_layout: 'Et*16|t*16L'}",
            ],
            "pipeline_model_parallel_layout: the planner splits the layers by megatron-core's",
        ),
    ],
)
def test_the_plan_refuses_what_its_model_does_not_have(overrides: list, message: str) -> None:
    """Recomputation forms and uneven pipeline splits megatron-core has and the activation
    model does not: refused by name, not planned as another form."""
    with pytest.raises(ConfigError, match=message):
        plan_recipe("gpt_8b", [VOCAB, *overrides], h100(1))


def test_the_fit_check_skips_a_recipe_the_plan_has_no_model_for() -> None:
    """megatron-core trains a pipeline layout; the plan cannot size it, so the launcher's fit
    check on a GPU host skips it and says why (the dry run prints it) instead of refusing the
    launch."""
    overrides = [
        VOCAB,
        "parallel.pipeline_model_parallel_size=2",
        "model.transformer_config={pipeline_model_parallel_layout: 'Et*16|t*16L'}",
    ]
    recipe = read_recipe("gpt_8b", overrides)
    plan, why = job_plan(recipe, "gpt_8b", overrides, 8, 8, H100_HOST)
    assert plan is None
    assert why.startswith("no plan: model.transformer_config.pipeline_model_parallel_layout")
    check_fit(plan)  # nothing to check: the launch goes on


def test_full_recomputation_forms_are_planned_between_none_and_every_layer() -> None:
    """Full recomputation of the first 8 layers of each stage (block) keeps more than of every
    layer and less than none, and its step is cheaper than every layer's (fewer forwards run
    twice); the activations of each form against measurement: tests/test_planner_measure.py."""

    def plan(*overrides: str):
        return plan_recipe("gpt_8b", [VOCAB, *overrides], h100(8))

    none = plan()
    every = plan("parallel.recompute_granularity=full")
    block = plan(
        "parallel.recompute_granularity=full",
        "parallel.recompute_method=block",
        "parallel.recompute_num_layers=8",
    )
    kept = [p.worst.memory.activations for p in (every, block, none)]
    assert kept[0] < kept[1] < kept[2]
    compute = [p.step.compute_s for p in (none, block, every)]
    assert compute[0] < compute[1] < compute[2]
