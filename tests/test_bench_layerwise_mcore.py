"""megatron-core's own ``LayerWiseDistributedOptimizer`` beside megatron-ext's
(``bench layerwise --against megatron-core``), on CPU/gloo through
``megatron_ext.megatron.cpu_compat_layerwise``.

One launch per DP size (1 and 2) of the bench's worker on a tiny GPT trains both arms for 20
interleaved steps from the same weights on the same batches. The peer is the real one: megatron-
core's ``get_megatron_optimizer`` with ``use_layer_wise_distributed_optimizer=True`` and Emerging-
Optimizers' Muon. Checked: the loss trajectories agree to 1e-5 relative at both DP sizes; each
arm at DP=2 really splits its optimizer state (the two ranks' state adds up to the DP=1 run's,
neither holding all of it); the collective counter sees megatron-core's gradient all-reduce as
a ring's 2·(n−1)/n of every fp32 gradient and megatron-ext's reduce-scatter-v at most half of
it; the bench's summary reads these files. Both launches and the checks: ~10 s.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

import megatron_ext.megatron.cpu_compat_layerwise as compat
from megatron_ext.bench._layerwise_mcore import ARMS, summarise
from tests.conftest import run_torchrun

STEPS = 20
TINY = ["--layers=2", "--hidden=64", "--vocab=128", "--seq=16", "--global-batch=4"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for dp in (1, 2):
        folder = tmp_path_factory.mktemp(f"dp{dp}")
        run_torchrun(
            "megatron_ext.bench._layerwise_mcore_worker",
            dp,
            *TINY,
            f"--steps={STEPS}",
            "--warmup=0",
            f"--max-steps={STEPS}",
            f"--out={folder}",
            module=True,
        )
        out[dp] = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(dp)]
    return out


@pytest.mark.parametrize("dp", [1, 2])
def test_loss_trajectories_agree_over_20_steps(runs, dp: int) -> None:
    rows = runs[dp][0]["rows"]
    core = [r["loss"] for r in rows["megatron_core"]]
    ext = [r["loss"] for r in rows["megatron_ext"]]
    assert len(core) == len(ext) == STEPS
    worst = max(abs(a - b) / abs(a) for a, b in zip(core, ext, strict=True))
    assert worst <= 1e-5, worst
    # the parameters moved (a frozen model would agree trivially) and moved alike
    assert len(set(core)) == STEPS
    assert max(runs[dp][0]["param_rel_diff"].values()) < 1e-4
    # megatron-core's layer-wise optimizer over EO's Muon and AdamW, each in its FP32Optimizer
    assert runs[dp][0]["arms"]["megatron_core"] == (
        "megatron-core LayerWiseDistributedOptimizer[FP32Optimizer(TensorParallelMuon), "
        "FP32Optimizer(AdamW)]; fp32, legacy layout, overlap_grad_reduce=True"
    )


def test_both_arms_split_their_optimizer_state_at_dp2(runs) -> None:
    for arm in ARMS:
        whole = runs[1][0]["state_bytes"][arm]
        parts = [r["state_bytes"][arm] for r in runs[2]]
        assert all(0 < p < whole for p in parts), (arm, parts, whole)
        if arm == "megatron_core":  # every parameter's state on one rank
            assert sum(parts) == whole
        else:  # and the small replicated ones' (norms) on every rank
            assert whole < sum(parts) < 1.01 * whole


def test_gradient_bytes_are_an_all_reduce_against_a_reduce_scatter(runs) -> None:
    params = runs[2][0]["parameters"]
    for rank in runs[2]:
        core = rank["rows"]["megatron_core"][-1]["grad_bytes"]
        ext = rank["rows"]["megatron_ext"][-1]["grad_bytes"]
        # ring all-reduce of every fp32 gradient at n = 2: 2·(n−1)/n·B = B each way
        assert core["reduce"]["sent"] == core["reduce"]["received"] == 4 * params
        moved = max(ext["reduce"]["sent"], ext["reduce"]["received"])
        assert 0 < moved <= 0.51 * 4 * params
    for rank in runs[1]:  # one rank: nothing on the wire
        for arm in ARMS:
            assert rank["rows"][arm][-1]["grad_bytes"]["reduce"]["calls"] == 0


def test_the_summary_reads_the_ranks(runs) -> None:
    two = summarise(runs[2], STEPS)
    assert two["dp"] == 2 and two["steps_run"] == STEPS
    assert two["loss_max_rel_diff"] <= 1e-5
    assert 0.45 <= two["grad_bytes_ratio"] <= 0.51
    assert two["param_bytes_recv_core"] > 0 and two["param_bytes_recv_ext"] > 0
    for key in ("iteration_ratio", "step_ratio", "fbs_ratio"):
        assert two[key] > 0 and two[f"{key}_spread"] >= 0
    # the paired peak-RSS difference, recomputed from the ranks' rows: every (rank, step) pair
    # after the warm-up, ours minus megatron-core's, in bytes
    warm = runs[2][0]["warmup"]
    diffs = sorted(
        (e["peak_rss_increase_kib"] - c["peak_rss_increase_kib"]) * 1024
        for r in runs[2]
        for c, e in zip(r["rows"][ARMS[0]][warm:], r["rows"][ARMS[1]][warm:], strict=True)
    )
    assert len(diffs) == 2 * (STEPS - warm)
    assert two["peak_rss_increase_diff"] == statistics.median(diffs)
    assert diffs[0] <= two["peak_rss_increase_diff_low"] <= two["peak_rss_increase_diff"]
    assert two["peak_rss_increase_diff"] <= two["peak_rss_increase_diff_high"] <= diffs[-1]


def test_compat_changes_nothing_when_cuda_present(monkeypatch) -> None:
    def patched(*args):
        raise AssertionError("a replacement was applied on a CUDA host")

    monkeypatch.setattr(compat.PATCHES, "applied", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(compat, "_replacements", patched)
    monkeypatch.setattr(compat, "apply_cpu_compat", patched)
    assert compat.apply_cpu_compat_layerwise() is False
    assert compat.PATCHES.applied is False


def test_compat_docstring_lists_every_replaced_call() -> None:
    doc = compat.__doc__.replace("\n", " ")
    for dotted in compat.replaced_calls():
        module, _, call = dotted.rpartition(".torch.")
        if not module:
            module, _, call = dotted.rpartition(".")
        assert module in doc and call.rsplit(".", 1)[-1] in doc, dotted


def test_the_gpu_script_dry_runs_here_and_refuses_to_run_without_a_gpu(capsys) -> None:
    from scripts.gpu_mcore_layerwise import main

    assert main(["--dry-run", "--out", "x.json", "--gpus", "4"]) == 0
    said = capsys.readouterr().out
    assert "imports ok" in said
    for part in ("--device cuda", "--precision bf16", "--mcore-layout padded", "--dp 1 2 4"):
        assert part in said, part
    if not torch.cuda.is_available():
        assert main(["--out", "x.json"]) == 2
        assert "no CUDA GPU visible" in capsys.readouterr().out


@pytest.mark.parametrize("option", [["--precision", "bf16"], ["--mcore-layout", "padded"]])
def test_what_needs_a_gpu_is_refused_on_the_cpu_in_one_line(option, capsys) -> None:
    import argparse

    from megatron_ext.bench import layerwise

    parser = argparse.ArgumentParser()
    layerwise.add_arguments(parser)
    args = parser.parse_args(["--against", "megatron-core", *option])
    assert layerwise.run(args) == 2
    said = capsys.readouterr().out.strip()
    assert "\n" not in said and "accept only torch.cuda tensors" in said


def test_the_byte_counter_also_wraps_megatron_cores_bound_aliases() -> None:
    """megatron-core's gradient buffer binds reduce-scatter and all-gather to module names at
    import (its padded layout calls them there): they are counted too, and restored after."""
    import megatron.core.distributed.param_and_grad_buffer as buffers
    import torch.distributed as dist

    from megatron_ext.bench._collective_bytes import CollectiveBytes

    before = (buffers.dist_reduce_scatter_func, buffers.dist_all_gather_func, dist.all_reduce)
    wire = CollectiveBytes()
    wire.install()
    try:
        assert buffers.dist_reduce_scatter_func is not before[0]
        assert buffers.dist_all_gather_func is not before[1] and dist.all_reduce is not before[2]
    finally:
        wire.uninstall()
    assert (
        buffers.dist_reduce_scatter_func,
        buffers.dist_all_gather_func,
        dist.all_reduce,
    ) == before
