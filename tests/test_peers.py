"""A failed collective said in terms of ranks and nodes (:mod:`megatron_ext.run.peers`), from the
messages gloo raised on simulated nodes (tests/test_multinode.py, issue 42), and the launcher's
watch on a torchrun that outlives its failed ranks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from megatron_ext.run.peers import Peer, describe_comm_failure, local_addresses

# Two nodes x 2 ranks, as gather_peers records them on the namespaces of tests/support
PEERS = [
    Peer(0, 0, "node0", ("10.213.0.10", "127.0.0.1")),
    Peer(1, 0, "node0", ("10.213.0.10", "127.0.0.1")),
    Peer(2, 1, "node1", ("10.213.0.11", "127.0.0.1")),
    Peer(3, 1, "node1", ("10.213.0.11", "127.0.0.1")),
]
RESET = (
    "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [10.213.0.11]:726: "
    "Connection reset by peer"
)
TIMEOUT = (
    "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 15000ms "
    "for recv operation to complete"
)


def test_a_reset_connection_names_the_lost_ranks_and_their_node() -> None:
    line = describe_comm_failure(RESET, rank=0, known=PEERS)
    assert line == (
        "lost contact with ranks 2, 3 (node 1, host node1 10.213.0.11) in a collective "
        "(Read error [10.213.0.11]:726: Connection reset by peer): that node's processes died "
        "or its network failed; relaunch every node once it is back (checkpoint.load=auto "
        "resumes from the last checkpoint)"
    )


def test_an_address_no_rank_has_still_says_a_peer_was_lost() -> None:
    line = describe_comm_failure(RESET.replace("10.213.0.11", "10.9.9.9"), rank=0, known=PEERS)
    assert line is not None and line.startswith("lost contact with a peer in a collective")


def test_a_timeout_names_the_other_nodes_ranks_and_the_recipe_field() -> None:
    line = describe_comm_failure(TIMEOUT, rank=2, known=PEERS, timeout_s=15)
    assert line is not None
    assert line.startswith(
        "a collective waited 15 s (launch.collective_timeout_s) for the other ranks (Timed out "
        "waiting 15000ms for recv operation to complete): no answer from ranks 0, 1 (node 0, "
        "host node0 10.213.0.10): a network partition"
    ), line


def test_other_errors_are_left_as_they_are() -> None:
    assert describe_comm_failure("ValueError: bad shape", rank=0, known=PEERS) is None
    assert describe_comm_failure("", rank=0, known=PEERS) is None


def test_local_addresses_include_loopback() -> None:
    assert "127.0.0.1" in local_addresses()


def test_a_torchrun_that_outlives_its_failed_ranks_is_stopped(tmp_path: Path) -> None:
    """A stand-in torchrun whose rank records a failure and exits while the parent sleeps on
    (as a partitioned node's torchrun waits on the first node's store): the launcher stops it
    after the grace and says so; one whose ranks succeeded is left to finish."""
    from megatron_ext.launch.supervise import run_ranks

    rank = (
        "import os, sys; sys.path.insert(0, os.getcwd()); "
        "from megatron_ext.run.rank_errors import record_error; "
        "record_error(1, 1, 'megatron-ext: error: lost contact with rank 0')"
    )
    torchrun = (
        f"import subprocess, sys, time; subprocess.run([sys.executable, '-c', {rank!r}]); "
        "time.sleep(120)"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    code = run_ranks([sys.executable, "-c", torchrun], env, tmp_path, 1, (), torchrun_grace_s=1)
    assert code == 1  # the rank's code, from its record
    assert subprocess.run(["true"]).returncode == 0  # (starts processes: the full lane)
    # a rank that succeeded: torchrun is waited for (it exits by itself here)
    done = run_ranks(
        [sys.executable, "-c", "import time; time.sleep(2)"], env, tmp_path, 1, (), 0.5
    )
    assert done == 0


def test_a_timeout_that_is_not_a_collectives_is_left_as_it_is() -> None:
    line = describe_comm_failure("connection to the queue timed out", rank=0, known=PEERS)
    assert line is None
