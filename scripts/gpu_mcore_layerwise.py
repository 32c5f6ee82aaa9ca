"""megatron-core's own ``LayerWiseDistributedOptimizer`` beside megatron-ext's on GPUs: the
comparison of ``megatron-ext bench layerwise --against megatron-core`` (same GPT, same initial
weights and batches, same Muon settings, interleaved step by step) in the configuration a GPU
run uses and a CPU host cannot: bf16 parameters with fp32 masters (megatron-core's
``Float16OptimizerWithFloat16Params``), NCCL, and megatron-core's padded parameter layout
(Megatron-LM's default ``wrap_model_chunks_with_ddp``: shard-aligned buckets, a gradient
reduce-scatter, the parameter all-gather from DDP's buffer, AdamW on a ``DistributedOptimizer``).
One rank per GPU: DP 1, 2, 4, ... up to the GPUs present (one GPU: DP=1 only, no wire); two
depths. Time is CUDA-synchronised wall time; peak memory is the CUDA allocator's.

``--dry-run`` needs no GPU: it imports everything the run imports (the bench's arms,
megatron-core's layer-wise optimizer, Megatron-LM's ``wrap_model_chunks_with_ddp``,
Emerging-Optimizers' Muon), checks that the bench accepts the command line, prints it and exits
0.

Usage: python scripts/gpu_mcore_layerwise.py --out OUT.json [--gpus N] [--dry-run]
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import subprocess
import sys

#: what the run imports, checked by --dry-run
MODULES = (
    "megatron_ext.bench._layerwise_mcore_worker",
    "megatron_ext.bench._layerwise_mcore_arms",
    "megatron.core.optimizer.layer_wise_optimizer",
    "megatron.training.training",
    "emerging_optimizers.orthogonalized_optimizers",
)


def dp_sizes(gpus: int) -> list[int]:
    """1, 2, 4, ... up to ``gpus``."""
    sizes, n = [], 1
    while n <= max(gpus, 1):
        sizes.append(n)
        n *= 2
    return sizes


def command(out: str, gpus: int, steps: int, budget: float) -> list[str]:
    """The bench's command line for this GPU host."""
    return [
        sys.executable, "-m", "megatron_ext.launch.cli", "bench", "layerwise",
        "--against", "megatron-core", "--device", "cuda", "--precision", "bf16",
        "--mcore-layout", "padded", "--dp", *map(str, dp_sizes(gpus)), "--depths", "2", "4",
        "--steps", str(steps), "--budget", str(budget), "--json", out,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the JSON the bench writes")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all)")
    parser.add_argument("--steps", type=int, default=20, help="interleaved steps at least")
    parser.add_argument("--budget", type=float, default=30.0, help="seconds per comparison")
    parser.add_argument("--dry-run", action="store_true", help="check and print, run nothing")
    args = parser.parse_args(argv)
    import torch

    gpus = args.gpus if args.gpus is not None else torch.cuda.device_count()
    cmd = command(args.out, gpus or 1, args.steps, args.budget)
    if args.dry_run:
        for name in MODULES:
            importlib.import_module(name)
        from megatron_ext.bench import layerwise

        check = argparse.ArgumentParser()
        layerwise.add_arguments(check)
        check.parse_args(cmd[cmd.index("layerwise") + 1 :])  # the bench takes this command line
        print(f"imports ok ({len(MODULES)} modules); would run: {shlex.join(cmd)}")
        return 0
    if not torch.cuda.is_available() or gpus < 1:
        print(
            "gpu_mcore_layerwise: no CUDA GPU visible (torch.cuda.is_available() is False); "
            "run it on a GPU host, or check it here with --dry-run"
        )
        return 2
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
