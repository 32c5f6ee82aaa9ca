"""Faults with real worker processes (``bench dipaco --faults`` and the fault tests).

Each worker is ``megatron-ext dipaco worker`` run by :mod:`._dipaco_fault_worker`, which makes
it stop itself (SIGSTOP) at the point a scenario needs; the worker has no fault hook of its own.

:func:`fault_run` runs a recipe through three such worker processes:

1. ``killed`` stops itself after doing its first outer task (the new module version written in
   its attempt folder) and before completing it, and is then SIGKILLed;
2. ``zombie`` stops itself (SIGSTOP) after doing its first train task, before completing it,
   and stays stopped past its lease;
3. ``helper`` starts once both are stopped: it takes their tasks over when the leases expire
   and finishes the run; then ``zombie`` is continued (SIGCONT): its completion is rejected, its
   files discarded, and it exits.

With ``mid_write``, ``killed`` stops itself half-way through writing its outer task's module
file instead (a half-written temporary file in its attempt folder, never read), then is
SIGKILLed; ``helper`` re-runs that outer step in its own attempt folder.

:func:`stopped_job_run`: the whole job is stopped mid-phase and relaunched: ``first`` does the
first five tasks (prepare, base, routing, two of phase 0's train tasks) and exits; ``a`` and
``b`` each do one more train task of phase 0 and stop before completing it, and are both
SIGKILLed (every process of the job is gone, two leases held); then the job is relaunched
with ``megatron-ext launch`` (2 ranks), which takes the two tasks over once their leases
expire and finishes the run.

:func:`final_modules` reads a run's last module versions, to compare with a clean run.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_ext.config import Recipe
from megatron_ext.dipaco import DipacoConfig, RunFiles, TaskQueue, attempt_dir, queue_url

__all__ = [
    "fault_run",
    "final_modules",
    "finish",
    "kill",
    "max_abs_difference",
    "queue_events",
    "stopped_job_run",
    "wait_stopped",
    "worker",
]


def _stopped(proc: subprocess.Popen) -> bool:
    """The process is stopped (state T in /proc/<pid>/stat)."""
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


EXE = Path(sys.executable).with_name("megatron-ext")
FAULT_WORKER = "megatron_ext.bench._dipaco_fault_worker"


def worker(
    recipe: str, overrides: Sequence[str], name: str, pause: str, log: Path, *extra: str
) -> subprocess.Popen:
    """A ``megatron-ext dipaco worker`` process through :mod:`._dipaco_fault_worker`
    (``pause``: ``--pause-before-completing`` KIND; ``extra``: more flags, its own too)."""
    args = [sys.executable, "-m", FAULT_WORKER, recipe, *overrides, "--name", name, *extra]
    if pause:
        args += ["--pause-before-completing", pause]
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


def wait_stopped(procs: dict[str, subprocess.Popen], logs: Path, timeout: float) -> None:
    """Until every process is stopped (SIGSTOP); RuntimeError if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    while not all(_stopped(p) for p in procs.values()):
        if any(p.poll() is not None for p in procs.values()) or time.monotonic() > deadline:
            tails = "".join((logs / f"{n}.log").read_text()[-2000:] for n in procs)
            raise RuntimeError(f"the workers never reached their pause:\n{tails}")
        time.sleep(0.2)


