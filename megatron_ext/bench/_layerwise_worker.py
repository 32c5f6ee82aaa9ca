"""One rank of ``megatron-ext bench layerwise``; started by torchrun (gloo), never imported.

Every rank builds the same reference workload (seeded), gives it the same gradients, runs
``--warmup`` untimed and ``--steps`` timed steps of :class:`LayerwiseOptimizer` and writes its
measurements to ``OUT/rank<r>.json``:

* ``compute_cpu_s``: this thread's CPU time (``time.thread_time``) inside the optimizers'
  ``step()`` calls only, per step -- the update arithmetic, with one compute thread per rank;
  gloo's transfers run on its own threads and are not counted.  ``compute_process_cpu_s`` is the
  process CPU time over the same intervals (gloo threads included), ``compute_wall_s`` the wall
  time over them, ``step_wall_s`` the wall time of the whole ``step()`` (updates, buffer copies,
  all-gather launches), ``exposed_comm_s`` the wall time of ``finish()`` after it.
* the all-gather's payload bytes over the timed steps, and what they should be: the bytes of
  the parameters other ranks own.
* an exact fingerprint of the final parameters (int64 sum of their bits, per parameter), the
  same on every rank when the all-gather delivered every update.
* the memory the rank holds for its updates: its fp32 masters (``--precision bf16``: only for
  the parameters it updates) and its optimizer state, in bytes.

Usage: python -m torch.distributed.run --standalone --nproc-per-node N
    -m megatron_ext.bench._layerwise_worker --optimizer muon --steps 2 --warmup 1 --out DIR
    [--precision bf16]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.bench.common import optimizer_state_bytes
from megatron_ext.bench.optimizers import Workload, add_workload_arguments
from megatron_ext.distributed import LayerwiseOptimizer, OwnershipPlan, WireStats, make_allgather_v

DENSE_NAMES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
EXPERT_NAMES = ("linear_fc1", "linear_fc2")


def workload_names(workload: Workload) -> list[tuple[str, tuple[int, int]]]:
    """The workload's matrices with megatron-core-style names, forward order."""
    named: list[tuple[str, tuple[int, int]]] = []
    for layer in range(workload.layers):
        pre = f"decoder.layers.{layer}"
        for name, shape in zip(DENSE_NAMES, workload.dense_shapes(), strict=True):
            named.append((f"{pre}.{name}.weight", shape))
        for name, shape in zip(EXPERT_NAMES, workload.expert_shapes(), strict=True):
            for e in range(workload.experts):
                named.append((f"{pre}.mlp.experts.local_experts.{e}.{name}.weight", shape))
    return named


