"""Measurements behind ``megatron-ext bench dipaco`` (figures, never pass/fail).

- :func:`comm_bytes`: bytes per outer step, read from a finished run's files, beside
  data-parallel training (DDP) of the same tokens, under one model of transfer on both sides.
  The headline figures use *parameter-server* accounting: a worker sends what it computed to the
  holder of the global copy and receives the new copy back. DiPaCo: each path sends its trained
  copy of every shared module it uses (Δ up) to that module's outer executor and receives the
  new version (weights down); path-specific parts never leave their path. DDP: P workers (one
  per path, same tokens) each send their gradient of the whole model and receive the new
  weights at each of the τ steps, ``τ·P·2·M`` bytes for M model bytes. Without path-specific
  parts the ratio is exactly 1/τ; they lower it. The same run is also counted as *ring
  all-reduces* on both sides (``comm.ring``): module (l, e) all-reduced over its P_{l,e} paths
  once per outer step, ``2(P_{l,e} − 1)·S`` bytes, against DDP's ``τ·2(P − 1)·M``.
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

from megatron_ext.config import Recipe
from megatron_ext.dipaco import (
    DipacoConfig,
    OuterConfig,
    RunFiles,
    TaskQueue,
    TaskSpec,
    accumulate_delta,
    apply_outer_step,
    load_tensors,
    outer_id,
    parse_queue_url,
    path_layout,
    queue_url,
    save_tensors,
    train_id,
)

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
    from megatron_ext.data import python_docs_documents

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
    """Bytes per outer step of a finished run's last phase (see the module docstring), per
    module and in total, with DDP on the same tokens, both counted parameter-server style and
    as ring all-reduces. Every byte count is measured: the tensors of the files the run wrote
    (numel × element size), nothing taken from the config."""
    d, layout = recipe.section(DipacoConfig), path_layout(recipe)
    queue = TaskQueue(queue_url(recipe), lease_seconds=1, max_attempts=1, worker="bench")
    done = RunFiles(recipe, queue).done

    try:
        phase = d.phases - 1
        modules, sent = {}, {}
        for p in range(layout.num_paths):
            folder = done(train_id(phase, p))
            sent[p] = {
                level: _tensor_bytes(load_tensors(folder / f"l{level}.pt"))
                for level in range(layout.num_levels)
            }
            sent[p][None] = _tensor_bytes(load_tensors(folder / "state.pt")["specific"])
        for m in layout.modules:
            size = _tensor_bytes(load_tensors(done(outer_id(phase, m)) / "module.pt")["params"])
            users = layout.paths_of(m)
            modules[m.name] = {
                "paths": len(users),
                "module_bytes": size,
                "up_bytes": sum(sent[p][m.level] for p in users),
                "down_bytes": len(users) * size,
                "ring_bytes": 2 * (len(users) - 1) * size,
            }
    finally:
        queue.close()
    p, tau = layout.num_paths, d.tau
    # a DDP worker holds one whole dense model: a path's modules and its own part
    model_bytes = [sum(parts.values()) for parts in sent.values()]
    if len(set(model_bytes)) != 1:
        raise RuntimeError(f"the paths' models differ in size: {model_bytes} bytes")
    m_bytes = model_bytes[0]
    ours = sum(m["up_bytes"] + m["down_bytes"] for m in modules.values())
    ddp = tau * sum(2 * b for b in model_bytes)  # every worker: gradient up, weights down
    ours_ring = sum(m["ring_bytes"] for m in modules.values())
    ddp_ring = tau * 2 * (p - 1) * m_bytes
    return {
        "accounting": "parameter server on both sides: DiPaCo paths send each shared module "
        "up and receive its new version (per outer step); DDP's P workers send the whole "
        "model's gradient up and receive its weights, every one of tau steps",
        "modules": modules,
        "path_specific_bytes_moved": 0,
        "path_specific_param_bytes": sent[0][None],
        "path_model_bytes": m_bytes,
        "bytes_per_outer_step": ours,
        "ddp_bytes_same_tokens": ddp,
        "bytes_ratio_vs_ddp": ours / ddp,
        "one_over_tau": 1.0 / tau,
        "ring": {
            "accounting": "ring all-reduce on both sides: module (l,e) over its P_{l,e} paths, "
            "2(P_{l,e}-1)*S per outer step; DDP over P workers, 2(P-1)*M per step, tau steps",
            "bytes_per_outer_step": ours_ring,
            "ddp_bytes_same_tokens": ddp_ring,
            "bytes_ratio_vs_ddp": ours_ring / ddp_ring if ddp_ring else None,
        },
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
