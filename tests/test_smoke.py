"""Everything that ships runs: every benchmark in its ``--quick`` form, every command-line leaf.

The benchmarks are discovered from their registry (:func:`megatron_ext.bench.benchmarks`), so a
new benchmark is smoke-run here the moment it exists and fails this file until it declares its
quick form (``QUICK``, ``EXAMPLE``, ``JSON_KEYS``) and has a check of its figures in
``BENCH_CHECKS``. The command line is walked the same way (every sub-command and every action
of one): each leaf names the test that runs it end to end, and a leaf without one fails.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.bench import benchmarks
from megatron_ext.progress import QUIET_VAR
from tests.conftest import run_cli

# ---------------------------------------------------------------------------------------------
# benchmarks


def _finite_positive(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x) and x > 0


def check_optimizers(report: dict[str, Any], out: str, folder: Path) -> None:
    from megatron_ext.bench.optimizers import DEFAULT_MODES, Workload

    shapes = Workload(layers=1, width=128, experts=2).shapes()
    numel = sum(m * n for m, n in shapes)
    assert report["workload"]["parameters"] == numel and report["workload"]["matrices"] == 8
    results = report["results"]
    assert set(results) == set(DEFAULT_MODES)  # emerging-optimizers is a test dependency
    for mode, r in results.items():
        assert _finite_positive(r["s_per_step"]), mode
        assert mode in out
    for mode in ("muon_quintic", "muon_quintic_plain", "muon_polar_express", "emerging_muon"):
        assert 0 < results[mode]["ortho_error"] < 0.3, mode  # a few NS steps: near, not at UVᵀ
    assert results["muon_polar_express"]["ortho_error"] < results["muon_quintic"]["ortho_error"]
    assert results["mop"]["ortho_error"] < 1e-5  # the exact polar factor
    # state: one fp32 momentum (Muon, Lion), two moments (AdamW), factors + bases (KL-SOAP)
    assert results["muon_quintic"]["state_bytes"] == 4 * numel == results["lion"]["state_bytes"]
    assert 8 * numel <= results["adamw"]["state_bytes"] <= 8 * numel + 64 * len(shapes)
    assert results["kl_soap_qr"]["state_bytes"] > 8 * numel
    assert report["ratios"]["kl_soap_state_vs_emerging"] == 1.0
    # interleaved by default; --quick: one round, then the budget (0 s) stops it
    repeat = report["interleave"] is True and report["repeat"]
    assert repeat["rounds"] == 1 and "budget" in repeat["stopped"]
    assert repeat["pair_ratios"]["muon_quintic_vs_emerging"]["median"] == pytest.approx(
        results["muon_quintic"]["s_per_step"] / results["emerging_muon"]["s_per_step"]
    )
    assert "muon_quintic_vs_emerging: median per-round ratio" in out


def check_layerwise(report: dict[str, Any], out: str, folder: Path) -> None:
    assert set(report["dp"]) == {"1", "2"} and report["workload"]["matrices"] == 8
    for n, d in report["dp"].items():
        assert d["params_equal_dp1"] is True and d["ranks_agree"] is True, n  # same bits
        assert d["param_sync_exact"] is True, n  # each rank received exactly what it lacks
        assert _finite_positive(d["slowest_step_s"]), n
    fp32_bytes = 4 * report["workload"]["parameters"]
    two = report["dp"]["2"]
    owned = [r["owned_bytes"] for r in two["per_rank"]]
    assert sum(owned) == fp32_bytes and all(owned)  # whole matrices split over both ranks
    assert 0 < two["grad_sync_bytes"] < two["grad_sync_bytes_allreduce"]
    assert all(t["met"] for t in report["targets"].values()), report["targets"]
    assert "DP=2" in out


def check_soma(report: dict[str, Any], out: str, folder: Path) -> None:
    spsa = report["spsa"]
    assert set(spsa["median_s"]) >= {"eager", "torch_nn", "own_kernels"}
    assert spsa["fused_unavailable_reason"] == "skipped (--skip-compiled)"
    for name, seconds in spsa["median_s"].items():
        assert _finite_positive(seconds), name
    for name, diff in spsa["max_loss_difference_vs_batched_eager"].items():
        assert diff < 1e-5, name  # every variant computes the same losses
    assert spsa["speedup"] == pytest.approx(spsa["naive_s"] / spsa["batched_s"], rel=1e-9)
    # one round (--quick): its per-round speedup is the fastest-round one, no spread yet
    assert spsa["rounds"] == 1 and spsa["speedup_rounds"]["spread"] is None
    assert spsa["speedup_rounds"]["median"] == pytest.approx(spsa["speedup"], rel=1e-9)
    for sweep in ("equal_total", "equal_expert"):
        rows = report["inference"][sweep]["rows"]
        assert [r["n_experts"] for r in rows] == [8, 32], sweep
        assert all(_finite_positive(r["tokens_per_s"]) for r in rows), sweep
    totals = [r["total_params"] for r in report["inference"]["equal_total"]["rows"]]
    assert max(totals) / min(totals) < 1.05  # equal total parameters, to the width's rounding


def check_convergence(report: dict[str, Any], out: str, folder: Path) -> None:
    """Each variant trains the same tokens through the launcher; the JSON's losses are the
    runs' own metrics; the same data and schedule give the same first loss."""
    results = report["results"]
    assert set(results) == {"adamw", "muon"}
    for name, r in results.items():
        assert r["tokens"] == 12 * 16 * 128, name  # --steps 12 of the recipe's batch and length
        rows = [json.loads(x) for x in (folder / name / "metrics.jsonl").read_text().splitlines()]
        losses = [x["loss"] for x in rows if "loss" in x]
        assert r["train_loss"] == pytest.approx(sum(losses[-4:]) / 4), name  # --last 4
        assert r["train_loss"] < math.log(256), name  # below the uniform byte model: it learns
        assert r["val_loss"] is not None and 0 < r["optimizer_share"] < 1, name
    summaries = {n: json.loads((folder / n / "summary.json").read_text()) for n in results}
    assert summaries["adamw"]["optimizer"] == "adamw" and summaries["muon"]["optimizer"] == "muon"
    assert summaries["adamw"]["first_loss"] == summaries["muon"]["first_loss"]
    assert (folder / "convergence.png").stat().st_size > 10_000
    assert "training.lr_warmup_steps 30 -> 1" in out  # the schedule scaled with --steps
    assert "optimizer" in out and "muon" in out


