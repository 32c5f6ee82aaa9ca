"""The report of ``bench layerwise`` on the reference workload: targets and the printed tables
(split from :mod:`megatron_ext.bench.layerwise`)."""

from __future__ import annotations

from typing import Any

TARGET_SPEEDUP_DP4 = 0.28
TARGET_COMPUTE_IMBALANCE = 1.05


def targets(per_dp: dict[str, dict[str, Any]], speedup: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets, as figures with a met/not-met flag each (never an exit code)."""
    targets: dict[str, Any] = {}
    if speedup.get("4") is not None:
        targets["dp4_speedup_ratio"] = {
            "value": speedup["4"],
            "target": f"<= {TARGET_SPEEDUP_DP4}",
            "met": speedup["4"] <= TARGET_SPEEDUP_DP4,
        }
    worst = max(d["compute_imbalance"] for d in per_dp.values())
    targets["compute_imbalance"] = {
        "value": worst,
        "target": f"<= {TARGET_COMPUTE_IMBALANCE}",
        "met": worst <= TARGET_COMPUTE_IMBALANCE,
    }
    targets["zero_padding"] = {
        "value": all(d["param_sync_exact"] for d in per_dp.values()),
        "target": "param-sync bytes received == bytes of parameters not owned, every rank",
        "met": all(d["param_sync_exact"] for d in per_dp.values()),
    }
    multi = [d for n, d in per_dp.items() if int(n) > 1]
    if multi:
        targets["grad_sync_below_allreduce"] = {
            "value": max(d["grad_sync_bytes"] for d in multi),
            "target": "gradient-sync bytes below a ring all-reduce's",
            "met": all(d["grad_sync_bytes"] < d["grad_sync_bytes_allreduce"] for d in multi),
        }
    return targets


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def print_report(report: dict[str, Any]) -> None:
    print()
    header = (
        f"{'DP':>3s} {'rank':>4s} {'cpu s':>7s} {'proc s':>7s} {'wall s':>7s} {'step s':>7s} "
        f"{'exposed':>8s} {'GFLOP':>7s} {'MiB st':>7s} {'MiB m+s':>7s} {'ag sent MB':>10s} "
        f"{'ag recv MB':>10s} "
        f"{'=unowned':>8s} {'AR MB':>7s} {'RS MB':>7s}"
    )
    print(header)
    for n, d in report["dp"].items():
        for p in d["per_rank"]:
            print(
                f"{n:>3s} {p['rank']:>4d} {p['compute_cpu_s']:7.3f} "
                f"{p['compute_process_cpu_s']:7.3f} {p['compute_wall_s']:7.3f} "
                f"{p['step_wall_s']:7.3f} {p['exposed_comm_s']:8.3f} {p['plan_gflop']:7.1f} "
                f"{p['plan_state_mib']:7.1f} {p['master_mib'] + p['state_mib']:7.1f} "
                f"{_mb(p['param_sync_bytes_sent']):>10s} "
                f"{_mb(p['param_sync_bytes_recv']):>10s} "
                f"{'yes' if p['param_sync_exact'] else 'NO':>8s} "
                f"{_mb(p['grad_sync_bytes_allreduce']):>7s} "
                f"{_mb(max(p['grad_sync_bytes_sent'], p['grad_sync_bytes_recv'])):>7s}"
            )
    print(
        "cpu s: optimizer-update CPU time of the rank's thread per step (the step time); proc s:"
        " process CPU over the same spans (gloo threads included); wall s: wall time of the "
        "updates; step s: wall time of step() (updates + copies + all-gather launches); "
        "exposed: wall time in finish(); GFLOP / MiB st: the plan's cost model; MiB m+s: fp32 "
        "masters + optimizer state the rank holds (measured); ag: parameter "
        "all-gather payload per step; =unowned: received exactly the bytes of parameters owned "
        "elsewhere; AR: gradient-sync bytes per rank a ring all-reduce would move each way; RS: "
        "the measured reduce-scatter-v to the owners (max of sent, received)"
    )
    print()
    print(
        f"{'DP':>3s} {'slowest s':>9s} {'ratio':>6s} {'wall s':>7s} {'exposed':>8s} "
        f"{'plan imb':>8s} {'meas imb':>8s} {'mem imb':>7s} {'meas mem':>8s} {'buckets':>7s} "
        f"{'agree':>5s} "
        f"{'=DP1':>5s}"
    )
    for n, d in report["dp"].items():
        ratio = report["speedup_ratio"][n]
        equal = d["params_equal_dp1"]
        print(
            f"{n:>3s} {d['slowest_step_s']:9.3f} "
            f"{'-' if ratio is None else f'{ratio:.3f}':>6s} {d['slowest_step_wall_s']:7.3f} "
            f"{d['exposed_comm_s']:8.3f} {d['compute_imbalance']:8.3f} "
            f"{d['measured_compute_imbalance']:8.3f} {d['memory_imbalance']:7.3f} "
            f"{d['measured_memory_imbalance']:8.3f} "
            f"{d['buckets']:7d} {'yes' if d['ranks_agree'] else 'NO':>5s} "
            f"{'-' if equal is None else ('yes' if equal else 'no'):>5s}"
        )
    print(
        "slowest s: slowest rank's update CPU s per step; ratio: / DP=1; meas mem: max / mean "
        "over ranks of the masters + state held; agree: every rank ends "
        "with the same parameters (bit-exact); =DP1: the same bits as the DP=1 run"
    )
    print()
    for name, t in report["targets"].items():
        value = t["value"]
        shown = f"{value:.3f}" if isinstance(value, float) else str(value)
        if name == "grad_sync_below_allreduce":
            shown = f"{_mb(value)} MB per rank"
        print(f"target {name}: {shown} vs {t['target']}: {'met' if t['met'] else 'not met'}")
    for note in report["notes"]:
        print(note)
