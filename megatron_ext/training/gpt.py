"""The GPT trainer: megatron-core GPTModel + DDP + megatron-ext's optimizer adapter.

Read top to bottom: set up (process groups, data, model, optimizer, schedule, resume), then the
loop -- data -> forward/backward through megatron-core's schedule -> clip -> optimizer step ->
LR -> log -> checkpoint.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ext.config.schema import Recipe
from megatron_ext.data import build_gpt_datasets, build_indexed_dataset, build_tokenizer
from megatron_ext.megatron.ddp import DistributedDataParallel
from megatron_ext.megatron.model import build_gpt_model
from megatron_ext.megatron.optimizer import MegatronExtOptimizer
from megatron_ext.megatron.optimizer_factories import inner_factory, megatron_optimizer_config
from megatron_ext.megatron.parallel import DistEnv, init_distributed
from megatron_ext.schedules.lr import LRSchedule
from megatron_ext.training import checkpoint as ckpt
from megatron_ext.training.metrics import (
    MetricsLogger,
    gpt_train_flops_per_token,
    plot_loss,
    write_json_atomic,
)


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or inf; nothing of that state is checkpointed."""


@dataclass
class GPTRun:
    """Everything the loop needs, built once by :func:`setup`."""

    recipe: Recipe
    env: DistEnv
    model: DistributedDataParallel
    optimizer: MegatronExtOptimizer
    schedule: LRSchedule
    train_data: Any
    num_microbatches: int
    flops_per_token: float
    run_dir: Path
    start_step: int = 0


def setup(recipe: Recipe) -> GPTRun:
    env = init_distributed(recipe.parallel, recipe.training.seed, recipe.launch.master_port)
    recipe.check(env.world_size)
    t, run_dir = recipe.training, Path(recipe.run_dir)

    tokenizer = build_tokenizer(recipe.data.tokenizer, recipe.data.tokenizer_model)
    ensure_dataset(recipe, tokenizer, env)
    train_data, _, _ = build_gpt_datasets(
        recipe.data.path,
        tokenizer,
        seq_length=t.seq_length,
        split=recipe.data.split,
        seed=t.seed,
        num_samples=(t.steps * t.global_batch_size, None, None),
    )

    module = build_gpt_model(
        recipe.model,
        recipe.parallel,
        t.precision,
        vocab_size=tokenizer.vocab_size,
        seq_length=t.seq_length,
    )
    config = module.config
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        module,
    )
    # megatron-core's schedule finalises grads (DP all-reduce, MoE expert-bias update) via this.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync

    bf16 = t.precision == "bf16"
    optimizer = MegatronExtOptimizer(
        list(model.module.named_parameters()),
        inner_factory(recipe.optimizer),
        megatron_optimizer_config(recipe.optimizer, bf16),
    )
    optimizer.overlap_param_sync_with_forward(model.module)
    optimizer.take_over_grad_sync(model)  # layer-wise: reduce-scatter-v instead of all-reduce

    dp = env.world_size // recipe.model_parallel_size()
    flops = gpt_train_flops_per_token(
        recipe.model, t.seq_length, module.vocab_size, config.ffn_hidden_size, config.kv_channels
    )
    return GPTRun(
        recipe=recipe,
        env=env,
        model=model,
        optimizer=optimizer,
        schedule=recipe.lr_schedule(),
        train_data=train_data,
        num_microbatches=t.global_batch_size // (t.micro_batch_size * dp),
        flops_per_token=flops,
        run_dir=run_dir,
    )


