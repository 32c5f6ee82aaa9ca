"""One rank of ``megatron-ext bench layerwise --against megatron-core``; started by torchrun.

Builds both arms (:mod:`._layerwise_mcore_arms`: megatron-core's ``LayerWiseDistributedOptimizer``
and megatron-ext's, same GPT, same initial weights, same Muon settings) and trains them on the
same batches, interleaved step by step (A B, then B A: :func:`~._trust.round_order`).  Per arm
and step it records, on this rank:

* the loss (averaged over the data-parallel ranks) and, at the end, each parameter's max
  relative difference between the arms;
* three clocks -- this thread's CPU time, the process CPU time (gloo's threads included) and
  wall time -- over the whole iteration, over forward + backward + gradient sync, and over
  ``optimizer.step()``;
* payload bytes of every collective, in two phases: gradient sync (forward, backward,
  ``finalize_model_grads``) and step (the parameter gather and the norms), by
  :mod:`._collective_bytes`;
* the peak resident set during the iteration over the resident set before it (Linux:
  ``/proc/self/clear_refs`` resets the high-water mark ``VmHWM``), per phase (forward +
  backward + gradient sync, ``step()``, the parameter-sync wait: the high-water mark is reset
  as each begins and read as it ends) and over the whole iteration (the largest of them), and
  the optimizer-state bytes held.

With ``--device cuda`` (one GPU per rank, NCCL) the clocks wait for the GPU at both ends of
each span, the iteration ratio is of wall time, and peak memory is the CUDA allocator's.

After ``--steps`` steps it continues until the iteration-time ratio's spread (slowest rank per
step, :func:`~._trust.ratio_spread`) is at most ``--spread``, ``--budget`` seconds have passed, or
``--max-steps``; rank 0 decides and tells the others.  Writes ``OUT/rank<r>.json``.

Usage: python -m torch.distributed.run --standalone --nproc-per-node N
    -m megatron_ext.bench._layerwise_mcore_worker --layers 2 --steps 20 --out DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.bench._collective_bytes import CollectiveBytes
from megatron_ext.bench._layerwise_mcore_arms import ARMS, build_arms, train_step
from megatron_ext.bench._trust import Repeat, round_order
from megatron_ext.gpt import ParallelConfig
from megatron_ext.megatron import apply_cpu_compat_layerwise, init_distributed

CLOCKS = ("thread", "process", "wall")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _memory_now(cuda: bool) -> int:
    """KiB in use: the CUDA allocator's on a GPU, the resident set on a CPU host."""
    return torch.cuda.memory_allocated() // 1024 if cuda else _status_kib("VmRSS")


def _memory_peak(cuda: bool) -> int:
    """KiB at the peak since the last reset (CUDA allocator, or ``VmHWM``)."""
    return torch.cuda.max_memory_allocated() // 1024 if cuda else _status_kib("VmHWM")


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class Clocks:
    """Thread CPU, process CPU and wall seconds per named span, for the current step (``sync``
    waits for queued GPU work at both ends, so that wall time covers it)."""

    def __init__(self, sync: Any = lambda: None) -> None:
        self.now: dict[str, dict[str, float]] = {}
        self.sync = sync

    @contextlib.contextmanager
    def span(self, name: str) -> Iterator[None]:
        self.sync()
        t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.now[name] = {
                "thread": time.thread_time() - t0,
                "process": time.process_time() - p0,
                "wall": time.perf_counter() - w0,
            }


