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
  all-reduce of every gradient would move each way, 2·(n−1)/n·B; and its wall time (the
  path a training run takes: the gradients in the optimizer's storage, each bucket started as
  its gradients are reported complete, no copy in or out).
* the ownership plan's compute and memory imbalance (max / mean of its cost model per rank), and
  the measured compute imbalance (max / mean of the ranks' CPU seconds).

The DP=n / DP=1 ratio is measured in rounds (:mod:`megatron_ext.bench._trust`): each round
launches every DP size once, in alternating order, until the speedup ratios' spread is at most
``--spread`` or ``--budget`` seconds pass (at least ``--rounds`` rounds); the ratio is the
median of the per-round ratios, printed with its spread.

``--against megatron-core`` runs megatron-core's own ``LayerWiseDistributedOptimizer`` beside
megatron-ext's on a GPT instead (:mod:`megatron_ext.bench._layerwise_mcore`).
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

from megatron_ext.bench._layerwise_mcore import add_against_arguments, run_against
from megatron_ext.bench._layerwise_report import print_report, targets
from megatron_ext.bench._trust import (
    Repeat,
    add_trust_arguments,
    load_check,
    ratio_spread,
    round_order,
)
from megatron_ext.bench.common import progress, write_json
from megatron_ext.bench.optimizers import Workload, add_workload_arguments
from megatron_ext.optimizers import registered_optimizers

DESCRIPTION = (
    "layer-wise distributed optimizer at several DP sizes on the reference workload: step time, "
    "imbalance, gradient/parameter-sync bytes, exposed communication (figures + JSON)"
)

MEGATRON_CORE_NOTE = (
    "megatron-core's LayerWiseDistributedOptimizer: compared on a GPT by "
    "`megatron-ext bench layerwise --against megatron-core` (this workload is bare matrices, "
    "without the model and DDP its optimizer needs)"
)
GRAD_SYNC_NOTE = (
    "gradient sync: the training path -- each rank's gradient in the optimizer's own storage, "
    "reported complete parameter by parameter as backward would (later ones first), each "
    "bucket scaled by 1/dp and its reduce-scatter-v (one batched point-to-point exchange) "
    "started as it fills, waited for in finish_grad_sync; gradients are rounded to "
    "bf16-representable values so the sums are exact and DP=n stays bit-comparable with DP=1"
)


QUICK = {
    "dp": [1, 2],
    "layers": 1,
    "width": 128,
    "experts": 2,
    "steps": 1,
    "warmup": 0,
    "budget": 0.0,
}
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
        choices=tuple(registered_optimizers()),
        default="muon",
        help="the optimizer of the matrices (default muon; any registered one)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="timed steps per launch (default 3); --against: interleaved steps at least "
        "(default 20)",
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="launch rounds at least (default 1; see --spread)"
    )
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
    add_trust_arguments(parser, budget_s=60.0)
    add_against_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.steps is None:
        args.steps = 20 if args.against else 3
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1 or any(n < 1 for n in args.dp):
        print("bench layerwise: --steps, --rounds and every --dp must be >= 1, --warmup >= 0")
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
    if args.against:
        return run_against(args)
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
    cores = min(max(sizes), os.cpu_count() or 1)
    load = load_check(cores, "bench layerwise") if args.device == "cpu" else None
    per_dp: dict[str, dict[str, Any]] = {}
    fingerprints: dict[int, list[int]] = {}
    slowest: dict[int, list[float]] = {n: [] for n in sizes}
    repeat = Repeat(args.spread, args.budget, min_rounds=args.rounds, max_rounds=args.max_rounds)
    rounds = 0
    # the repeat rule decides the rounds: the bar counts launches, no total
    with progress("layerwise", "torchrun launches", None, unit="launch") as shown:
        while True:  # rounds of one launch per DP size, alternating order (bench._trust)
            for n in round_order(sizes, rounds):
                started = time.perf_counter()
                with shown.running(f"round {rounds + 1}, DP={n}"):
                    ranks = _launch(n, args)
                if ranks is None:
                    return 1
                per_dp[str(n)] = _summarise(ranks)
                slowest[n].append(per_dp[str(n)]["slowest_step_s"])
                fingerprints[n] = ranks[0]["fingerprint"]
                print(
                    f"  round {rounds + 1}, DP={n}: done in {time.perf_counter() - started:.1f} s"
                )
            rounds += 1
            per_round = [
                [a / b for a, b in zip(slowest[n], slowest[1], strict=True)] for n in sizes
            ]
            if 1 not in slowest or repeat.done(rounds, per_round):
                break
    repeat.reason = repeat.reason or "no DP=1 run: no ratio to repeat for"
    base = per_dp.get("1")
    speedup: dict[str, Any] = {}
    for n, d in per_dp.items():
        d["slowest_step_s"] = statistics.median(slowest[int(n)])  # over rounds
        d["rounds_slowest_step_s"] = slowest[int(n)]
        est = (
            ratio_spread([a / b for a, b in zip(slowest[int(n)], slowest[1], strict=True)])
            if base
            else None
        )
        speedup[n] = est.median if est else None
        d["speedup_spread"] = est.as_dict() if est else None
        d["params_equal_dp1"] = fingerprints[int(n)] == fingerprints[1] if base else None
    notes = [GRAD_SYNC_NOTE, MEGATRON_CORE_NOTE, f"rounds: {rounds}, stopped: {repeat.reason}"]
    if load is not None:
        notes.append(f"load average at the start {load['load_average']} on {load['cores']} cores")
        if load["warning"]:
            notes.append(load["warning"])
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
        "targets": targets(per_dp, speedup),
        "notes": notes,
    }
    print_report(report)
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
