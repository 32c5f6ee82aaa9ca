"""``megatron-ext bench layerwise``: the layer-wise distributed optimizer at several DP sizes.

For each ``--dp`` size, torchrun starts that many gloo ranks on this host (one compute thread
each; :mod:`megatron_ext.bench._layerwise_worker`), or with ``--device cuda`` that many NCCL ranks
with one GPU each.  Every rank builds the reference workload of
``bench optimizers`` (144 fp32 matrices, 29,360,128 parameters, seeded, the same on every rank),
sets the same gradients and runs ``--warmup`` + ``--steps`` steps of
:class:`~megatron_ext.distributed.layerwise.LayerwiseOptimizer`.

Figures, per DP size (never pass/fail):

* optimizer step = the rank's *CPU time* inside the optimizers' update calls (median over the
  timed steps).  The ranks share this host's cores, so wall time cannot show the division of
  work; wall time is reported beside it.  On GPUs (``--device cuda``) it is the wall time of the
  updates (synchronised).  ``slowest_step_s`` is the slowest rank's figure.
* exposed communication = wall seconds in ``finish()`` after the updates (the all-gathers not
  hidden behind later buckets' updates).
* parameter-sync bytes (the all-gather-v's payload counters) and whether each rank received
  exactly the bytes of the parameters it does not own (zero padding).
* gradient-sync bytes per rank: the measured payload of the layer-wise optimizer's
  reduce-scatter-v to the owners (sends B − owned, receives (n−1)·owned), beside what a ring
  all-reduce of every gradient would move each way, 2·(n−1)/n·B; and its wall time.
* the ownership plan's compute and memory imbalance (max / mean of its cost model per rank), and
  the measured compute imbalance (max / mean of the ranks' CPU seconds).

megatron-core's own ``LayerWiseDistributedOptimizer`` is not run: see ``MEGATRON_CORE_NOTE``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from megatron_ext.bench.common import write_json
from megatron_ext.bench.optimizers import Workload, add_workload_arguments

DESCRIPTION = (
    "layer-wise distributed optimizer at several DP sizes on the reference workload: step time, "
    "imbalance, gradient/parameter-sync bytes, exposed communication (figures + JSON)"
)

TARGET_SPEEDUP_DP4 = 0.28
TARGET_COMPUTE_IMBALANCE = 1.05
MEGATRON_CORE_NOTE = (
    "megatron-core's LayerWiseDistributedOptimizer: not compared -- in megatron-core 0.19.2 its "
    "bf16 path wraps the optimizers in Float16OptimizerWithFloat16Params, which accepts only "
    "torch.cuda tensors, and its fp32 path chains raw torch optimizers; it needs a GPU"
)
GRAD_SYNC_NOTE = (
    "gradient sync: each rank starts from its own share (gradient / dp) and the layer-wise "
    "optimizer's reduce-scatter-v (one all_to_all_single per bucket) leaves each sum on its "
    "owner; gradients are rounded to bf16-representable values so the sums are exact and DP=n "
    "stays bit-comparable with DP=1"
)


QUICK = {"dp": [1, 2], "layers": 1, "width": 128, "experts": 2, "steps": 1, "warmup": 0}
EXAMPLE = "megatron-ext bench layerwise --quick --json runs/bench_layerwise.json"
#: the JSON's top-level keys; ``dp`` holds one entry per DP size that ran
JSON_KEYS = (
    "optimizer",
    "workload",
    "host_cpus",
    "steps",
    "warmup",
    "device",
    "step_time",
    "dp",
    "speedup_ratio",
    "targets",
    "notes",
    "meta",
)
#: the baseline this benchmark's ratios are against (``meta.anchor`` of its JSON)
ANCHOR = "DP=1 in the same run (speedup: the slowest rank's step at DP=n / at DP=1)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_workload_arguments(parser)
    parser.add_argument(
        "--dp", type=int, nargs="+", default=[1, 2, 4], help="DP sizes to run (default 1 2 4)"
    )
    parser.add_argument(
        "--optimizer",
        choices=("muon", "kl_soap", "adamw"),
        default="muon",
        help="matrix optimizer (default muon)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument(
        "--bucket-numel",
        type=int,
        default=4_000_000,
        help="elements per all-gather bucket (default 4,000,000)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="parameter dtype (default fp32); bf16 keeps fp32 masters only where a rank updates",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: gloo ranks, one thread each (default); cuda: NCCL ranks, one GPU each",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")


def run(args: argparse.Namespace) -> int:
    if args.steps < 1 or args.warmup < 0 or any(n < 1 for n in args.dp):
        print("bench layerwise: --steps must be >= 1, --warmup >= 0 and every --dp >= 1")
        return 2
    if args.device == "cuda":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < max(args.dp):
            print(
                f"bench layerwise: --device cuda runs one rank per GPU; DP={max(args.dp)} needs "
                f"{max(args.dp)} GPUs and torch sees {gpus}; lower --dp or use --device cpu"
            )
            return 2
    ranks = (
        "NCCL ranks, one GPU each"
        if args.device == "cuda"
        else f"gloo ranks on this host ({os.cpu_count()} CPUs), one compute thread each"
    )
    workload = Workload.from_args(args)
    shapes = workload.shapes()
    matrices, parameters = len(shapes), sum(m * n for m, n in shapes)
    print(
        f"layer-wise optimizer, {args.optimizer}, {workload} ({workload.describe()}, "
        f"{args.precision}); {ranks}; {args.warmup} warmup + {args.steps} timed steps"
    )
    sizes = sorted(set(args.dp))
    per_dp: dict[str, dict[str, Any]] = {}
    fingerprints: dict[int, list[int]] = {}
    for n in sizes:
        started = time.perf_counter()
        ranks = _launch(n, args)
        if ranks is None:
            return 1
        per_dp[str(n)] = _summarise(ranks)
        fingerprints[n] = ranks[0]["fingerprint"]
        print(f"  DP={n}: done in {time.perf_counter() - started:.1f} s")
    base = per_dp.get("1")
    speedup = {
        n: (d["slowest_step_s"] / base["slowest_step_s"] if base else None)
        for n, d in per_dp.items()
    }
    for n, d in per_dp.items():
        d["params_equal_dp1"] = fingerprints[int(n)] == fingerprints[1] if base else None
    report: dict[str, Any] = {
        "optimizer": args.optimizer,
        "workload": {
            "layers": workload.layers,
            "width": workload.width,
            "experts": workload.experts,
            "matrices": matrices,
            "parameters": parameters,
            "dtype": args.precision,
        },
        "host_cpus": os.cpu_count(),
        "steps": args.steps,
        "warmup": args.warmup,
        "device": args.device,
        "step_time": (
            "per-rank wall time of the optimizer updates, one GPU per rank"
            if args.device == "cuda"
            else "per-rank CPU time of the optimizer updates, one thread per rank"
        ),
        "dp": per_dp,
        "speedup_ratio": speedup,
        "targets": _targets(per_dp, speedup),
        "notes": [GRAD_SYNC_NOTE, MEGATRON_CORE_NOTE],
    }
    _print_report(report)
    write_json(report, args.json)
    return 0


def _launch(n: int, args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """Run ``n`` worker ranks under torchrun; their per-rank JSON, or None on failure."""
    with tempfile.TemporaryDirectory(prefix="bench-layerwise-") as out:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={n}",
            "-m",
            "megatron_ext.bench._layerwise_worker",
            f"--optimizer={args.optimizer}",
            f"--layers={args.layers}",
            f"--width={args.width}",
            f"--experts={args.experts}",
            f"--steps={args.steps}",
            f"--warmup={args.warmup}",
            f"--bucket-numel={args.bucket_numel}",
            f"--precision={args.precision}",
            f"--device={args.device}",
            f"--out={out}",
        ]
        env = dict(os.environ)
        if args.device == "cpu":
            env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            print(f"DP={n}: the ranks failed (exit {proc.returncode}); their output:")
            print(proc.stdout[-4000:] + proc.stderr[-4000:])
            return None
        return [
            json.loads(Path(out, f"rank{r}.json").read_text(encoding="utf-8")) for r in range(n)
        ]


def _summarise(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-DP figures from the ranks' measurements (medians over steps, then max over ranks)."""
    n = len(ranks)
    total = ranks[0]["total_grad_bytes"]  # DDP reduces fp32 gradients whatever the params
    ring = 2 * (n - 1) / n
    per_rank = []
    for r in ranks:
        per_rank.append(
            {
                "rank": r["rank"],
                "compute_cpu_s": statistics.median(r["compute_cpu_s"]),
                "compute_process_cpu_s": statistics.median(r["compute_process_cpu_s"]),
                "compute_wall_s": statistics.median(r["compute_wall_s"]),
                "step_wall_s": statistics.median(r["step_wall_s"]),
                "exposed_comm_s": statistics.median(r["exposed_comm_s"]),
                "grad_sync_s": statistics.median(r["grad_sync_s"]),
                "owned_bytes": r["owned_bytes"],
                "not_owned_bytes": r["not_owned_bytes"],
                "param_sync_bytes_sent": r["param_sync_bytes_sent"],
                "param_sync_bytes_recv": r["param_sync_bytes_recv"],
                "param_sync_exact": r["param_sync_bytes_recv"] == r["not_owned_bytes"],
                "grad_sync_bytes_sent": r["grad_sync_bytes_sent"],
                "grad_sync_bytes_recv": r["grad_sync_bytes_recv"],
                "grad_sync_bytes_allreduce": ring * total,
                "plan_gflop": r["plan_compute_flops"][r["rank"]] / 1e9,
                "plan_state_mib": r["plan_memory_bytes"][r["rank"]] / 2**20,
                "master_mib": r["master_bytes"] / 2**20,
                "state_mib": r["state_bytes"] / 2**20,
            }
        )
    # the step time: CPU time on a shared CPU host, synchronised wall time on GPUs
    step_key = "compute_wall_s" if ranks[0]["device"] == "cuda" else "compute_cpu_s"
    cpu = [p[step_key] for p in per_rank]
    held = [p["master_mib"] + p["state_mib"] for p in per_rank]
    return {
        "slowest_step_s": max(cpu),
        "slowest_step_wall_s": max(p["compute_wall_s"] for p in per_rank),
        "compute_imbalance": ranks[0]["compute_imbalance"],
        "memory_imbalance": ranks[0]["memory_imbalance"],
        "measured_compute_imbalance": max(cpu) / (sum(cpu) / n),
        # fp32 masters + optimizer state actually held, per rank
        "held_memory_mib": max(held),
        "measured_memory_imbalance": max(held) / (sum(held) / n) if sum(held) else 1.0,
        "param_sync_bytes_recv": max(p["param_sync_bytes_recv"] for p in per_rank),
        "param_sync_exact": all(p["param_sync_exact"] for p in per_rank),
        # measured payload of the reduce-scatter-v (max over ranks of sent and received)
        "grad_sync_bytes": max(
            max(p["grad_sync_bytes_sent"], p["grad_sync_bytes_recv"]) for p in per_rank
        ),
        "grad_sync_bytes_allreduce": ring * total,  # a ring all-reduce, each way, per rank
        "grad_sync_s": max(p["grad_sync_s"] for p in per_rank),
        "exposed_comm_s": max(p["exposed_comm_s"] for p in per_rank),
        "buckets": ranks[0]["buckets"],
        "backend": ranks[0]["backend"],
        "ranks_agree": all(r["ranks_agree"] for r in ranks),
        "per_rank": per_rank,
    }


def _targets(per_dp: dict[str, dict[str, Any]], speedup: dict[str, Any]) -> dict[str, Any]:
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


def _print_report(report: dict[str, Any]) -> None:
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