class _Timer:
    """Accumulates thread CPU, process CPU and wall seconds of wrapped calls (``sync`` waits for
    queued GPU work at both ends, so that wall time covers it)."""

    def __init__(self, sync: Any = lambda: None) -> None:
        self.sync = sync
        self.thread = self.process = self.wall = 0.0

    def reset(self) -> None:
        self.thread = self.process = self.wall = 0.0

    def wrap(self, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.sync()
            t0, p0, w0 = time.thread_time(), time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.sync()
                self.thread += time.thread_time() - t0
                self.process += time.process_time() - p0
                self.wall += time.perf_counter() - w0

        return timed


def fingerprint(params: list[tuple[str, torch.nn.Parameter]]) -> list[int]:
    """Exact per-parameter fingerprint: the int64 sum of the bit patterns (fp32 or bf16)."""
    bits = {4: torch.int32, 2: torch.int16}
    return [int(p.detach().view(bits[p.element_size()]).to(torch.int64).sum()) for _, p in params]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", default="muon")
    add_workload_arguments(parser)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--bucket-numel", type=int, default=4_000_000)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    if args.device == "cuda":  # one GPU per rank, NCCL
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
        sync: Any = torch.cuda.synchronize
    else:  # one compute thread per rank, gloo
        device = torch.device("cpu")
        torch.set_num_threads(1)
        dist.init_process_group("gloo")
        sync = lambda: None  # noqa: E731
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU: the same values on any device
    named = workload_names(Workload.from_args(args))
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    params = [
        (n, torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(device, dtype)))
        for n, s in named
    ]
    # bf16-representable values: the dp shares g/dp (dp a power of two <= 4) sum back to g exactly
    grads = [(torch.randn(s, generator=gen) * 1e-3).bfloat16().float().to(device) for _, s in named]

    world = dist.get_world_size()
    gather = make_allgather_v()
    opt = LayerwiseOptimizer(params, args.optimizer, gather, bucket_numel=args.bucket_numel)
    timer = _Timer(sync)
    for o in opt.all_optimizers():
        o.step = timer.wrap(o.step)  # type: ignore[method-assign]

    rows: dict[str, list[float]] = {
        k: [] for k in ("compute_cpu_s", "compute_process_cpu_s", "compute_wall_s")
    }
    rows |= {"step_wall_s": [], "exposed_comm_s": [], "grad_sync_s": []}
    # the gradient path a training run takes (:meth:`MegatronExtOptimizer.take_over_grad_sync`):
    # one storage laid out by the optimizer, scaled by 1/dp before the sum, each gradient
    # reported complete as backward would (later parameters first), the buckets' reduce-scatter-v
    # started as they fill and waited for in finish_grad_sync
    views = opt.bind_grad_storage(torch.zeros(opt.grad_numel, device=device), 1.0 / world)
    grads_of = {n: views[n].view_as(p) for n, p in params}
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            gather.stats = WireStats()
            opt.grad_wire = WireStats()
        # what backward leaves in the storage: this rank's unscaled gradient (untimed)
        for (n, _), g in zip(params, grads, strict=True):
            grads_of[n].copy_(g)
        sync()
        dist.barrier()
        g0 = time.perf_counter()
        for n, _ in reversed(params):
            opt.grad_ready(n)
        opt.finish_grad_sync()
        sync()
        grad_sync_s = time.perf_counter() - g0
        opt.set_grads(grads_of)  # the owners' sums to their (fp32) masters
        timer.reset()
        w0 = time.perf_counter()
        opt.step()
        sync()
        w1 = time.perf_counter()
        opt.finish()
        sync()
        w2 = time.perf_counter()
        if i >= args.warmup:
            rows["compute_cpu_s"].append(timer.thread)
            rows["compute_process_cpu_s"].append(timer.process)
            rows["compute_wall_s"].append(timer.wall)
            rows["step_wall_s"].append(w1 - w0)
            rows["exposed_comm_s"].append(w2 - w1)
            rows["grad_sync_s"].append(grad_sync_s)

    plan = opt.plan
    rank, world = opt.rank, opt.world
    nbytes = {n: p.numel() * p.element_size() for n, p in params}
    owned = sum(b for n, b in nbytes.items() if plan.owner[n] == rank)
    replicated = sum(b for n, b in nbytes.items() if plan.owner[n] == OwnershipPlan.REPLICATED)
    per_rank_owned = [sum(b for n, b in nbytes.items() if plan.owner[n] == r) for r in range(world)]
    mine = fingerprint(params)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    result = {
        "rank": rank,
        "world": world,
        "backend": gather.name,
        "buckets": len(opt.buckets),
        "total_bytes": sum(nbytes.values()),
        "total_grad_bytes": sum(g.numel() * g.element_size() for g in grads),  # fp32
        "owned_bytes": owned,
        "per_rank_owned_bytes": per_rank_owned,
        "replicated_bytes": replicated,
        "not_owned_bytes": sum(nbytes.values()) - owned - replicated,
        "param_sync_bytes_sent": gather.stats.sent / args.steps,
        "param_sync_bytes_recv": gather.stats.received / args.steps,
        "grad_sync_bytes_sent": opt.grad_wire.sent / args.steps,
        "grad_sync_bytes_recv": opt.grad_wire.received / args.steps,
        "plan_compute_flops": plan.compute,
        "plan_memory_bytes": plan.memory,
        "compute_imbalance": plan.compute_imbalance,
        "memory_imbalance": plan.memory_imbalance,
        "ranks_agree": all(f == mine for f in everyone),
        "precision": args.precision,
        "device": args.device,
        "master_bytes": opt.master_bytes(),
        "state_bytes": optimizer_state_bytes(opt),  # masters apart
        "fingerprint": mine,
        **rows,
    }
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