def ensure_dataset(recipe: Recipe, tokenizer: Any, env: DistEnv) -> None:
    """Build ``data.path`` from ``data.source`` on rank 0 when it does not exist yet.

    Rank 0's outcome is shared with every rank, so a failed build stops all of them (with rank
    0's message) instead of leaving the others waiting at a barrier.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    prefix = recipe.data.path
    if not recipe.data.source:
        return
    # Only rank 0 looks at the files: other ranks checking too could see the dataset appear
    # half-way and skip the collective below.
    error: Exception | None = None
    if env.rank == 0 and not IndexedDataset.exists(prefix):
        try:
            Path(prefix).parent.mkdir(parents=True, exist_ok=True)
            stats = build_indexed_dataset(recipe.data.source, prefix, tokenizer)
            print(
                f"built {prefix}: {stats.documents:,} documents, {stats.tokens:,} tokens "
                f"in {stats.seconds:.1f} s",
                flush=True,
            )
        except Exception as exc:  # re-raised below, after telling the other ranks
            error = exc
    ok = torch.tensor([0.0 if error else 1.0], device=env.device)
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if error is not None:
        raise error
    if not ok.item():
        raise RuntimeError(f"rank 0 failed to build the dataset {prefix} (see its message)")


def resume(run: GPTRun) -> None:
    """Load ``checkpoint.load`` ('auto' = the run's newest checkpoint, if any)."""
    choice = run.recipe.checkpoint.load
    if choice == "none":
        return
    path = ckpt.latest_checkpoint(run.run_dir / "checkpoints") if choice == "auto" else Path(choice)
    if path is None:
        return
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint.load={choice!r}: no such checkpoint directory")
    loop = ckpt.load_checkpoint(path, run.model, run.optimizer)
    run.start_step = int(loop["step"])


def microbatches(run: GPTRun, step: int) -> Iterator[dict[str, torch.Tensor]]:
    """This rank's micro-batches of global batch ``step``: sample ``i`` of the global batch is
    ``train_data[step * gbs + i]``; data-parallel rank r takes the r-th contiguous slice."""
    t = run.recipe.training
    dp = parallel_state.get_data_parallel_world_size()
    per_rank = t.global_batch_size // dp
    first = step * t.global_batch_size + parallel_state.get_data_parallel_rank() * per_rank
    for m in range(run.num_microbatches):
        start = first + m * t.micro_batch_size
        samples = [run.train_data[start + i] for i in range(t.micro_batch_size)]
        yield {
            key: torch.stack([torch.as_tensor(s[key]) for s in samples]).to(run.env.device)
            for key in ("tokens", "labels", "loss_mask", "position_ids")
        }


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module):
    """One micro-batch forward: per-token losses [b, s] and the masked-mean loss function."""
    batch = next(data_iterator)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()

    def loss_func(output: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = (output.float() * mask).sum() / mask.sum().clamp(min=1.0)
        # clone: the schedule divides the returned loss by the micro-batch count in place
        return loss, {"lm loss": loss.detach().clone()}

    return losses, loss_func


def train_step(run: GPTRun, step: int) -> tuple[float, float, bool]:
    """One optimizer step; returns (mean loss over the global batch, grad norm, success)."""
    run.model.zero_grad_buffer()
    run.optimizer.zero_grad()
    t = run.recipe.training
    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=microbatches(run, step),
        model=[run.model],
        num_microbatches=run.num_microbatches,
        seq_length=t.seq_length,
        micro_batch_size=t.micro_batch_size,
        forward_only=False,
    )
    lr = run.schedule.lr_at(step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    success, grad_norm, _ = run.optimizer.step()
    loss = torch.zeros(1, dtype=torch.float64, device=run.env.device)
    if parallel_state.is_pipeline_last_stage():
        loss += sum(float(o["lm loss"]) for o in outputs) / run.num_microbatches
    # Mean over data-parallel replicas; the last pipeline stage holds it, broadcast to the rest.
    dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
    loss /= parallel_state.get_data_parallel_world_size()
    dist.all_reduce(loss, group=parallel_state.get_pipeline_model_parallel_group())
    return float(loss), float(grad_norm), success


def train(run: GPTRun) -> dict[str, Any]:
    """The loop. Returns the run summary (also written to ``run_dir/summary.json``)."""
    recipe, t = run.recipe, run.recipe.training
    rank0 = run.env.rank == 0
    if run.start_step >= t.steps:
        if rank0:
            print(
                f"{run.run_dir}: already trained to step {run.start_step} of {t.steps}; "
                f"raise training.steps to continue, or delete {run.run_dir} to start over",
                flush=True,
            )
        return {}
    tokens_per_step = t.global_batch_size * t.seq_length
    log = MetricsLogger(
        run.run_dir,
        t.steps,
        run.env.world_size,
        run.flops_per_token,
        enabled=rank0,
        tensorboard=recipe.logging.tensorboard,
        progress_bar=recipe.logging.progress_bar,
        log_interval=recipe.logging.log_interval,
        start_step=run.start_step,
    )
    log.info(
        f"megatron-ext gpt | world {run.env.world_size} ({run.env.backend}) | "
        f"params {sum(p.numel() for p in run.model.parameters()):,} | "
        f"optimizer {recipe.optimizer.name} | steps {run.start_step}->{t.steps}"
    )
    ckpt_dir = run.run_dir / "checkpoints"
    save_every = recipe.checkpoint.save_interval
    try:
        for step in range(run.start_step, t.steps):
            t0 = time.perf_counter()
            loss, grad_norm, success = train_step(run, step)
            if not math.isfinite(loss) or not success:
                raise NonFiniteLossError(
                    f"step {step + 1}: training loss is {loss} (grad norm {grad_norm}); "
                    f"stopping without checkpointing this state. Lower optimizer.lr, enable "
                    f"optimizer.clip_grad, or resume from {ckpt_dir}"
                )
            done = step + 1
            log.record(
                done,
                done * tokens_per_step,
                t.global_batch_size,
                run.schedule.lr_at(step),
                loss,
                grad_norm,
                time.perf_counter() - t0,
                tokens_per_step,
            )
            if (save_every and done % save_every == 0) or (
                done == t.steps and recipe.checkpoint.save_at_end
            ):
                ckpt.save_checkpoint(
                    ckpt_dir,
                    done,
                    run.model,
                    run.optimizer,
                    {"step": done, "consumed_samples": done * t.global_batch_size},
                    recipe.checkpoint.keep_last,
                )
    finally:
        log.close()
    return summarize(run, log)


def summarize(run: GPTRun, log: MetricsLogger) -> dict[str, Any]:
    recs = log.records
    # Throughput over steady-state steps (the first includes start-up work).
    timed = recs[1:] or recs
    tokens = sum(r.tokens_per_s * r.step_time_s for r in timed)
    seconds = sum(r.step_time_s for r in timed)
    summary = {
        "trainer": "gpt",
        "steps": run.recipe.training.steps,
        "start_step": run.start_step,
        "world_size": run.env.world_size,
        "backend": run.env.backend,
        "parameters": sum(p.numel() for p in run.model.parameters()),
        "optimizer": run.recipe.optimizer.name,
        "precision": run.recipe.training.precision,
        "first_loss": recs[0].loss if recs else None,
        "last_loss": recs[-1].loss if recs else None,
        "losses": [r.loss for r in recs],
        "tokens_per_s": tokens / seconds if seconds else None,
        "tokens_per_s_per_rank": tokens / seconds / run.env.world_size if seconds else None,
        "tflops_per_rank": (
            tokens / seconds / run.env.world_size * run.flops_per_token / 1e12 if seconds else None
        ),
        "elapsed_s": recs[-1].elapsed_s if recs else 0.0,
        # rank 0's gradient reduce-scatter payload this run (layer-wise optimizer only)
        "grad_sync_bytes": run.optimizer.grad_sync_bytes(),
    }
    if run.env.rank == 0:
        write_json_atomic(run.run_dir / "summary.json", summary)
        metrics = run.run_dir / "metrics.jsonl"
        if metrics.is_file():
            plot_loss(metrics, run.run_dir / "loss.png")
    return summary


def train_gpt(recipe: Recipe) -> dict[str, Any]:
    run = setup(recipe)
    resume(run)
    return train(run)
