"""A DiPaCo worker that injects one fault into itself, for the fault scenarios of
:mod:`megatron_ext.bench._dipaco_faults` (``bench dipaco --faults`` and the fault tests)::

    python -m megatron_ext.bench._dipaco_fault_worker [--pause-before-completing KIND]
        [--pause-mid-write KIND] [--pause-mid-task KIND] RECIPE [OVERRIDES] [--name N] ...

runs ``megatron-ext dipaco worker RECIPE ...`` in this process, unchanged, after wrapping from
outside the calls where the fault strikes; the worker itself has no fault hook. Each pause stops
the process (SIGSTOP: it stays stopped until SIGCONT or SIGKILL), once, in the first task of
KIND this worker claims (:meth:`TaskQueue.claim` arms it):

- ``--pause-before-completing``: the task is done (its files written), before
  :meth:`TaskQueue.complete`: killed, its work is lost and re-leased; continued later, it is a
  zombie whose completion is rejected;
- ``--pause-mid-write``: half-way through the task's first ``torch.save`` (what
  :func:`megatron_ext.dipaco.run.store.save_tensors` writes with): half of the file's bytes are
  in its temporary file;
- ``--pause-mid-task``: at the task's first lease check (the worker's ``_lost_check``), before
  it reads whether the lease was lost or a stop was asked for.
"""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["FaultPlan", "main"]


def _stop_self(why: str) -> None:
    print(f"[fault worker] {why}: stopping (SIGSTOP)", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)


class FaultPlan:
    """The pauses asked for, by task kind ("" for none), and the wraps that make them."""

    def __init__(self, before_completing: str, mid_write: str, mid_task: str) -> None:
        self.kinds = {"complete": before_completing, "write": mid_write, "task": mid_task}
        self.armed: dict[str, Any] = {}  # pause -> the lease it strikes in (write/task: True)

    def _arm(self, lease: Any) -> None:
        for pause, kind in self.kinds.items():
            if kind and lease.kind == kind:
                self.kinds[pause] = ""  # each pause once
                self.armed[pause] = lease
                print(f"[fault worker] {lease.task}: will pause ({pause})", flush=True)

    def install(self) -> None:
        """Wrap the queue's claim and complete, the lease check and ``torch.save``."""
        import torch

        from megatron_ext.dipaco import TaskQueue
        from megatron_ext.dipaco.run import worker

        claim, complete, lost_check, save = (
            TaskQueue.claim,
            TaskQueue.complete,
            worker._lost_check,
            torch.save,
        )

        def claim_and_arm(queue: TaskQueue, *args: Any, **kwargs: Any) -> Any:
            lease = claim(queue, *args, **kwargs)
            if lease is not None:
                self._arm(lease)
            return lease

        def pause_then_complete(queue: TaskQueue, lease: Any, *args: Any, **kwargs: Any) -> Any:
            if self.armed.get("complete") is lease:
                del self.armed["complete"]
                _stop_self(f"{lease.task} done, before completing it")
            return complete(queue, lease, *args, **kwargs)

        def lost_check_pausing_first(*args: Any, **kwargs: Any) -> Callable[[], bool]:
            check = lost_check(*args, **kwargs)
            lease = self.armed.pop("task", None)
            if lease is None:
                return check
            pending = [True]

            def first_pauses() -> bool:
                if pending:
                    pending.clear()
                    _stop_self(f"{lease.task}: at its first lease check")
                return check()

            return first_pauses

        def save_half_then_pause(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            lease = self.armed.get("write")
            if lease is None or not hasattr(f, "write"):
                return save(obj, f, *args, **kwargs)
            del self.armed["write"]
            data = io.BytesIO()
            save(obj, data, *args, **kwargs)
            raw = data.getvalue()
            f.write(raw[: len(raw) // 2])
            f.flush()
            _stop_self(f"{lease.task}: half-way through writing a file")
            f.write(raw[len(raw) // 2 :])
            return None

        TaskQueue.claim = claim_and_arm  # type: ignore[method-assign]
        TaskQueue.complete = pause_then_complete  # type: ignore[method-assign]
        worker._lost_check = lost_check_pausing_first
        torch.save = save_half_then_pause


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the pause flags, install them, run ``megatron-ext dipaco worker`` with the rest
    (the command's parser and function: nothing below the command line imports the launcher)."""
    parser = argparse.ArgumentParser(prog="python -m megatron_ext.bench._dipaco_fault_worker")
    for flag in ("before-completing", "mid-write", "mid-task"):
        parser.add_argument(f"--pause-{flag}", default="", metavar="KIND")
    faults, rest = parser.parse_known_args(argv)
    FaultPlan(
        faults.pause_before_completing, faults.pause_mid_write, faults.pause_mid_task
    ).install()
    from megatron_ext.commands import commands
    from megatron_ext.errors import ConfigError

    for stream in (sys.stdout, sys.stderr):  # whole lines, as the command line writes them
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)
    dipaco = commands()["dipaco"]  # the command's own parser and function, from its registry
    worker = argparse.ArgumentParser(prog="megatron-ext dipaco")
    dipaco.add_arguments(worker)
    try:
        return dipaco.run(worker.parse_args(["worker", *rest]))
    except ConfigError as exc:  # as the command line reports it (launch/cli.py)
        print(f"megatron-ext: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
