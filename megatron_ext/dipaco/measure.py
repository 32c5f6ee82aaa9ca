"""Measurements behind ``megatron-ext bench dipaco`` (figures, never pass/fail).

- :func:`comm_bytes`: bytes per outer step, read from a finished run's files: each path sends
  its trained copy of every shared module it uses (Δ up) and receives each new version (weights
  down); path-specific parts never leave their path. Beside it, data-parallel training of the
  same tokens: P workers taking τ synchronous steps, each an all-reduce of the whole model
  (a ring all-reduce puts 2(P − 1)·M bytes on the wire for M model bytes).
- :func:`outer_timing`: one outer step split into load / reduce / step / write, for synthetic
  modules of several sizes used by several paths.
- :func:`queue_latency`: claim + complete latency and throughput with N concurrent clients.
- :func:`small_run`: a small DiPaCo run (real worker processes) for the other figures.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.outer import OuterConfig, accumulate_delta, apply_outer_step
from megatron_ext.dipaco.plan import outer_id, train_id
from megatron_ext.dipaco.queue import TaskQueue, TaskSpec
from megatron_ext.dipaco.queue_url import parse_queue_url
from megatron_ext.dipaco.recipe import DipacoConfig, path_layout, queue_url
from megatron_ext.dipaco.store import attempt_dir, load_tensors, save_tensors

__all__ = ["comm_bytes", "outer_timing", "queue_latency", "small_overrides", "small_run"]


def _tensor_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def small_overrides(data: Path, run_dir: Path) -> list[str]:
    """dipaco_tiny shrunk to seconds: 2x2 paths of a 4-block width-32 GPT, 2 phases of τ = 3."""
    return [
        f"run_dir={run_dir}",
        f"data.path={data}/docs",
        f"data.source=[{data}/docs.txt]",
        f"data.tokenizer_model={data}/sp.model",
        "dipaco.tokenizer_vocab_size=400",
        "model.hidden_size=32",
        "model.num_attention_heads=2",
        "model.ffn_hidden_size=64",
        "training.seq_length=32",
        "training.micro_batch_size=2",
        "training.global_batch_size=4",
        "training.steps=8",
        "training.lr_warmup_steps=1",
        "dipaco.tau=3",
        "dipaco.phases=2",
        "dipaco.route_tokens=8",
        "dipaco.eval_every_tokens=[8]",
        "dipaco.eval_documents=24",
        "dipaco.lease_seconds=30",
        "dipaco.heartbeat_seconds=2",
        "dipaco.poll_seconds=0.1",
    ]


def write_small_corpus(folder: Path, documents: int = 600) -> Path:
    """``documents`` paragraphs of the Python Language Reference as ``folder/docs.txt``."""
    from megatron_ext.data.corpus import python_docs_documents

    folder.mkdir(parents=True, exist_ok=True)
    docs = [d for d in python_docs_documents() if len(d) > 80][:documents]
    (folder / "docs.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return folder


def small_run(recipe: str, overrides: Sequence[str], workers: int = 1) -> float:
    """Run ``recipe`` with ``workers`` ``megatron-ext dipaco worker`` processes to completion;
    returns the wall time in seconds."""
    exe = Path(sys.executable).with_name("megatron-ext")
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [str(exe), "dipaco", "worker", recipe, *overrides, "--name", f"bench{i}"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    for proc in procs:
        _, err = proc.communicate()
        if proc.returncode:
            raise RuntimeError(f"worker exited {proc.returncode}:\n{err[-3000:]}")
    return time.perf_counter() - start


def comm_bytes(recipe: Recipe) -> dict[str, Any]:
    """Bytes per outer step of a finished run (see the module docstring), per module and in
    total, with the data-parallel reference of the same tokens."""
    d, layout = recipe.section(DipacoConfig), path_layout(recipe)
    queue = TaskQueue(queue_url(recipe), lease_seconds=1, max_attempts=1, worker="bench")

    def done(task: str) -> Path:
        return attempt_dir(recipe.run_dir, task, queue.token(task))

    try:
        phase = d.phases - 1
        modules = {}
        for m in layout.modules:
            new = load_tensors(done(outer_id(phase, m)) / "module.pt")["params"]
            users = layout.paths_of(m)
            up = sum(
                _tensor_bytes(load_tensors(done(train_id(phase, p)) / f"l{m.level}.pt"))
                for p in users
            )
            down = len(users) * _tensor_bytes(new)
            modules[m.name] = {
                "paths": len(users),
                "module_bytes": _tensor_bytes(new),
                "up_bytes": up,
                "down_bytes": down,
            }
        specific = load_tensors(done(train_id(phase, 0)) / "state.pt")["specific"]
    finally:
        queue.close()
    # one path: one module per level, plus its own part
    path_modules = layout.path_modules(0)
    path_bytes = sum(modules[m.name]["module_bytes"] for m in path_modules)
    path_bytes += _tensor_bytes(specific)
    ours = sum(m["up_bytes"] + m["down_bytes"] for m in modules.values())
    p = layout.num_paths
    ddp = d.tau * 2 * (p - 1) * path_bytes if p > 1 else d.tau * 2 * path_bytes
    return {
        "modules": modules,
        "path_specific_bytes_moved": 0,
        "path_specific_param_bytes": _tensor_bytes(specific),
        "path_model_bytes": path_bytes,
        "bytes_per_outer_step": ours,
        "ddp_bytes_same_tokens": ddp,
        "bytes_ratio_vs_ddp": ours / ddp,
        "one_over_tau": 1.0 / d.tau,
        "ddp_model": "P workers, tau steps, ring all-reduce of the whole path model per step: "
        "tau * 2(P-1) * path_model_bytes (P = 1: tau * 2 * path_model_bytes); without "
        "path-specific parts the ratio is P / ((P-1) tau), approaching 1/tau as P grows",
    }


def outer_timing(sizes: Sequence[int], paths: Sequence[int], repeats: int = 3) -> list[dict]:
    """Median milliseconds of load / reduce / step / write of one outer step, for modules of
    ``sizes`` float32 parameters (one tensor) used by each count of ``paths``."""
    cfg = OuterConfig()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for numel in sizes:
            theta = {"w": torch.randn(numel)}
            for p in paths:
                files = []
                for i in range(p):
                    files.append(Path(tmp) / f"path{i}.pt")
                    save_tensors(files[-1], {"w": theta["w"] + 0.01 * torch.randn(numel)})
                times: dict[str, list[float]] = {k: [] for k in ("load", "reduce", "step", "write")}
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    copies = [load_tensors(f) for f in files]
                    t1 = time.perf_counter()
                    delta = None
                    for c in copies:
                        delta = accumulate_delta(delta, theta, c, 1.0 / p)
                    t2 = time.perf_counter()
                    new, mom = apply_outer_step(theta, None, delta, cfg)
                    t3 = time.perf_counter()
                    save_tensors(Path(tmp) / "module.pt", {"params": new, "momentum": mom})
                    t4 = time.perf_counter()
                    for k, a, b in (
                        ("load", t0, t1),
                        ("reduce", t1, t2),
                        ("step", t2, t3),
                        ("write", t3, t4),
                    ):
                        times[k].append((b - a) * 1e3)
                rows.append(
                    {
                        "params": numel,
                        "paths": p,
                        **{f"{k}_ms": statistics.median(v) for k, v in times.items()},
                    }
                )
    return rows


def queue_latency(url: str, clients: int, tasks: int = 200) -> dict[str, Any]:
    """``tasks`` claim + complete round trips shared by ``clients`` threads (one connection
    each): median and p95 latency of a claim+complete pair, tasks per second overall."""
    parsed = parse_queue_url(url)
    setup = TaskQueue(parsed, lease_seconds=60, max_attempts=3, worker="setup")
    setup.enqueue(TaskSpec(f"t{i:05d}", "bench", priority=i) for i in range(tasks))
    setup.close()
    latencies: list[float] = []
    lock = threading.Lock()

    def client(name: str) -> None:
        q = TaskQueue(parsed, lease_seconds=60, max_attempts=3, worker=name)
        mine = []
        while True:
            t0 = time.perf_counter()
            lease = q.claim()
            if lease is None:
                break
            q.complete(lease, {})
            mine.append(time.perf_counter() - t0)
        q.close()
        with lock:
            latencies.extend(mine)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(f"c{i}",)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ordered = sorted(latencies)
    return {
        "backend": parsed.backend,
        "clients": clients,
        "tasks": len(latencies),
        "median_ms": 1e3 * statistics.median(ordered),
        "p95_ms": 1e3 * ordered[int(0.95 * (len(ordered) - 1))],
        "tasks_per_s": len(latencies) / wall,
    }
