"""Which rank runs where, and a failed collective said in those terms.

When a node dies or its network fails, the survivors' collectives raise the backend's own
message: gloo's ``Read error [10.213.0.11]:53454: Connection reset by peer`` or ``Timed out
waiting 20000ms for recv operation to complete``. Neither says which node or rank was lost.
Right after the default group is joined, every rank shares where it runs (:func:`gather_peers`:
node index, host name, addresses: one small all-gather); :func:`describe_comm_failure` then
turns such an error into one line naming the lost rank(s) and node(s), and what to do.

Torch is imported by the caller's group only; this module's functions that touch it take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import socket
import struct
from dataclasses import dataclass
from typing import Any

__all__ = ["Peer", "describe_comm_failure", "gather_peers", "local_addresses", "peers"]

_SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's IPv4 address
_PEERS: list[Peer] = []
_TIMEOUT_S: list[float] = []  # the default group's timeout, seconds (once joined)


@dataclass(frozen=True)
class Peer:
    """Where one rank runs: ``node`` is torchrun's node index (GROUP_RANK; -1 when unknown)."""

    rank: int
    node: int
    host: str
    addresses: tuple[str, ...]

    def where(self) -> str:
        node = f"node {self.node}, " if self.node >= 0 else ""
        return f"{node}host {self.host}"


def local_addresses() -> tuple[str, ...]:
    """This machine's addresses: its host name's, and every interface's IPv4 address."""
    found: set[str] = set()
    with contextlib.suppress(OSError):
        found |= set(socket.gethostbyname_ex(socket.gethostname())[2])
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
                found.add(socket.inet_ntoa(raw[20:24]))
    return tuple(sorted(found))


def gather_peers(dist: Any, rank: int, world_size: int, timeout_s: float) -> list[Peer]:
    """Every rank's :class:`Peer`, by rank (a collective on the default group of ``dist``,
    whose timeout is ``timeout_s``)."""
    me = Peer(rank, int(os.environ.get("GROUP_RANK", -1)), socket.gethostname(), local_addresses())
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, me)
    _PEERS[:] = everyone
    _TIMEOUT_S[:] = [timeout_s]
    return list(_PEERS)


def peers() -> list[Peer]:
    """What :func:`gather_peers` found in this process (empty before, or for one rank)."""
    return list(_PEERS)


_ADDRESS = re.compile(r"\[([0-9A-Fa-f:.]+)\]:\d+")
_LOST = re.compile(
    r"Connection reset by peer|Connection closed by peer|Broken pipe|Connection refused|"
    r"remote process exited|Socket closed|Read error \[|Write error \[",
    re.IGNORECASE,
)
# gloo's recv/send timeout and its pair closed for it; NCCL's watchdog
_TIMEOUT = re.compile(
    r"Timed out waiting \d+ms|Application timeout caused pair closure|"
    r"Watchdog caught collective operation timeout"
)
_FIX = "relaunch every node once it is back (checkpoint.load=auto resumes from the last checkpoint)"


def describe_comm_failure(
    message: str, rank: int, known: list[Peer] | None = None, timeout_s: float | None = None
) -> str | None:
    """One line for a collective that failed because a peer went away (None when ``message``
    is not such a failure). ``known``: the peers (default: :func:`peers`)."""
    known = peers() if known is None else known
    timeout_s = timeout_s if timeout_s is not None else (_TIMEOUT_S[0] if _TIMEOUT_S else None)
    first = message.strip().splitlines()[0] if message.strip() else ""
    reason = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\]\s*", "", first)  # gloo's source position
    others = [p for p in known if p.rank != rank]
    me = next((p for p in known if p.rank == rank), None)
    if _LOST.search(first):
        address = _ADDRESS.search(first)
        lost = [p for p in others if address and address.group(1) in p.addresses]
        if me is not None and lost:  # several ranks behind one address: the other nodes'
            lost = [p for p in lost if p.node != me.node or p.node < 0] or lost
        if lost:
            return (
                f"lost contact with {_ranks_where(lost)} in a collective ({reason}): that "
                f"node's processes died or its network failed; {_FIX}"
            )
        return (
            f"lost contact with a peer in a collective ({reason}): a node's processes died or "
            f"its network failed; {_FIX}"
        )
    if _TIMEOUT.search(first) and others:
        waited = f"{timeout_s:g} s" if timeout_s else "the collective timeout"
        remote = [p for p in others if me is None or p.node != me.node or p.node < 0] or others
        return (
            f"a collective waited {waited} (launch.collective_timeout_s) for the other ranks "
            f"({reason}): no answer from {_ranks_where(remote)}: a network partition, or a "
            f"node that hung or died; {_FIX}"
        )
    return None


def _ranks_where(group: list[Peer]) -> str:
    """``rank 1 (node 1, host node1 10.213.0.11)`` / ``ranks 2, 3 (node 1, ...)``."""
    by_where: dict[str, list[int]] = {}
    for p in group:
        address = ", ".join(a for a in p.addresses if not a.startswith("127."))
        key = p.where() + (f" {address}" if address else "")
        by_where.setdefault(key, []).append(p.rank)
    parts = [
        f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, ranks))} ({where})"
        for where, ranks in by_where.items()
    ]
    return "; ".join(parts)
