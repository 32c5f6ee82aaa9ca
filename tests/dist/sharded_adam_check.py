"""Run under torchrun (gloo): ZeRO-1 AdamW (:class:`~megatron_ext.distributed.sharded_adam.
ShardedAdamW`) in the GPT trainer, for ``tests/test_sharded_adam.py``.

Tasks, in the order given:

- ``trajectory``: the tiny GPT, :data:`STEPS` steps of a fixed global batch of
  :data:`GLOBAL_BATCH` sequences, each of :data:`TRAJECTORIES`, once with the trainer's own
  AdamW (sharded) and once with :class:`~megatron_ext.megatron.replicated.ReplicatedOptimizer` (every rank steps
  every parameter, DDP all-reduces the gradients): per step the loss and gradient norm, and at
  the end each parameter's raw-bit checksum; ``OUT/trajectory.json`` (rank 0).
- ``save:DIR``: sharded AdamW (bf16) for :data:`SAVE_STEP` steps, a checkpoint at ``DIR``
  (the trainer's ``save_checkpoint``), then one more step; ``OUT/saved.pt`` (the whole state
  assembled from every rank's ranges, and the parameters) and ``OUT/after_save.json``.
- ``load:DIR``: a fresh run at this world size loads ``DIR`` (the trainer's
  ``load_checkpoint``), then takes one step; ``OUT/loaded.pt`` and ``OUT/after_load.json``.

Usage: sharded_adam_check.py OUT TASK [TASK ...]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tests.dist.planner_measure import model_parallel_groups, trainer_run

STEPS = 4
SAVE_STEP = 3
GLOBAL_BATCH = 8  # 4 micro-batches of 2 at DP 1, 1 at DP 4: the same global batch everywhere
BASE = [
    "training.eval_iters=0",
    "checkpoint.save_interval=0",
    "training.seq_length=32",
    "training.micro_batch_size=2",
    f"training.global_batch_size={GLOBAL_BATCH}",
    "optimizer.name=adamw",
]
#: (precision, clip_grad) of the trajectory runs: without clipping the arithmetic of the two
#: optimizers is the same but for the gradient sum's order; with it, the global norm (a sum
#: over ranks here, over parameters there) sets the clipping coefficient too
TRAJECTORIES = (("fp32", 0.0), ("bf16", 0.0), ("bf16", 1.0))


def replicated_factory(cfg: Any, qkv_layout: Any = None) -> Any:
    """The reference: AdamW on every rank over every parameter (megatron-core's non-distributed
    optimizer), rank 0 of each data-parallel group writing; ``qkv_layout`` is unused (the
    signature of :func:`~megatron_ext.megatron.optimizer_factories.inner_factory`)."""
    import torch

    from megatron_ext.megatron.optimizer_factories import hyperparameters
    from megatron_ext.megatron.replicated import ReplicatedOptimizer
    from megatron_ext.optimizers.routing import weight_decay_groups

    def build(named: Any) -> Any:
        def adamw(masters: Any) -> torch.optim.Optimizer:
            return torch.optim.AdamW(weight_decay_groups(masters), **hyperparameters(cfg)["adamw"])

        return ReplicatedOptimizer(named, adamw)

    return build


def run_of(precision: str, clip: float = 1.0, replicated: bool = False) -> Any:
    from unittest import mock

    import megatron_ext.gpt.setup as gpt_setup

    overrides = [*BASE, f"training.precision={precision}", f"optimizer.clip_grad={clip}"]
    if not replicated:
        return trainer_run("tiny_cpu_gpt", overrides)
    with mock.patch.object(gpt_setup, "inner_factory", replicated_factory):
        return trainer_run("tiny_cpu_gpt", overrides)


def checksums(run: Any) -> dict[str, int]:
    from megatron_ext.distributed.allgather_v import raw_bits

    return {
        n: int(raw_bits(p.detach().contiguous()).to(dtype=__import__("torch").int64).sum())
        for n, p in run.chunks[0].module.named_parameters()
    }


def train(run: Any, first: int, steps: int) -> list[list[float]]:
    from megatron_ext.gpt.step import train_step

    out = []
    for step in range(first, first + steps):
        result = train_step(run, step)
        assert result.success
        out.append([result.loss, result.grad_norm])
    run.optimizer.finish_param_sync()
    return out


def run_trajectory(out: Path) -> None:
    import torch.distributed as dist

    got: dict[str, Any] = {}
    with model_parallel_groups():
        for precision, clip in TRAJECTORIES:
            sharded: dict[str, Any] = {}
            for impl in ("sharded", "replicated"):
                start = time.perf_counter()
                run = run_of(precision, clip, replicated=impl == "replicated")
                inner = type(run.optimizer.optimizer).__name__
                steps = train(run, 0, STEPS)
                got[f"{precision}/{clip}/{impl}"] = {
                    "inner": inner,
                    "steps": steps,
                    "checksums": checksums(run),
                    "seconds": time.perf_counter() - start,
                }
                params = {n: p.detach().double() for n, p in run.chunks[0].module.named_parameters()}
                if impl == "sharded":
                    sharded = params
                else:  # the largest difference of any parameter element between the two
                    got[f"{precision}/{clip}/max_abs_diff"] = max(
                        float((params[n] - sharded[n]).abs().max()) for n in params
                    )
                del run
    if dist.get_rank() == 0:
        Path(out, "trajectory.json").write_text(json.dumps(got))


def full_state(run: Any) -> dict[str, Any]:
    """Every parameter's whole optimizer state, assembled from each rank's range (on every
    rank), and the parameters."""
    import torch
    import torch.distributed as dist

    inner = run.optimizer.optimizer
    mine = {n: (inner.flat_range(n), st) for n, st in inner.named_state().items()}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    params = dict(inner.named_params)
    state: dict[str, dict[str, Any]] = {}
    for rank_state in every:
        for name, ((lo, hi), st) in rank_state.items():
            for key, value in st.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    whole = state.setdefault(name, {}).setdefault(
                        key, torch.full((params[name].numel(),), float("nan"))
                    )
                    whole[lo:hi] = value
                else:
                    state.setdefault(name, {})[key] = float(value)
    return {
        "state": state,
        "params": {n: p.detach().float().clone() for n, p in params.items()},
    }


def run_save(out: Path, ckpt: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_ext.gpt.checkpoint import save_checkpoint

    with model_parallel_groups():
        run = run_of("bf16")
        train(run, 0, SAVE_STEP)
        save_checkpoint(Path(ckpt), SAVE_STEP, run.chunks[0], run.optimizer, {"step": SAVE_STEP}, 1)
        state = full_state(run)
        after = train(run, SAVE_STEP, 1)
    if dist.get_rank() == 0:
        torch.save(state, Path(out, "saved.pt"))
        Path(out, "after_save.json").write_text(json.dumps(after))


def run_load(out: Path, ckpt: str) -> None:
    import torch
    import torch.distributed as dist

    from megatron_ext.ckpt.select import checkpoint_dirs
    from megatron_ext.gpt.checkpoint import load_checkpoint

    with model_parallel_groups():
        run = run_of("bf16")
        loop = load_checkpoint(checkpoint_dirs(Path(ckpt))[-1], run.chunks[0], run.optimizer)
        assert loop["step"] == SAVE_STEP, loop
        state = full_state(run)
        after = train(run, SAVE_STEP, 1)
    if dist.get_rank() == 0:
        torch.save(state, Path(out, "loaded.pt"))
        Path(out, "after_load.json").write_text(json.dumps(after))


def main(out: str, tasks: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from tests.dist.ending import leave

    torch.set_num_threads(1)
    Path(out).mkdir(parents=True, exist_ok=True)
    for task in tasks:
        what, _, arg = task.partition(":")
        if what == "trajectory":
            run_trajectory(Path(out))
        elif what == "save":
            run_save(Path(out), arg)
        elif what == "load":
            run_load(Path(out), arg)
        else:
            raise SystemExit(f"unknown task {task!r}")
    assert dist.is_initialized()
    leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
