"""A simulated cluster on one machine: each node a Linux network namespace with its own address.

:func:`sim_cluster` starts 2-3 nodes and tears everything down on exit, also when a test fails:

* a *switch* namespace ``<prefix>-sw`` holds a bridge; each node namespace ``<prefix>-nI`` has a
  veth pair into it, address ``10.213.0.(10+I)/24`` and its own loopback; nothing is added to the
  machine's own namespace, so the subnet cannot collide with anything outside the fixture;
* ``/etc/netns/<prefix>-nI/hosts`` (which ``ip netns exec`` mounts over ``/etc/hosts``) names
  every node (``node0``, ``node1``, ...), and each node's processes run in their own UTS
  namespace with the host name ``nodeI``, so torch and gloo resolve their own node's address the
  way a real cluster node does;
* one shared run folder (the cluster's "shared file system").

:meth:`SimNode.popen` starts a process on a node; :meth:`SimCluster.partition` takes a node's
link down (and :meth:`~SimCluster.heal` back up); :meth:`SimCluster.kill_node` SIGKILLs every
process the node runs, like a machine that dies. On exit every process the fixture started (and
all their descendants, found by session id) is killed, the namespaces, the bridge and the hosts
files are removed.

Where namespaces cannot be created (no CAP_NET_ADMIN, no ``ip``), the nodes are distinct loopback
addresses of this machine (127.0.0.2, 127.0.0.3, ...), named by address, with no partition;
:attr:`SimCluster.mode` says which, and the fixture prints it (never a silent fallback).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Literal

__all__ = ["SimCluster", "SimNode", "sim_cluster"]

SUBNET = "10.213.0"  # /24, private, inside the fixture's own namespaces only
Mode = Literal["netns", "loopback"]


@dataclass
class SimNode:
    """One node: ``host`` is what other nodes call it (``node0``, or ``127.0.0.2`` on loopback)."""

    index: int
    host: str
    address: str
    netns: str | None  # None on the loopback fallback
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on this node: in its namespace, with its own host name."""
        if self.netns is None:
            return list(argv)
        inner = f'hostname {self.host} && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.netns,
            "unshare",
            "--uts",
            "sh",
            "-c",
            inner,
            "sh",
            *argv,
        ]

    def popen(
        self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, log: Path
    ) -> subprocess.Popen:
        """Start ``argv`` on this node, stdout and stderr to ``log`` (a file: a pipe left open
        by an orphaned helper process would block the reader), in a session of its own so the
        fixture can find and kill all its descendants."""
        out: IO[str] = open(log, "w", encoding="utf-8")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen(
            self.command(argv),
            env=dict(env),
            cwd=cwd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            text=True,
        )
        out.close()  # the child holds it
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every live process this node runs (by namespace, and by the sessions it started)."""
        found: set[int] = set()
        if self.netns is not None:
            out = subprocess.run(
                ["ip", "netns", "pids", self.netns], capture_output=True, text=True
            ).stdout
            found |= {int(p) for p in out.split()}
        sessions = {p.pid for p in self.procs}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, IndexError, ValueError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[3]) in sessions and fields[0] != "Z":  # fields[3]: session id
                    found.add(int(stat.parent.name))
        return sorted(found)


@dataclass
class SimCluster:
    """The nodes, the shared folder, and how they were made (``mode``)."""

    nodes: list[SimNode]
    shared: Path
    mode: Mode
    prefix: str

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    def partition(self, node: SimNode) -> None:
        """Take ``node``'s link down: packets to and from it are dropped, sockets stay open."""
        self._require_netns("a partition")
        _ip("-n", self.switch, "link", "set", f"{self.prefix}-s{node.index}", "down")

    def heal(self, node: SimNode) -> None:
        self._require_netns("a partition")
        _ip("-n", self.switch, "link", "set", f"{self.prefix}-s{node.index}", "up")

    def link_bytes(self, node: SimNode) -> tuple[int, int]:
        """Bytes ``node`` has sent and received on its link so far (its ``eth0`` counters)."""
        self._require_netns("link counters")
        out = subprocess.run(
            ["ip", "-n", node.netns or "", "-s", "-j", "link", "show", "eth0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"])

    def kill_node(self, node: SimNode) -> list[int]:
        """SIGKILL every process ``node`` runs (a machine that dies); returns their pids."""
        pids = node.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return pids

    def _require_netns(self, what: str) -> None:
        if self.mode != "netns":
            raise RuntimeError(f"{what} needs network namespaces (this cluster is {self.mode})")

    def close(self) -> None:
        """Kill everything the nodes run, then remove namespaces, bridge and hosts files."""
        for _ in range(3):  # a dying launcher may still be starting a child
            live = [pid for node in self.nodes for pid in self.kill_node(node)]
            for proc in (p for node in self.nodes for p in node.procs):
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=10)
            if not live:
                break
            time.sleep(0.2)
        if self.mode == "netns":
            for node in self.nodes:
                assert node.netns is not None
                subprocess.run(["ip", "netns", "del", node.netns], capture_output=True)
                shutil.rmtree(Path("/etc/netns") / node.netns, ignore_errors=True)
            subprocess.run(["ip", "netns", "del", self.switch], capture_output=True)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _make_netns(prefix: str, count: int) -> list[SimNode]:
    """The switch namespace with its bridge, and ``count`` node namespaces wired to it."""
    sw, bridge = f"{prefix}-sw", "br0"
    _ip("netns", "add", sw)
    _ip("-n", sw, "link", "add", bridge, "type", "bridge")
    _ip("-n", sw, "link", "set", bridge, "up")
    nodes = []
    hosts = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{10 + i} node{i}\n" for i in range(count))
    for i in range(count):
        ns, outside = f"{prefix}-n{i}", f"{prefix}-s{i}"
        nodes.append(SimNode(i, f"node{i}", f"{SUBNET}.{10 + i}", ns))
        _ip("netns", "add", ns)
        # Made in the node's namespace, then one end moved to the switch: the names never exist
        # in the machine's own namespace.
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", outside)
        _ip("-n", ns, "link", "set", outside, "netns", sw)
        _ip("-n", sw, "link", "set", outside, "master", bridge)
        _ip("-n", sw, "link", "set", outside, "up")
        _ip("-n", ns, "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        folder = Path("/etc/netns") / ns
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "hosts").write_text(hosts, encoding="utf-8")
    return nodes


