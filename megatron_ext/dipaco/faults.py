"""Faults with real worker processes (the fault tests and ``bench dipaco``).

:func:`fault_run` runs a recipe through three ``megatron-ext dipaco worker`` processes:

1. ``killed`` stops itself after doing its first outer task (the new module version written in
   its attempt folder) and before completing it, and is then SIGKILLed;
2. ``zombie`` stops itself (SIGSTOP) after doing its first train task, before completing it,
   and stays stopped past its lease;
3. ``helper`` starts once both are stopped: it takes their tasks over when the leases expire
   and finishes the run; then ``zombie`` is continued (SIGCONT): its completion is rejected, its
   files discarded, and it exits.

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

from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.plan import outer_id
from megatron_ext.dipaco.queue import TaskQueue
from megatron_ext.dipaco.recipe import DipacoConfig, path_layout, queue_url
from megatron_ext.dipaco.store import attempt_dir, load_tensors

__all__ = ["fault_run", "final_modules", "max_abs_difference"]


def _stopped(proc: subprocess.Popen) -> bool:
    """The process is stopped (state T in /proc/<pid>/stat)."""
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def _worker(recipe: str, overrides: Sequence[str], name: str, pause: str, log: Path):
    exe = Path(sys.executable).with_name("megatron-ext")
    args = [str(exe), "dipaco", "worker", recipe, *overrides, "--name", name]
    if pause:
        args += ["--pause-before-completing", pause]
    with open(log, "w") as out:
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)


def fault_run(
    recipe_name: str, overrides: Sequence[str], recipe: Recipe, logs: Path, timeout: float = 300
) -> dict[str, Any]:
    """The scenario of the module docstring; returns its figures and the queue's events."""
    logs.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    killed = _worker(recipe_name, overrides, "killed", "outer", logs / "killed.log")
    zombie = _worker(recipe_name, overrides, "zombie", "train", logs / "zombie.log")
    try:
        deadline = time.monotonic() + timeout
        while not (_stopped(killed) and _stopped(zombie)):
            if killed.poll() is not None or zombie.poll() is not None:
                raise RuntimeError(
                    "a worker exited before its pause:\n"
                    + (logs / "killed.log").read_text()[-2000:]
                    + (logs / "zombie.log").read_text()[-2000:]
                )
            if time.monotonic() > deadline:
                raise RuntimeError("the workers never reached their pause")
            time.sleep(0.2)
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=30)
        helper = _worker(recipe_name, overrides, "helper", "", logs / "helper.log")
        if helper.wait(timeout=timeout):
            raise RuntimeError("helper failed:\n" + (logs / "helper.log").read_text()[-3000:])
        wall = time.perf_counter() - start
        zombie.send_signal(signal.SIGCONT)
        if zombie.wait(timeout=timeout):
            raise RuntimeError("zombie failed:\n" + (logs / "zombie.log").read_text()[-3000:])
    finally:
        for proc in (killed, zombie):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
    queue = TaskQueue(queue_url(recipe), lease_seconds=1, max_attempts=1, worker="faults")
    events = queue.events()
    queue.close()
    takeovers = [e for e in events if e[4] == "take-over"]
    tau = recipe.section(DipacoConfig).tau
    return {
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
    try:
        out = {}
        for m in path_layout(recipe).modules:
            task = outer_id(phases - 1, m)
            folder = attempt_dir(recipe.run_dir, task, queue.token(task))
            out[m.name] = load_tensors(folder / "module.pt")
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
