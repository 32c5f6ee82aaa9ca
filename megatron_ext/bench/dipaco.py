"""``megatron-ext bench dipaco``: DiPaCo's communication, outer step, queue and faults.

A small DiPaCo run (``dipaco_tiny`` shrunk: 2x2 paths of a 4-block width-32 GPT, 2 phases of
τ = 3 inner steps, 600 paragraphs of the Python Language Reference, real worker processes on an
SQLite queue) is trained first; then

- ``comm``: bytes per outer step from that run's files, per module and in total, beside
  data-parallel training (DDP) of the same tokens, counted the same way on both sides:
  parameter-server accounting (the headline keys): each path sends every shared module it
  trained up to that module's outer executor and receives the new version down (path-specific
  parts move 0 bytes), while each of DDP's P workers sends its whole-model gradient up and
  receives the weights down at every one of τ steps; the ratio is 1/τ without path-specific
  parts and below with them. ``comm.ring`` counts both as ring all-reduces instead (a module
  over the P_{l,e} paths that use it; DDP over all P workers, every step).
  ``comm_path_specific_embedding``: the same figures for a second run whose embedding is
  path-specific (``dipaco.path_specific=embedding``);
- ``outer``: one outer step split into load / reduce / step / write against P_{l,e} and the
  module size;
- ``queue``: claim + complete latency and throughput with N concurrent clients, on SQLite and
  on PostgreSQL (a throwaway server when the binaries exist, or ``--postgres URL``);
- ``faults`` (``--faults``): the kill / zombie scenario of :mod:`._dipaco_faults` on the same
  recipe (workers that stop themselves where the scenario needs: :mod:`._dipaco_fault_worker`):
  tasks re-leased, inner steps lost, extra wall time, rejected completions and max |Δθ| of the
  final modules against the clean run; and the whole job killed mid-phase and relaunched
  (``faults.job_killed_mid_phase``): tasks re-leased, done tasks claimed again (0), max |Δθ|
  against the clean run;
The paper's own comparisons, with its baselines, are ``megatron-ext bench paper dipaco``
(:mod:`megatron_ext.bench.paper.dipaco`).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from megatron_ext.bench.common import progress, write_json
from megatron_ext.commands import positive_int
from megatron_ext.progress import Tally

DESCRIPTION = (
    "DiPaCo: bytes per outer step vs DDP, outer-step time split, queue latency on SQLite and "
    "PostgreSQL, fault figures (figures + JSON)"
)
RECIPE = "dipaco_tiny"
OWN_EMBEDDING = (
    "dipaco.level_parts=[0-1, 2-3 final_layernorm output_layer]",
    "dipaco.path_specific=embedding",
)


QUICK = {"clients": [1, 2], "tasks": 20, "sizes": [100_000], "paths": [1, 4]}
EXAMPLE = "megatron-ext bench dipaco --quick --json runs/bench_dipaco.json"
#: the JSON's top-level keys (``faults`` with ``--faults``)
JSON_KEYS = (
    "tau",
    "paths",
    "clean_run_wall_s",
    "comm",
    "comm_path_specific_embedding",
    "outer",
    "queue",
    "meta",
)
#: the baseline this benchmark's ratios are against (``meta.anchor`` of its JSON)
ANCHOR = (
    "data-parallel training (DDP) of the same tokens, counted the same way (comm); "
    "the clean run (faults)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4], help="queue clients")
    parser.add_argument(
        "--tasks", type=positive_int, default=200, help="queue tasks per measurement"
    )
    parser.add_argument("--postgres", default="", help="a PostgreSQL URL (default: throwaway)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_000, 4_000_000])
    parser.add_argument("--paths", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--faults", action="store_true", help="also run the fault scenario")
    parser.add_argument("--workdir", default="", help="keep the runs here (default: temporary)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")


def run(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(1)
    stages = 5 if args.faults else 4  # the runs, outer timing, queue latency, faults
    with (
        tempfile.TemporaryDirectory() as tmp,
        progress("dipaco", "stages", stages, unit="stage") as shown,
    ):
        work = Path(args.workdir or tmp)
        report = _measure(args, work, shown)
    print(json.dumps(report, indent=2))
    write_json(report, args.json)
    return 0


def _measure(args: argparse.Namespace, work: Path, shown: Tally) -> dict[str, Any]:
    from megatron_ext.bench._dipaco_measure import (
        comm_bytes,
        outer_timing,
        small_overrides,
        small_run,
        write_small_corpus,
    )
    from megatron_ext.config import load_recipe

    data = write_small_corpus(work / "data")
    clean = small_overrides(data, work / "clean")
    with shown.running("clean run"):
        wall = small_run(RECIPE, clean)
    recipe = load_recipe(RECIPE, clean)
    comm = comm_bytes(recipe)
    report: dict[str, Any] = {
        "tau": recipe.sections["dipaco"].tau,
        "paths": 4,
        "clean_run_wall_s": wall,
        "comm": comm,
    }
    _print_comm(comm)
    # the same run with the embedding kept per path: it never moves, the ratio drops below 1/tau
    own = [*small_overrides(data, work / "own_embedding"), *OWN_EMBEDDING]
    with shown.running("run with a path-specific embedding"):
        small_run(RECIPE, own)
    report["comm_path_specific_embedding"] = comm_bytes(load_recipe(RECIPE, own))
    print("with the embedding path-specific (" + " ".join(OWN_EMBEDDING) + "):")
    _print_comm(report["comm_path_specific_embedding"])
    with shown.running("outer step timing"):
        report["outer"] = outer_timing(args.sizes, args.paths)
    for row in report["outer"]:
        print(
            f"outer step {row['params']:>9,} params x {row['paths']:>2} paths: load "
            f"{row['load_ms']:.1f} ms, reduce {row['reduce_ms']:.1f}, step {row['step_ms']:.1f}, "
            f"write {row['write_ms']:.1f}"
        )
    with shown.running("queue latency"):
        report["queue"] = _queue(args, work)
    if args.faults:
        with shown.running("fault runs"):
            report["faults"] = _faults(data, work, recipe, wall)
    return report


def _print_comm(comm: dict[str, Any]) -> None:
    print(f"comm accounting: {comm['accounting']}")
    for name, m in comm["modules"].items():
        print(
            f"module {name}: {m['paths']} paths x {m['module_bytes']:,} B -> up "
            f"{m['up_bytes']:,} B, down {m['down_bytes']:,} B (ring all-reduce "
            f"{m['ring_bytes']:,} B)"
        )
    ring = comm["ring"]
    print(
        f"outer step: {comm['bytes_per_outer_step']:,} B; DDP on the same tokens: "
        f"{comm['ddp_bytes_same_tokens']:,} B; ratio {comm['bytes_ratio_vs_ddp']:.4f} "
        f"(1/tau = {comm['one_over_tau']:.4f}); path-specific parts "
        f"({comm['path_specific_param_bytes']:,} B per path): 0 B moved"
    )
    ratio = ring["bytes_ratio_vs_ddp"]
    print(
        f"as ring all-reduces: outer step {ring['bytes_per_outer_step']:,} B; DDP "
        f"{ring['ddp_bytes_same_tokens']:,} B; ratio "
        + (f"{ratio:.4f}" if ratio is not None else "n/a (one worker)")
    )


def _queue(args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    from megatron_ext.bench._dipaco_measure import queue_latency
    from megatron_ext.bench._postgres import PostgresServer, find_postgres_bin

    rows = []
    server = None
    try:
        for clients in args.clients:
            rows.append(queue_latency(f"sqlite:///{work}/bench_q{clients}.db", clients, args.tasks))
        url = args.postgres
        if not url and (bindir := find_postgres_bin()) is not None:
            server = PostgresServer(bindir)
            server.start()
        for clients in args.clients:
            if server is not None:
                url = server.new_database()
            if url:
                rows.append(queue_latency(url, clients, args.tasks))
    finally:
        if server is not None:
            server.stop()
    for r in rows:
        print(
            f"queue {r['backend']:<10} {r['clients']} clients: claim+complete median "
            f"{r['median_ms']:.2f} ms, p95 {r['p95_ms']:.2f} ms, {r['tasks_per_s']:.0f} tasks/s"
        )
    return rows


def _faults(data: Path, work: Path, clean, clean_wall: float) -> dict[str, Any]:
    from megatron_ext.bench._dipaco_faults import fault_run, max_abs_difference
    from megatron_ext.bench._dipaco_measure import small_overrides
    from megatron_ext.config import load_recipe

    overrides = [
        *small_overrides(data, work / "faults"),
        "dipaco.lease_seconds=4",
        "dipaco.heartbeat_seconds=1",
    ]
    recipe = load_recipe(RECIPE, overrides)
    figures = fault_run(RECIPE, overrides, recipe, work / "fault_logs")
    out = {
        k: figures[k]
        for k in (
            "tasks_re_leased",
            "re_leased",
            "inner_steps_lost",
            "rejected_zombie_completions",
            "wall_s",
        )
    }
    out["extra_wall_s"] = figures["wall_s"] - clean_wall
    out["max_abs_dtheta_vs_clean"] = max_abs_difference(recipe, clean)
    out["job_killed_mid_phase"] = _stopped_job(data, work, clean)
    print(
        f"faults: {out['tasks_re_leased']} tasks re-leased {out['re_leased']}, "
        f"{out['inner_steps_lost']} inner steps lost, {out['rejected_zombie_completions']} "
        f"zombie completion(s) rejected, +{out['extra_wall_s']:.1f} s wall, max |dtheta| vs "
        f"clean {out['max_abs_dtheta_vs_clean']}"
    )
    return out


def _stopped_job(data: Path, work: Path, clean) -> dict[str, Any]:
    """The whole job killed mid-phase (two of phase 0's train tasks done, two held) and
    relaunched through the launcher (:func:`._dipaco_faults.stopped_job_run`)."""
    import time

    from megatron_ext.bench._dipaco_faults import max_abs_difference, stopped_job_run
    from megatron_ext.bench._dipaco_measure import small_overrides
    from megatron_ext.config import load_recipe

    overrides = [
        *small_overrides(data, work / "stopped_job"),
        "dipaco.lease_seconds=4",
        "dipaco.heartbeat_seconds=1",
    ]
    recipe = load_recipe(RECIPE, overrides)
    start = time.perf_counter()
    figures = stopped_job_run(RECIPE, overrides, recipe, work / "stopped_job_logs")
    after = figures["events"][len(figures["before"]) :]
    done = {e[1] for e in figures["before"] if e[4] == "complete"}
    out = {
        "tasks_done_before_the_kill": len(done),
        "tasks_re_leased_after_relaunch": sorted({e[1] for e in after if e[4] == "take-over"}),
        "done_tasks_claimed_again": len({e[1] for e in after} & done),
        "wall_s": time.perf_counter() - start,
        "max_abs_dtheta_vs_clean": max_abs_difference(recipe, clean),
    }
    print(
        f"job killed mid-phase and relaunched: {out['tasks_done_before_the_kill']} tasks done "
        f"before the kill, re-leased after the relaunch {out['tasks_re_leased_after_relaunch']}, "
        f"{out['done_tasks_claimed_again']} done tasks claimed again, {out['wall_s']:.1f} s "
        f"wall, max |dtheta| vs clean {out['max_abs_dtheta_vs_clean']}"
    )
    return out
