"""A process that dies with its parent: the launcher's torchrun, and the ranks torchrun starts.

When a node's ``megatron-ext launch`` is killed outright (SIGKILL, the OOM killer, a node agent
that ends the job step), nothing forwards a signal: its torchrun and the ranks would live on,
orphaned, still training with the other nodes, and the job would not notice that one of its
launchers is gone. With Linux's parent-death signal, the kernel sends SIGKILL to torchrun when
the launcher dies, and to each rank when torchrun dies, so a lost launcher is a lost node: the
other nodes' ranks see their peers' connections close and fail at once, naming the lost ranks
(:mod:`megatron_ext.run.peers`).

Torch-free (the launcher uses it). Elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import ctypes
import multiprocessing.util
import os
import signal
import sys
from collections.abc import Callable

__all__ = ["die_with_parent", "die_with_parent_hook"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    return ctypes.CDLL(None, use_errno=True).prctl


def die_with_parent_hook(parent: int) -> Callable[[], None]:
    """A ``preexec_fn`` for ``subprocess.Popen``: the child gets SIGKILL when ``parent`` (the
    caller, ``os.getpid()``) dies. libc is looked up here, before the fork."""
    prctl = _prctl()

    def hook() -> None:
        if prctl is None:
            return
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the call: nobody will signal
            os._exit(137)

    return hook


class _ForkHook:
    """multiprocessing keeps after-fork callbacks by a weak reference to an object: this one."""

    def __call__(self) -> None:
        die_with_parent()


_FORK_HOOK = _ForkHook()


def die_with_parent() -> None:
    """This process gets SIGKILL when its parent dies (called first thing by a rank), and so
    does every process multiprocessing forks from it, each when its own parent dies: a rank's
    forked helpers (the checkpoint writer's Manager) hold copies of its sockets, and an
    orphaned one would keep a dead rank's connections open, so its peers would wait for the
    collective timeout instead of failing at once."""
    parent = os.getppid()
    die_with_parent_hook(parent)()
    multiprocessing.util.register_after_fork(_FORK_HOOK, lambda hook: hook())
