"""Time the GPT trainer's iteration with the layer-wise optimizer (Muon), per phase, on CPU.

Run under torchrun (gloo), one thread per rank::

    torchrun --nproc-per-node 2 scripts/time_layerwise_grad_sync.py --out run.json

It builds the GPT trainer's run (megatron-core GPTModel + this project's DDP + the layer-wise
optimizer, :func:`megatron_ext.gpt.setup.setup`) on a generated corpus and times ``steps``
iterations after ``warmup``: the whole ``train_step`` (wall time, and CPU time of the main
thread and of the process: on a loaded host the CPU times do not count waiting for a core or a
peer), its ``optimizer.step()``, and the part
of ``finish_grad_sync`` left after backward (the gradient sync not hidden behind backward).
One more iteration counts the tensors the gradient sync allocates (a torch dispatch mode
around ``finish_grad_sync`` and, where the sync runs from backward, around its DDP handler's
``grad_ready``: every op output on a storage none of the op's inputs had). Rank 0 writes the
medians over steps of the slowest rank, the allocation counts and each rank's peak RSS to
``--out``. It imports whatever ``megatron_ext`` is first on ``sys.path``, so the same script
times two versions of the code (``PYTHONPATH=<old tree>``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

TEXT = "\n".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i % 7} times, "
    f"while megatron trains a small model on byte {i % 13}."
    for i in range(2000)
)


class NewStorages(TorchDispatchMode):
    """Counts op outputs on new storages (allocations) and their bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.count = self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        leaves = tree_leaves((args, kwargs or {}))
        seen = {t.untyped_storage().data_ptr() for t in leaves if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                self.count += 1
                self.bytes += t.untyped_storage().nbytes()
        return out


def recipe(root: Path, args: argparse.Namespace, world: int) -> dict:
    corpus = root / "corpus.txt"
    return {
        "trainer": "gpt",
        "model": {
            "num_layers": args.layers,
            "hidden_size": args.hidden,
            "num_attention_heads": 4,
            "vocab_size": args.vocab,
        },
        "optimizer": {"name": "muon", "lr": 1e-3, "min_lr": 1e-4},
        "data": {"path": str(root / "data" / "corpus"), "source": [str(corpus)]},
        "training": {
            "steps": args.warmup + args.steps + 1,
            "micro_batch_size": args.micro_batch,
            "global_batch_size": args.micro_batch * world,
            "seq_length": args.seq,
            "lr_warmup_steps": 1,
        },
        "logging": {"log_interval": 1, "tensorboard": False, "progress_bar": "off"},
        "checkpoint": {"save_interval": 0},
        "launch": {"nproc_per_node_cpu": world, "threads_per_rank": 1},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--bucket-numel", type=int, default=300_000)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    rank = int(os.environ["RANK"])

    import megatron_ext.distributed.layerwise as layerwise
    from megatron_ext.config.load import recipe_from_dict
    from megatron_ext.gpt.setup import setup
    from megatron_ext.gpt.step import train_step

    # The optimizer's bucket size (both versions take it as the dataclass field's default).
    init = layerwise.LayerwiseOptimizer.__init__
    names = init.__code__.co_varnames[1 : init.__code__.co_argcount]
    defaults = list(init.__defaults__)
    defaults[names.index("bucket_numel") - (len(names) - len(defaults))] = args.bucket_numel
    init.__defaults__ = tuple(defaults)

    root = Path(tempfile.gettempdir()) / f"time_lw_{os.environ.get('MASTER_PORT', '0')}"
    root.mkdir(exist_ok=True)
    if rank == 0:
        (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    run = setup(recipe_from_dict({**recipe(root, args, world), "run_dir": str(root / "run")}))

    finish = run.chunks[0].finish_grad_sync
    exposed: list[float] = []

    def timed_finish(*a, **k):
        t0 = time.perf_counter()
        finish(*a, **k)
        exposed.append(time.perf_counter() - t0)

    run.chunks[0].finish_grad_sync = timed_finish
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows: dict[str, list[float]] = {
        "iteration_s": [],
        "iteration_thread_cpu_s": [],
        "iteration_process_cpu_s": [],
        "step_s": [],
        "grad_sync_exposed_s": [],
    }
    for i in range(args.warmup + args.steps):
        dist.barrier()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        result = train_step(run, i)
        wall = time.perf_counter() - t0
        if i >= args.warmup:
            rows["iteration_s"].append(wall)
            rows["iteration_thread_cpu_s"].append(time.thread_time() - c0)
            rows["iteration_process_cpu_s"].append(time.process_time() - p0)
            rows["step_s"].append(result.optimizer_s)
            rows["grad_sync_exposed_s"].append(exposed[-1])
    counter = NewStorages()

    def counted(fn):
        def run_counted(*a, **k):
            with counter:
                return fn(*a, **k)

        return run_counted

    run.chunks[0].finish_grad_sync = counted(run.chunks[0].finish_grad_sync)
    handler = getattr(run.chunks[0], "_grad_sync", None)
    if hasattr(handler, "grad_ready"):  # a sync started from backward
        handler.grad_ready = counted(handler.grad_ready)
    train_step(run, args.warmup + args.steps)
    mine = {
        **{k: v for k, v in rows.items()},
        "allocations": counter.count,
        "allocated_bytes": counter.bytes,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "rss_increase_mib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024,
        "loss": result.loss,
    }
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        slowest = {k: [max(r[k][s] for r in everyone) for s in range(args.steps)] for k in rows}
        out = {
            "world": world,
            "layers": args.layers,
            "hidden": args.hidden,
            "bucket_numel": args.bucket_numel,
            "load_average": os.getloadavg(),
            **{f"{k}_median": statistics.median(v) for k, v in slowest.items()},
            "grad_sync_allocations": [r["allocations"] for r in everyone],
            "grad_sync_allocated_bytes": [r["allocated_bytes"] for r in everyone],
            "peak_rss_mib": [r["peak_rss_mib"] for r in everyone],
            "rss_increase_mib": [r["rss_increase_mib"] for r in everyone],
            "last_loss": mine["loss"],
        }
        Path(args.out).write_text(json.dumps(out, indent=1))
        print(json.dumps(out))
    dist.barrier()


if __name__ == "__main__":
    main()