def batch(step: int, global_batch: int, seq: int, vocab: int, rank: int, dp: int) -> torch.Tensor:
    """This rank's contiguous share of step ``step``'s global batch (random tokens, seeded by
    the step: the same global batch at any DP size)."""
    gen = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, vocab, (global_batch, seq + 1), generator=gen)
    per = global_batch // dp
    return tokens[rank * per : (rank + 1) * per]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=0.002)
    parser.add_argument("--extra-scale", type=float, default=0.2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--spread", type=float, default=0.05)
    parser.add_argument("--budget", type=float, default=60.0)
    parser.add_argument("--no-overlap-grad-reduce", action="store_true")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--mcore-layout", choices=("legacy", "padded"), default="legacy")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    cuda = args.device == "cuda"
    if cuda:  # one GPU per rank, NCCL
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:  # one compute thread per rank, gloo
        torch.set_num_threads(1)
    backend = "nccl" if cuda else "gloo"
    env = init_distributed(ParallelConfig(backend=backend), seed=1234, master_port=29500)
    apply_cpu_compat_layerwise()  # nothing on a CUDA host
    rank, dp = dist.get_rank(), dist.get_world_size()
    if args.global_batch % dp:
        raise SystemExit(f"--global-batch {args.global_batch} is not divisible by DP={dp}")
    rss_base_kib = _status_kib("VmRSS")
    arms = build_arms(
        args.layers, args.hidden, args.vocab, args.seq, args.lr, args.extra_scale,
        overlap_grad_reduce=not args.no_overlap_grad_reduce, precision=args.precision,
        mcore_layout=args.mcore_layout,
    )  # fmt: skip
    rss_built_kib = _status_kib("VmRSS")
    wire = CollectiveBytes()
    wire.install()
    clocks = Clocks(torch.cuda.synchronize if cuda else lambda: None)
    peak_ok = cuda or _reset_peak()
    rows: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    repeat = Repeat(args.spread, args.budget, min_rounds=args.steps, max_rounds=args.max_steps)
    slowest: dict[str, list[float]] = {a: [] for a in ARMS}
    step = 0
    while True:
        tokens = batch(step, args.global_batch, args.seq, args.vocab, rank, dp)
        tokens = tokens.to(torch.cuda.current_device() if cuda else "cpu")
        for name in round_order(ARMS, step):
            arm = arms[name]
            dist.barrier()
            rss0 = _memory_now(cuda)
            with clocks.span("iteration"):
                loss, peaks = _step_counted(arm, tokens, clocks, wire, cuda, rss0)
            peak = max(peaks.values()) if peak_ok else None
            mean = torch.tensor([loss], dtype=torch.float64, device=tokens.device)
            dist.all_reduce(mean)  # outside any counted phase
            rows[name].append(
                {
                    "loss": float(mean) / dp,
                    "clocks": dict(clocks.now),
                    "grad_bytes": wire.take("grad"),
                    "step_bytes": wire.take("step"),
                    "peak_rss_increase_kib": peak,
                    "peak_rss_increase_phase_kib": peaks if peak_ok else None,
                }
            )
        step += 1
        if step <= args.warmup:
            continue
        # the slowest rank's iteration time per arm, this step (thread CPU; GPU: wall)
        clock = "wall" if cuda else "thread"
        mine = [rows[a][-1]["clocks"]["iteration"][clock] for a in ARMS]
        everyone: list[Any] = [None] * dp
        dist.all_gather_object(everyone, mine)
        for i, a in enumerate(ARMS):
            slowest[a].append(max(e[i] for e in everyone))
        ratios = [
            x / y for x, y in zip(slowest["megatron_ext"], slowest["megatron_core"], strict=True)
        ]
        done = rank == 0 and repeat.done(step - args.warmup, [ratios])
        stop = torch.tensor([int(done)], device=tokens.device)
        dist.broadcast(stop, src=0)
        if int(stop):
            break
    wire.uninstall()

    core, ext = (arms[a].params() for a in ARMS)
    param_diff = {
        n: float(
            (core[n].float() - ext[n].float()).norm() / core[n].float().norm().clamp_min(1e-30)
        )
        for n in core
    }
    result = {
        "rank": rank,
        "world": dp,
        "warmup": args.warmup,
        "steps_run": step,
        "repeat": repeat.as_dict() if rank == 0 else None,
        "arms": {a: arms[a].description for a in ARMS},
        "state_bytes": {a: arms[a].state_bytes() for a in ARMS},
        "rss_kib": {"start": rss_base_kib, "built": rss_built_kib, "end": _status_kib("VmRSS")},
        "peak_rss_measured": peak_ok,
        "peak_memory": "CUDA allocator" if cuda else "resident set (VmHWM - VmRSS before)",
        "device": args.device,
        "precision": args.precision,
        "mcore_layout": args.mcore_layout,
        "param_rel_diff": param_diff,
        "parameters": sum(p.numel() for p in core.values()),
        "rows": rows,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    del env
    dist.destroy_process_group()


def _step_counted(
    arm: Any, tokens: torch.Tensor, clocks: Clocks, wire: CollectiveBytes, cuda: bool, rss0: int
) -> tuple[float, dict[str, int]]:
    """:func:`train_step` with the gradient-sync and step phases counted apart; returns the
    loss and each phase's peak memory over ``rss0`` (KiB, the memory before the iteration)."""
    peaks: dict[str, int] = {}

    class _Phased:
        @contextlib.contextmanager
        def span(self, name: str) -> Iterator[None]:
            phase = "grad" if name == "fwd_bwd_sync" else "step"
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            else:
                _reset_peak()
            with clocks.span(name), wire.counting(phase):
                yield
            peaks[name] = _memory_peak(cuda) - rss0

    return train_step(arm, tokens, _Phased()), peaks


if __name__ == "__main__":
    main()