def check_precision(report: dict[str, Any], out: str, folder: Path) -> None:
    """A real A/B: both runs through the launcher, the second from the first's step 0."""
    assert report["precisions"] == ["fp32", "bf16"] and report["steps"] == 8
    assert "loss at matched tokens" in out and "MFU against: CPU" in out
    assert "training.lr_warmup_steps 30 -> 1" in out  # the schedule scaled with --steps
    fp32, bf16 = (report["results"][p] for p in ("fp32", "bf16"))
    start = folder / "fp32" / "checkpoints" / "step_000000"
    assert report["start_checkpoint"] == str(start) and (start / "metadata.json").is_file()
    assert f"initial weights from {start}" in (folder / "bf16" / "run.log").read_text()
    curves = report["curves"]
    tokens = [16 * 128 * step for step in range(1, 9)]
    assert curves["fp32"]["tokens"] == curves["bf16"]["tokens"] == tokens
    # the same weights, data and seed: the first losses differ by bf16 rounding only
    assert abs(curves["bf16"]["loss"][0] - curves["fp32"]["loss"][0]) < 5e-3
    assert fp32["final_loss_delta"] == 0.0
    assert bf16["final_loss_delta"] == bf16["final_loss"] - fp32["final_loss"]
    assert abs(bf16["final_loss_delta"]) < 0.1
    for r in (fp32, bf16):
        assert _finite_positive(r["tokens_per_s_per_device"]) and r["mfu"] > 0
        assert r["memory"]["peak_rss_bytes"] > 0 and r["memory"]["peak_allocated_bytes"] is None
    assert (folder / "precision.png").stat().st_size > 10_000
    assert fp32["step_time_vs_reference"]["median"] == 1.0  # each step over itself
    assert report["load"]["interleaved"] is False and "step time bf16 / fp32" in out


def check_ramp(report: dict[str, Any], out: str, folder: Path) -> None:
    constant, ramp = report["results"]["constant"], report["results"]["ramp"]
    assert constant["tokens"] == ramp["tokens"] == 16 * 16 * 128  # equal tokens
    batches = report["curves"]["ramp"]["global_batch"]
    assert batches[0] == 4 and batches[-1] == 16 and batches == sorted(batches)
    assert set(report["curves"]["constant"]["global_batch"]) == {16}
    assert ramp["steps"] > constant["steps"]