def kill(*procs: subprocess.Popen) -> None:
    """SIGKILL (a stopped process dies too; continuing it first would let it run on, e.g.
    complete the task it held)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def queue_events(recipe: Recipe) -> list[tuple[Any, ...]]:
    queue = TaskQueue(queue_url(recipe), lease_seconds=1, max_attempts=1, worker="faults")
    try:
        return queue.events()
    finally:
        queue.close()


def finish(name: str, proc: subprocess.Popen, logs: Path, timeout: float) -> None:
    if proc.wait(timeout=timeout):
        raise RuntimeError(f"{name} failed:\n" + (logs / f"{name}.log").read_text()[-3000:])


def stopped_job_run(
    recipe_name: str, overrides: Sequence[str], recipe: Recipe, logs: Path, timeout: float = 300
) -> dict[str, Any]:
    """The stopped-job scenario of the module docstring; returns the queue's events as the
    first job left them (``before``) and at the end (``events``)."""
    logs.mkdir(parents=True, exist_ok=True)
    first = worker(recipe_name, overrides, "first", "", logs / "first.log", "--max-tasks", "5")
    finish("first", first, logs, timeout)
    job = {n: worker(recipe_name, overrides, n, "train", logs / f"{n}.log") for n in ("a", "b")}
    try:
        wait_stopped(job, logs, timeout)
    finally:
        kill(*job.values())  # the whole job, at once
    before = queue_events(recipe)
    with open(logs / "relaunch.log", "w") as out:
        relaunch = subprocess.Popen(
            [str(EXE), "launch", recipe_name, *overrides], stdout=out, stderr=subprocess.STDOUT
        )
    finish("relaunch", relaunch, logs, timeout)
    return {"before": before, "events": queue_events(recipe)}


def fault_run(
    recipe_name: str,
    overrides: Sequence[str],
    recipe: Recipe,
    logs: Path,
    timeout: float = 300,
    mid_write: bool = False,
) -> dict[str, Any]:
    """The kill / zombie scenario of the module docstring (``mid_write``: ``killed`` stops
    half-way through writing its outer task's module file instead of after it); returns its
    figures and the queue's events."""
    logs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    pause = ("", "--pause-mid-write", "outer") if mid_write else ("outer",)
    killed = worker(recipe_name, overrides, "killed", *pause[:1], logs / "killed.log", *pause[1:])
    zombie = worker(recipe_name, overrides, "zombie", "train", logs / "zombie.log")
    try:
        wait_stopped({"killed": killed, "zombie": zombie}, logs, timeout)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        helper = worker(recipe_name, overrides, "helper", "", logs / "helper.log")
        finish("helper", helper, logs, timeout)
        wall = time.perf_counter() - start
        zombie.send_signal(signal.SIGCONT)
        finish("zombie", zombie, logs, timeout)
    finally:
        kill(killed, zombie)
    events = queue_events(recipe)
    takeovers = [e for e in events if e[4] == "take-over"]
    tau = recipe.section(DipacoConfig).tau
    claim = [e for e in events if e[2] == "killed" and e[1].startswith("outer/")][-1]
    left = attempt_dir(recipe.run_dir, claim[1], claim[3])
    return {
        "killed_outer": (claim[1], claim[3]),
        "killed_left_files": sorted(p.name for p in left.iterdir()) if left.is_dir() else [],
        "wall_s": wall,
        "tasks_re_leased": len(takeovers),
        "re_leased": sorted({e[1] for e in takeovers}),
        "inner_steps_lost": tau * sum(e[1].startswith("train/") for e in takeovers),
        "rejected_zombie_completions": sum(e[4] == "rejected" for e in events),
        "events": events,
        "zombie_log": (logs / "zombie.log").read_text(),
    }


def final_modules(recipe: Recipe) -> dict[str, dict[str, dict[str, torch.Tensor]]]:
    """Every module's last version (``params`` and ``momentum``), from the accepted attempts."""
    phases = recipe.section(DipacoConfig).phases
    queue = TaskQueue(queue_url(recipe), lease_seconds=1, max_attempts=1, worker="faults")
    files = RunFiles(recipe, queue)
    try:
        out = {}
        for m in files.layout.modules:
            params, momentum = files.module(phases, m)
            out[m.name] = {"params": params, "momentum": momentum}
    finally:
        queue.close()
    return out


def max_abs_difference(a: Recipe, b: Recipe) -> float:
    """max |θ_a − θ_b| over every final module parameter and momentum of two runs."""
    ma, mb = final_modules(a), final_modules(b)
    worst = 0.0
    for name, module in ma.items():
        for part in ("params", "momentum"):
            for key, tensor in module[part].items():
                diff = (tensor.double() - mb[name][part][key].double()).abs().max()
                worst = max(worst, float(diff))
    return worst
