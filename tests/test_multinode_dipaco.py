"""DiPaCo across simulated nodes (issue 42): the PostgreSQL queue served from node 0, one
``megatron-ext dipaco worker`` on node 1 and one on node 2 (each a network namespace with its
own address and host name, :mod:`tests.support.sim_cluster`; distinct loopback addresses where
namespaces cannot be made, said in the output), node 2 lost while it holds a task.

At the same time, as the reference, the same recipe runs as one worker alone on node 0 with
its SQLite queue (the single-node run). The 2-node run must end with that run's final global
modules and outer momenta, bit for bit, after node 1 has taken over the task node 2 held.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from psycopg.errors import UndefinedTable

from megatron_ext.bench._dipaco_faults import max_abs_difference
from megatron_ext.bench._dipaco_measure import small_overrides, write_small_corpus
from megatron_ext.config import load_recipe
from megatron_ext.dipaco.queue.task_queue import TaskQueue
from megatron_ext.dipaco.queue.url import parse_queue_url
from tests.support.multinode_runs import MEGATRON_EXT, wait_until
from tests.support.postgres import postgres_server
from tests.support.sim_cluster import SimCluster, SimNode, sim_cluster

RECIPE = "dipaco_tiny"
# a lost worker's task is claimable again 4 s after its last heartbeat
LEASES = ["dipaco.lease_seconds=4", "dipaco.heartbeat_seconds=1"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> SimCluster:
    shared = tmp_path_factory.mktemp("shared")
    force = os.environ.get("MEGATRON_EXT_SIM_LOOPBACK") == "1"
    with sim_cluster(3, shared, force_loopback=force) as made:
        yield made


def _worker(node: SimNode, cluster: SimCluster, overrides: list[str], log: Path):
    argv = [str(MEGATRON_EXT), "dipaco", "worker", RECIPE, *overrides, "--name", node.host]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    return node.popen(argv, env=env, cwd=cluster.shared, log=log)


def _held(queue: TaskQueue, worker: str) -> list[tuple[str, str]]:
    """(task, token) of the train tasks ``worker`` holds a lease on."""
    rows = queue.db.query(
        "SELECT id, token FROM dipaco_tasks WHERE state = 'running' AND worker = ? "
        "AND kind = 'train'",
        (worker,),
    )
    return [(task, token) for task, token in rows]


def _joined(queue: TaskQueue) -> set[str]:
    """The workers that have claimed (or asked for) a task so far."""
    with contextlib.suppress(UndefinedTable):  # no worker has made the tables yet
        return {w[0] for w in queue.workers()}
    return set()


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def _finished(proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    code = proc.wait(timeout=timeout)
    assert code == 0, f"exit {code}:\n{log.read_text()[-3000:]}"


def test_queue_on_node_0_workers_on_nodes_1_and_2_a_lost_node_and_the_single_node_result(
    cluster: SimCluster,
) -> None:
    """Node 2 is lost (every process SIGKILLed) while it holds a train task: node 1
    takes the task over once its lease expires and finishes the run, whose final modules and
    momenta equal the single-node run's bit for bit."""
    node0, node1, node2 = cluster.nodes
    root = cluster.shared
    single = small_overrides(write_small_corpus(root / "data_single"), root / "single")
    two = [*small_overrides(write_small_corpus(root / "data_two"), root / "two"), *LEASES]
    with postgres_server(listen=node0.address, run_in=node0.command([])) as server:
        url = server.new_database(host=node0.host)  # as the workers reach it: node0:PORT
        two.append(f"dipaco.queue={url}")
        local = server.socket_url(url.rsplit("/", 1)[1])  # the same database, from here
        queue = TaskQueue(parse_queue_url(local), lease_seconds=4, max_attempts=3, worker="test")
        try:
            start = time.monotonic()
            reference = _worker(node0, cluster, single, root / "single.log")
            # Node 1 starts once node 2 is in the run: started together, on this loaded 2-core
            # machine one worker's start-up outlasted the other's whole run (seen: node 2 got
            # no task). Each worker holds one task at a time, so node 2 gets a train task.
            workers = {node2.host: _worker(node2, cluster, two, root / "node2.log")}
            wait_until(lambda: node2.host in _joined(queue), 180, "node 2 joining the run")
            workers[node1.host] = _worker(node1, cluster, two, root / "node1.log")
            held: list[tuple[str, str]] = []

            def node_2_holds_a_task() -> bool:
                if workers[node2.host].poll() is not None:
                    pytest.fail(f"node 2's worker ended: {workers[node2.host].returncode}")
                if _held(queue, node2.host):
                    pids = node2.pids()
                    _signal_all(pids, signal.SIGSTOP)  # frozen, then checked: no race
                    held[:] = _held(queue, node2.host)
                    if held:
                        return True
                    _signal_all(pids, signal.SIGCONT)  # completed meanwhile: go on
                return False

            wait_until(node_2_holds_a_task, 180, "node 2 holding a train task")
            killed, killed_at = cluster.kill_node(node2), time.time()
            node_1_in = "in the run" if node1.host in _joined(queue) else "starting"
            lost_at = time.monotonic() - start
            _finished(workers[node1.host], root / "node1.log")
            two_took = time.monotonic() - start
            _finished(reference, root / "single.log")
            events = queue.events()
            hosts = {w[0]: w[1] for w in queue.workers()}
            ours = load_recipe(RECIPE, [*two[:-1], f"dipaco.queue={local}"])
            difference = max_abs_difference(load_recipe(RECIPE, single), ours)
        finally:
            queue.close()
    (task, token), *_ = held
    claims = [e for e in events if e[1] == task and e[4] in ("claim", "take-over")]
    print(
        f"node 2 lost {lost_at:.1f} s in, holding {task} ({len(killed)} processes SIGKILLed; "
        f"node 1 {node_1_in}); "
        f"node 1 took it over {claims[-1][0] - killed_at:.1f} s later (the database's clock, "
        f"this machine's); the 2-node run finished at {two_took:.1f} s, the single-node run at "
        f"{time.monotonic() - start:.1f} s"
    )
    assert [(e[2], e[3], e[4]) for e in claims[:1]] == [(node2.host, token, "claim")], claims
    assert [(e[2], e[4]) for e in claims[1:]] == [(node1.host, "take-over")], claims
    assert not [e for e in events if e[2] == node2.host and e[1] == task and e[4] == "complete"]
    if cluster.mode == "netns":  # each worker ran on its own node (its host name)
        assert hosts[node1.host] == "node1" and hosts[node2.host] == "node2", hosts
    assert difference == 0.0  # every final module and momentum, bit for bit