def check_dipaco(report: dict[str, Any], out: str, folder: Path) -> None:
    comm, own = report["comm"], report["comm_path_specific_embedding"]
    assert comm["bytes_ratio_vs_ddp"] == pytest.approx(1 / report["tau"], rel=1e-9)
    assert own["bytes_ratio_vs_ddp"] < comm["bytes_ratio_vs_ddp"]  # the embedding never moves
    assert len(report["outer"]) == 2  # --sizes 100000 x --paths 1 4
    backends = {q["backend"] for q in report["queue"]}
    assert backends == {"sqlite", "postgresql"}  # the server binaries are on every test host
    for backend in backends:
        assert [q["clients"] for q in report["queue"] if q["backend"] == backend] == [1, 2]
    for q in report["queue"]:
        assert q["tasks"] == 20 and _finite_positive(q["tasks_per_s"]), q
        assert 0 < q["median_ms"] <= q["p95_ms"], q


def check_plan(report: dict[str, Any], out: str, folder: Path) -> None:
    from megatron_ext.planner.gpus import gpu_spec
    from megatron_ext.planner.inputs import Cluster
    from megatron_ext.planner.plan import plan_recipe

    rows = report["rows"]
    assert [(r["gpus"], r["optimizer"]) for r in rows] == [
        (8, "adamw"),
        (8, "muon"),
        (64, "adamw"),
        (64, "muon"),
    ]
    plans = []
    for r in rows:  # each row is the plan `megatron-ext plan` makes of the same settings
        cluster = Cluster(gpu_spec("h100"), r["gpus"] // 8, 8)
        plan = plan_recipe("gpt_1b", r["overrides"], cluster)
        plans.append(plan)
        assert r["peak_gb"] == plan.worst.memory.peak / 1e9 and r["fits"] == plan.fits
        assert r["layout"]["dp"] == r["gpus"]  # gpt_1b: TP = PP = 1
        assert r["layout"]["global_batch"] % (r["layout"]["micro_batch"] * r["gpus"]) == 0
    adamw, muon = rows[2], rows[3]
    # AdamW element-sharded (ZeRO-1, as the trainer holds it): a rank's moments are 8 bytes for
    # 1/DP of the elements, 8x less over 64 ranks than over 8
    total = plans[2].total_params
    assert adamw["optimizer_state_gb"] == pytest.approx(8 * total / 64 / 1e9, rel=1e-3)
    assert rows[0]["optimizer_state_gb"] == pytest.approx(8 * adamw["optimizer_state_gb"], rel=1e-3)
    # layer-wise Muon over 64 ranks: the AdamW-routed embedding and output layer (128256 x 2048
    # each) element-sharded the same way, plus whole matrices' Muon momentum; no rank holds a
    # whole embedding's AdamW moments any more
    embedding = 8 * 128256 * 2048 / 1e9
    assert 2 * embedding / 64 < muon["optimizer_state_gb"] < embedding / 4
    dps = [b["dp"] for b in report["balance"]]
    assert dps == [2, 4, 8, 64]
    for b in report["balance"]:
        assert abs(b["ZeRO-1"]["state_imbalance"] - 1) < 0.05  # even slices (Muon: by element)
    assert report["balance"][-1]["ours"]["state_imbalance"] > 1.5  # 64 ranks, 64 matrices
    assert "| gpt_1b | 64 | muon |" in (folder / "plan.md").read_text()
    assert (folder / "plan_balance.png").stat().st_size > 10_000


def check_paper(report: dict[str, Any], out: str, folder: Path) -> None:
    """The benchmark's EXAMPLE runs the ``optimizers`` study: its report and figure checks;
    then ``--from-runs`` rebuilds the same claims from its run folders, launching nothing, and
    names a run that did not finish."""
    import math

    from megatron_ext.bench.paper.optimizers import run_study
    from megatron_ext.errors import ConfigError
    from tests.test_bench_paper_studies import check_report

    check_report("optimizers", report, out, folder)
    rebuilt = run_study("quick", report["seeds"], folder, from_runs=True)
    for mine, theirs in zip(rebuilt.claims, report["claims"], strict=True):
        assert mine.id == theirs["id"]
        for a, b in zip(mine.values, theirs["values"], strict=True):
            assert a == b or (math.isnan(a) and math.isnan(b)), mine.id
    assert rebuilt.settings["from_runs"] and rebuilt.settings["runs"] == report["settings"]["runs"]
    assert rebuilt.settings["wall_s"] > 0
    (folder / "runs" / "lr.adamw.1" / "seed1" / "summary.json").unlink()
    with pytest.raises(ConfigError, match=r"lr\.adamw\.1/seed1 is not a finished run"):
        run_study("quick", report["seeds"], folder, from_runs=True)


#: benchmark name -> the check of its quick run's JSON and output
BENCH_CHECKS: dict[str, Callable[[dict[str, Any], str, Path], None]] = {
    "optimizers": check_optimizers,
    "layerwise": check_layerwise,
    "soma": check_soma,
    "convergence": check_convergence,
    "precision": check_precision,
    "ramp": check_ramp,
    "dipaco": check_dipaco,
    "plan": check_plan,
    "paper": check_paper,
}


def test_every_benchmark_declares_its_quick_form_and_has_a_check() -> None:
    from megatron_ext.bench.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    found = benchmarks()
    assert set(found) == set(BENCH_CHECKS), "a benchmark without a smoke check (BENCH_CHECKS)"
    for name, module in found.items():
        assert module.EXAMPLE.startswith(f"megatron-ext bench {name} ") and "--quick" in (
            module.EXAMPLE
        ), name
        assert module.JSON_KEYS and len(set(module.JSON_KEYS)) == len(module.JSON_KEYS), name
        args = parser.parse_args(shlex.split(module.EXAMPLE)[2:])
        for key in module.QUICK:  # every quick setting is one of the benchmark's options
            assert hasattr(args, key), (name, key)


def _quick_argv(name: str, tmp: Path) -> list[str]:
    """The module's EXAMPLE, with its outputs in ``tmp``."""
    argv = shlex.split(benchmarks()[name].EXAMPLE)[1:]
    if "--json" in argv:
        argv = argv[: argv.index("--json")] + argv[argv.index("--json") + 2 :]
    argv += ["--json", str(tmp / "report.json")]
    from megatron_ext.bench.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    if hasattr(parser.parse_args(argv[1:]), "out"):
        argv += ["--out", str(tmp / "out")]
    return argv


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


#: the benchmarks whose runs go through the launcher (``bench.common.launch_run``); their smoke
#: runs call ``megatron-ext bench`` in this process with the runs' ranks forked warm
#: (:func:`tests.conftest.warm_launch_run`): ~9 CPU-s of interpreter and imports saved per run
#: (30 runs in ``paper``'s quick study). The launcher itself runs cold in its own tests.
LAUNCHER_BENCHMARKS = frozenset({"convergence", "precision", "ramp", "paper"})


@pytest.mark.parametrize("name", sorted(benchmarks()))
def test_benchmark_quick_run(
    name: str, tmp_path: Path, request: pytest.FixtureRequest, capfd: pytest.CaptureFixture
) -> None:
    """``megatron-ext bench NAME --quick`` as a user runs it: exit 0, every documented JSON key
    and no other, and figures that hold what the benchmark measures. The benchmarks of
    :data:`LAUNCHER_BENCHMARKS` run in this process (the CLI's ``main``), their launcher runs
    warm; the others as a process of their own."""
    argv = _quick_argv(name, tmp_path)
    if name in LAUNCHER_BENCHMARKS:
        import torch

        from megatron_ext.launch.cli import main

        runs = request.getfixturevalue("warm_benchmark_runs")
        monkeypatch = request.getfixturevalue("monkeypatch")
        monkeypatch.chdir(tmp_path)
        bar = _Terminal()
        if name == "ramp":  # one real benchmark on a terminal: its bar (tests/test_progress.py)
            monkeypatch.setenv(QUIET_VAR, "0")
            monkeypatch.setattr(sys, "stderr", bar)
        threads = torch.get_num_threads()
        try:
            code = main(argv)
        finally:
            torch.set_num_threads(threads)
        stdout, stderr = capfd.readouterr()
        assert code == 0, stdout[-3000:] + stderr[-3000:]
        if name == "ramp":  # each run named while it runs, the bar erased at the end
            shown = bar.getvalue()
            assert "megatron-ext: bench ramp: runs:" in shown and "2/2 [" in shown, shown
            assert "constant (1/2)" in shown and "ramp (2/2)" in shown and shown.endswith("\r")
        assert runs["calls"] == len(list(tmp_path.glob("out/**/metrics.jsonl"))) > 0
    else:
        stdout = run_cli(argv, tmp_path).stdout
    assert f"[{name}] --quick:" in stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report) == set(benchmarks()[name].JSON_KEYS)
    BENCH_CHECKS[name](report, stdout, tmp_path / "out")


