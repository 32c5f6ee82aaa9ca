"""Running torchrun under the launcher: signals in, the ranks' failures out.

Signals. Ctrl-C, SIGHUP, SIGQUIT (and SIGTERM when it is not a stop signal) go to torchrun,
which stops its ranks. A *stop signal* (``training.exit_signals``, default SIGTERM and SIGUSR1:
what SLURM sends before a time limit and on preemption) goes straight to the ranks, which
finish their step, save and exit 0 (:mod:`megatron_ext.run.stopping`); torchrun, bypassed, sees
them succeed. torchrun starts with SIGUSR1/SIGUSR2 ignored (inherited; the ranks install their
own handlers), so the same signal sent by SLURM to every process of the job does not kill it.

Failures. torchrun's stderr (and the ranks', which inherit it) is copied to
``run_dir/logs/launch-<time>-node<k>.log`` and shown filtered; when torchrun fails, each
distinct rank error line is printed once with its ranks, and the launcher returns the failed
rank's exit code (:mod:`.failures`).

Torch-free. Process discovery reads ``/proc`` (Linux); elsewhere stop signals go to torchrun.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from megatron_ext.launch.failures import StderrTee, failure_report, print_lines
from megatron_ext.run.lifetime import die_with_parent_hook
from megatron_ext.run.rank_errors import ERRORS_DIR_VAR, read_stop

__all__ = ["FORWARDED_SIGNALS", "TorchrunWatch", "run_forwarding_signals", "run_ranks"]

# The signals torchrun handles by terminating its ranks; it is their only receiver unless they
# are stop signals.
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
# Stop signals torchrun would die of (default action): ignored in torchrun.
_IGNORED_BY_TORCHRUN = (signal.SIGUSR1, signal.SIGUSR2)


def children(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The live processes whose parent is ``pid`` (torchrun's ranks), from ``/proc``."""
    found = []
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        if int(fields[1]) == pid and fields[0] != "Z":  # a zombie has ended, unreaped
            found.append(int(stat.parent.name))
    return sorted(found)


def run_forwarding_signals(
    argv: list[str],
    env: Mapping[str, str],
    *,
    stop_signals: Collection[int] = (),
    stderr_log: Path | None = None,
    stuck: Callable[[int], bool] | None = None,
) -> int:
    """Run ``argv`` to completion; pass signals on (see the module docstring); return its exit
    code, 128+N for death by signal N, as a shell would.

    The child gets its own process group so that a Ctrl-C at the terminal reaches torchrun
    exactly once (from here) rather than twice (terminal and here), which would cut short its
    shutdown of the ranks. ``stderr_log``: copy the child's stderr there (:class:`StderrTee`).
    ``stuck(pid)``: polled every second; when it says True the child is terminated (SIGTERM,
    then SIGKILL 5 s later: a torchrun stuck on an unreachable store is stuck in its SIGTERM
    handler too).
    """
    ignored = [s for s in _IGNORED_BY_TORCHRUN if s in stop_signals]
    before = {s: signal.signal(s, signal.SIG_IGN) for s in ignored}  # inherited by torchrun
    log = open(stderr_log, "a", encoding="utf-8") if stderr_log else None  # noqa: SIM115
    child = subprocess.Popen(
        argv,
        env=dict(env),
        process_group=0,
        preexec_fn=die_with_parent_hook(os.getpid()),  # a killed launcher takes its ranks along
        stderr=subprocess.PIPE if log else None,
        text=True,
        errors="replace",
    )
    tee = StderrTee(child.stderr, log, sys.stderr) if log and child.stderr else None

    def forward(signum: int, _frame: object) -> None:
        ranks = children(child.pid) if signum in stop_signals else []
        for rank in ranks:
            with contextlib.suppress(ProcessLookupError):  # a rank that just ended
                os.kill(rank, signum)
        if not ranks:
            child.send_signal(signum)

    handled = {*FORWARDED_SIGNALS, *stop_signals}
    previous = {sig: signal.signal(sig, forward) for sig in handled}
    try:
        code = _wait(child, stuck)
    finally:
        for sig, handler in {**previous, **before}.items():
            signal.signal(sig, handler)
        if tee is not None:
            tee.join(timeout=10)  # a rank's leftover helper may hold the pipe open
        if log is not None:
            log.close()
    return 128 - code if code < 0 else code


def _wait(child: subprocess.Popen, stuck: Callable[[int], bool] | None) -> int:
    if stuck is None:
        return child.wait()
    while True:
        with contextlib.suppress(subprocess.TimeoutExpired):
            return child.wait(timeout=1.0)
        if stuck(child.pid):
            child.terminate()
            try:
                return child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                return child.wait()


class TorchrunWatch:
    """Says when torchrun outlives its failed ranks: every rank of this node has ended, at
    least one recorded a failure, and torchrun has not exited within ``grace_s``.

    Seen on a partitioned node (issue 42): its ranks fail at the collective timeout, and its
    torchrun then waits on the rendezvous store of the unreachable first node far beyond its
    own read timeout (in ``num_nodes_waiting``, minutes). A node whose ranks succeeded is never
    stopped: torchrun then waits at its exit barrier for the other nodes, as it should."""

    def __init__(self, errors_dir: Path, grace_s: float) -> None:
        self.errors_dir, self.grace_s = errors_dir, grace_s
        self.since: float | None = None
        self.fired = False

    def __call__(self, pid: int) -> bool:
        failed = any(self.errors_dir.glob("rank_*.json"))
        if not failed or children(pid):
            self.since = None
            return False
        now = time.monotonic()
        self.since = now if self.since is None else self.since
        self.fired = now - self.since >= self.grace_s
        return self.fired


def run_ranks(
    argv: list[str],
    env: Mapping[str, str],
    run_dir: Path,
    node_rank: int,
    stop_signals: Collection[int],
    torchrun_grace_s: float | None = None,
) -> int:
    """Run the torchrun command with its stderr logged in ``run_dir/logs``; on failure print
    each distinct rank error once and return the failed rank's exit code; after a run that
    stopped early on purpose print rank 0's stop line (where, how to resume) last.
    ``torchrun_grace_s``: stop a torchrun that outlives its failed ranks by that long
    (:class:`TorchrunWatch`); None = wait for it however long it takes."""
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-node{node_rank}"
    logs = run_dir / "logs"
    errors_dir = logs / f"errors-{stamp}"
    errors_dir.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"launch-{stamp}.log"
    watch = None if torchrun_grace_s is None else TorchrunWatch(errors_dir, torchrun_grace_s)
    code = run_forwarding_signals(
        argv,
        {**env, ERRORS_DIR_VAR: str(errors_dir)},
        stop_signals=stop_signals,
        stderr_log=log_path,
        stuck=watch,
    )
    stop = read_stop(errors_dir)
    if code != 0:
        lines, code = failure_report(errors_dir, log_path, code)
        if watch is not None and watch.fired:
            lines.insert(
                -1,
                f"megatron-ext: torchrun had not exited {watch.grace_s:g} s after this node's "
                "ranks failed (waiting on the rendezvous store of an unreachable first node?): "
                "the launcher stopped it",
            )
        print_lines(lines, sys.stderr)
    elif stop is not None:
        print(stop, flush=True)
    if not any(errors_dir.iterdir()):
        errors_dir.rmdir()
    return code
