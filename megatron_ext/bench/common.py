"""Measurements and helpers shared by the benchmarks (runs through the launcher, their metrics)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def matmul_gflops(size: int = 1024, repeats: int = 12, device: str = "cpu") -> float:
    """Best-of-``repeats`` fp32 GFLOP/s of a ``size``³ matmul at the current torch thread count
    (or on ``device``): the machine's attainable rate, the anchor for every achieved-GFLOP/s
    figure."""
    import torch

    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else lambda: None
    a @ b  # warm-up (CUDA: kernel selection)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in ``optimizer.state`` (momenta, factors, ...), in any dtype."""
    import torch

    return sum(
        v.numel() * v.element_size()
        for st in optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )


def write_json(report: dict[str, Any], path: str | None) -> None:
    """Write a benchmark's report to ``path`` when given (the one atomic JSON writer) and say
    so."""
    if path:
        from megatron_ext.atomic import write_json as write_json_atomic

        write_json_atomic(path, report)
        print(f"wrote {path}")


def launch_run(recipe: str, overrides: list[str], run_dir: Path, label: str) -> Path:
    """One run of ``recipe`` through the normal launcher (``megatron-ext launch``), as its own
    process, into ``run_dir`` (the launcher's and the ranks' output go to ``run_dir/run.log``);
    returns ``run_dir``. A run that fails raises with the last lines of its log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "megatron_ext.launch.cli",
        "launch",
        recipe,
        *overrides,
        f"run_dir={run_dir}",
    ]
    with open(run_dir / "run.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = (run_dir / "run.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(
            f"the {label} run failed (exit {done.returncode}); last lines of {run_dir}/run.log:\n"
            + "\n".join(tail)
        )
    return run_dir


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A run's ``metrics.jsonl``: its training steps and its validation records, in order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if line.strip()]
    train = [r for r in records if "loss" in r]
    if not train:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no training steps")
    return train, [r for r in records if "val_loss" in r]