# ---------------------------------------------------------------------------------------------
# the command line

#: every leaf of ``megatron-ext`` -> the test that runs it end to end (a subprocess of the CLI,
#: or its ``main``), ``tests/FILE.py::FUNCTION``
COMMAND_TESTS = {
    "launch": "test_preemption.py::test_stop_signals_and_exit_interval_resume_bit_identical",
    "train": "test_convert_continue.py::test_training_continues_from_a_converted_olmoe",
    "bench": "test_smoke.py::test_benchmark_quick_run",
    "ckpt verify": "test_checkpoint_manifest.py::"
    "test_ckpt_verify_reports_each_checkpoint_and_what_auto_would_load",
    "ckpt upgrade": "test_checkpoint_legacy.py::"
    "test_each_upgraded_layout_resumes_as_the_old_code_did",
    "plan": "test_planner_cli.py::test_text_and_json_give_the_same_figures",
    "recipe from-megatron-args": "test_from_megatron.py::"
    "test_round_trip_the_recipes_dry_run_shows_the_scripts_schedule",
    "recipe check-megatron": "test_check_megatron.py::"
    "test_check_megatron_reports_each_file_and_the_total",
    "tools eps-sweep": "test_convert_eps_sweep.py::"
    "test_near_epsilon_model_peaks_at_one_and_falls_at_a_tenth",
    "convert hf-to-mcore": "test_convert_cli.py::test_hf_to_mcore_then_check",
    "convert mcore-to-hf": "test_convert_cli.py::test_hf_to_mcore_then_check",
    "convert check": "test_convert_cli.py::test_hf_to_mcore_then_check",
    "data build": "test_data.py::test_cli_build_and_tokenizer",
    "data tokenizer": "test_data.py::test_cli_build_and_tokenizer",
    "dipaco worker": "test_dipaco_trainer.py::test_the_base_model_can_be_a_gpt_trainer_checkpoint",
    "dipaco status": "test_dipaco_trainer.py::"
    "test_the_launched_run_completes_with_a_summary_and_status",
    "soma eval": "test_soma_trainer.py::test_soma_eval_and_generate_on_a_trained_run",
    "soma generate": "test_soma_trainer.py::test_soma_eval_and_generate_on_a_trained_run",
    "soma variance": "test_soma_variance.py::test_the_variance_command_writes_the_paper_claims",
    "docs results": "test_docs_results.py::test_check_fails_after_a_json_value_changes",
}


def _command_leaves() -> list[str]:
    from megatron_ext.launch.cli import build_parser

    def choices(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                return dict(action.choices)
        return {}

    leaves = []
    for name, parser in choices(build_parser()).items():
        actions = {} if name == "bench" else choices(parser)  # bench: the benchmarks above
        leaves += [f"{name} {a}" for a in actions] or [name]
    return leaves


def test_every_command_leaf_names_a_test_that_runs_it() -> None:
    """Each leaf's test exists, and its file calls the leaf by its words (as CLI arguments; the
    run may sit in a fixture of that file)."""
    leaves = _command_leaves()
    assert sorted(leaves) == sorted(COMMAND_TESTS), "a command without a smoke test"
    for leaf, node in COMMAND_TESTS.items():
        file, function = node.split("::")
        # read, not imported: importing the test modules (torch, megatron-core, transformers
        # and their fixtures' imports) was most of this test's time
        source = (Path(__file__).parent / file).read_text(encoding="utf-8")
        tests = {
            n.name
            for n in ast.parse(source).body
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        assert function in tests, f"{leaf}: {node} does not exist"
        missing = [w for w in leaf.split() if f'"{w}"' not in source]
        assert missing == [] or leaf == "bench", f"{leaf}: {file} never passes {missing}"
