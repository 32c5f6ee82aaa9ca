"""Runs on the simulated nodes of :mod:`tests.support.sim_cluster` for tests/test_multinode.py:
``megatron-ext launch`` on a node, the SLURM example with a stub ``srun`` that starts its step
on every node, the losses a run wrote, and a node's link bytes against ``megatron-ext plan``."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_ext.launch.supervise import children
from tests.conftest import ROOT
from tests.support.sim_cluster import SimCluster, SimNode

__all__ = [
    "MEGATRON_EXT",
    "check_bytes_as_planned",
    "endpoint",
    "finish",
    "launch_alone",
    "launch_on",
    "losses",
    "rank_pid",
    "sbatch_with_stub_srun",
    "wait_until",
]

MEGATRON_EXT = Path(sys.executable).parent / "megatron-ext"


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from metrics.jsonl's complete lines (read while the run writes it; a
    resumed step's last line wins)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []
    rows = [json.loads(r) for r in lines]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def endpoint(cluster: SimCluster, recipe: Path) -> str:
    port = yaml.safe_load(recipe.read_text())["launch"]["master_port"]
    return f"{cluster.nodes[0].host}:{port}"


def launch_on(
    node: SimNode, cluster: SimCluster, recipe: Path, run_dir: Path, *overrides: str
) -> subprocess.Popen:
    """``megatron-ext launch RECIPE --nnodes 2 --node-rank I --rdzv-endpoint node0:PORT`` on
    ``node``, output to ``run_dir/node<I>.out``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [
        str(MEGATRON_EXT),
        "launch",
        str(recipe),
        f"run_dir={run_dir}",
        *overrides,
        "--nproc-per-node",
        "1",
        "--nnodes",
        "2",
        "--node-rank",
        str(node.index),
        "--rdzv-endpoint",
        endpoint(cluster, recipe),
    ]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return node.popen(argv, env=env, cwd=cluster.shared, log=run_dir / f"node{node.index}.out")


def launch_alone(
    node: SimNode, cluster: SimCluster, recipe: Path, run_dir: Path, *overrides: str
) -> subprocess.Popen:
    """``megatron-ext launch RECIPE`` as one node of its own (torchrun --standalone, the
    recipe's ``launch.nproc_per_node_cpu`` ranks) on ``node``, output to ``run_dir/node0.out``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    argv = [str(MEGATRON_EXT), "launch", str(recipe), f"run_dir={run_dir}", *overrides]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return node.popen(argv, env=env, cwd=cluster.shared, log=run_dir / "node0.out")


def rank_pid(launcher: int, local_rank: int) -> int:
    """The pid of local rank ``local_rank`` of the torchrun that ``launcher`` (the pid of a
    ``megatron-ext launch``) runs: a child of that torchrun whose LOCAL_RANK it is."""
    (torchrun,) = [p for p in children(launcher) if b"torch.distributed.run" in _cmdline(p)]
    for pid in children(torchrun):
        with contextlib.suppress(OSError):
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            if f"LOCAL_RANK={local_rank}".encode() in environ:
                return pid
    raise AssertionError(f"torchrun {torchrun} runs no local rank {local_rank}")


def _cmdline(pid: int) -> bytes:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    return b""


def finish(procs: list[subprocess.Popen], run_dir: Path, timeout: float = 300) -> None:
    """Wait for every node's launcher; fail with their output unless all exited 0."""
    codes = [p.wait(timeout=timeout) for p in procs]
    if any(codes):
        outs = [(run_dir / f"node{i}.out").read_text()[-3000:] for i in range(len(procs))]
        pytest.fail(f"exit codes {codes}\n" + "\n--- next node\n".join(outs))


def wait_until(condition, timeout: float, what: str) -> float:
    """Poll ``condition()`` every 10 ms; returns the seconds it took."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"{what} did not happen within {timeout} s")
        time.sleep(0.01)
    return time.monotonic() - start


def sbatch_with_stub_srun(cluster: SimCluster, recipe: Path, run_dir: Path, *args: str) -> int:
    """``bash docker/slurm_train.sbatch RECIPE ARGS`` with a stub ``srun`` that starts the step's
    command on every node (in its namespace) with the variables srun sets for a one-task-per-
    node step; returns the script's exit code."""
    bin_dir = run_dir / "bin"
    bin_dir.mkdir(parents=True)
    nodelist = "node[0-1]" if cluster.mode == "netns" else ",".join(n.host for n in cluster.nodes)
    starts = []
    for node in cluster.nodes:
        variables = (
            f"SLURM_NODEID={node.index} SLURM_PROCID={node.index} SLURM_LOCALID=0 "
            f"SLURM_STEP_NUM_NODES=2 SLURM_STEP_NUM_TASKS=2 SLURM_STEP_NODELIST='{nodelist}' "
            "SLURM_STEP_TASKS_PER_NODE='1(x2)' SLURM_NTASKS_PER_NODE=1"
        )
        prefix = " ".join(f"'{a}'" for a in node.command(["env"]))
        starts.append(
            f'{prefix} {variables} "$@" > {run_dir}/node{node.index}.out 2>&1 & pids+=($!)'
        )
    stub = "\n".join(
        [
            "#!/bin/bash",
            "# srun: drop its options, run the step once per simulated node",
            "while [[ $1 == -* ]]; do shift; done",
            "pids=()",
            *starts,
            "code=0",
            'for p in "${pids[@]}"; do wait "$p" || code=$?; done',
            "exit $code",
        ]
    )
    (bin_dir / "srun").write_text(stub + "\n")
    (bin_dir / "srun").chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{MEGATRON_EXT.parent}:{os.environ['PATH']}",
        "PYTHONWARNINGS": "ignore",
        "OMP_NUM_THREADS": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_JOB_NODELIST": nodelist,
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_CPUS_ON_NODE": "1",
        "SLURM_SUBMIT_DIR": str(cluster.shared),
    }
    script = ROOT / "docker" / "slurm_train.sbatch"
    argv = ["bash", str(script), str(recipe), *args]
    proc = subprocess.Popen(argv, env=env, cwd=cluster.shared, start_new_session=True)
    cluster.nodes[0].procs.append(proc)  # its session is killed with the cluster
    return proc.wait(timeout=300)


def check_bytes_as_planned(recipe: Path, sent: int, steps: int) -> None:
    """What node 1 (rank 1) sent on its link during ``steps`` steps against ``megatron-ext
    plan``'s bytes per step of that rank: at least the planned payload of the parameter
    all-gathers and the gradient reduce-scatters; at most 1.25x the planned total (the rest:
    TCP/IP and gloo headers, the loss and stop all-reduces, start-up and the resume)."""
    from megatron_ext.planner.gpus import gpu_spec
    from megatron_ext.planner.inputs import Cluster
    from megatron_ext.planner.plan import plan_recipe

    comm = plan_recipe(str(recipe), [], Cluster(gpu_spec("h100"), 2, 1)).stages[0].comm
    layerwise = comm.param_all_gather[0] + comm.grad_reduce_scatter[0]
    planned = layerwise + comm.replicated_all_reduce[0]
    print(
        f"node 1 sent {sent:,} bytes in {steps} steps: {sent / steps:,.0f} per step; planned "
        f"{planned:,} (all-gather {comm.param_all_gather[0]:,}, reduce-scatter "
        f"{comm.grad_reduce_scatter[0]:,}, replicated all-reduce "
        f"{comm.replicated_all_reduce[0]:,}): {sent / (steps * planned):.3f}x"
    )
    assert steps * layerwise <= sent <= 1.25 * steps * planned