def netns_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if sys.platform != "linux":
        return f"not Linux ({sys.platform})"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command"
    probe = f"mxt-probe-{secrets.token_hex(3)}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return (
            f"`ip netns add` failed ({done.stderr.strip() or done.returncode}): no CAP_NET_ADMIN?"
        )
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@contextlib.contextmanager
def sim_cluster(count: int, shared: Path, *, force_loopback: bool = False) -> Iterator[SimCluster]:
    """``count`` nodes (2-3) sharing ``shared``; see the module docstring. Prints the mode."""
    prefix = f"mxt-{secrets.token_hex(3)}"
    why = "MEGATRON_EXT_SIM_LOOPBACK=1" if force_loopback else netns_unavailable()
    if why is None:
        cluster = SimCluster([], shared, "netns", prefix)
        try:
            cluster.nodes = _make_netns(prefix, count)
        except BaseException:
            cluster.nodes = [SimNode(i, f"node{i}", "", f"{prefix}-n{i}") for i in range(count)]
            cluster.close()
            raise
        print(
            f"\nsimulated cluster: {count} network namespaces {prefix}-n* on a bridge", flush=True
        )
    else:
        nodes = [SimNode(i, f"127.0.0.{2 + i}", f"127.0.0.{2 + i}", None) for i in range(count)]
        cluster = SimCluster(nodes, shared, "loopback", prefix)
        print(
            f"\nsimulated cluster: FALLBACK to loopback addresses 127.0.0.2-{1 + count} "
            f"(no network namespaces: {why}); partitions are not simulated",
            flush=True,
        )
    try:
        yield cluster
    finally:
        cluster.close()
