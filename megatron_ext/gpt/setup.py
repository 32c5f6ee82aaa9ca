"""Everything the GPT loop needs, built once: process groups, data, model + DDP, optimizer,
schedule (:func:`setup` -> :class:`GPTRun`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from megatron_ext.data import build_gpt_datasets, build_indexed_dataset, build_tokenizer
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.flops import gpt_train_flops_per_token
from megatron_ext.gpt.moe_load import ExpertLoad
from megatron_ext.gpt.recipe import GPTRecipe
from megatron_ext.megatron.ddp import DistributedDataParallel
from megatron_ext.megatron.model import build_gpt_chunks, half_precision_module
from megatron_ext.megatron.optimizer import MegatronExtOptimizer
from megatron_ext.megatron.optimizer_factories import (
    chunk_named_parameters,
    chunk_root,
    chunked_factory,
    inner_factory,
    megatron_optimizer_config,
    model_qkv_layout,
)
from megatron_ext.megatron.parallel import init_distributed
from megatron_ext.run.distributed import DistEnv
from megatron_ext.schedules.plan import TrainingSchedule, training_schedule

__all__ = ["GPTRun", "build_data", "ensure_dataset", "setup"]


@dataclass
class GPTRun:
    """Everything the loop needs. ``dp_rank``/``dp_size``: this rank's place in the
    data-parallel group (megatron-core's ``parallel_state``, read once here); ``schedule``:
    every step's batch, consumed tokens and LR; ``num_microbatches``: per rank, of the target
    batch (validation; a training step's count is its stage's)."""

    recipe: GPTRecipe
    env: DistEnv
    dp_rank: int
    dp_size: int
    #: this pipeline rank's model chunks (one per virtual pipeline stage; one without them),
    #: each in megatron-core's DDP
    chunks: list[DistributedDataParallel]
    optimizer: MegatronExtOptimizer
    schedule: TrainingSchedule
    train_data: Any
    valid_data: Any  # None without validation (training.eval_iters = 0)
    num_microbatches: int
    flops_per_token: float  # training FLOPs per token (gpt.flops)
    run_dir: Path
    expert_load: ExpertLoad | None = None  # MoE models: tokens per expert, router losses
    start_step: int = 0
    startup_s: dict[str, float] | None = None  # launch command -> first step (run.startup)


def setup(recipe: GPTRecipe) -> GPTRun:
    """Join the process groups and build data, model, optimizer and schedule (the recipe was
    checked at this world size by the entry point)."""
    env = init_distributed(
        recipe.parallel,
        recipe.seed,
        recipe.launch.master_port,
        recipe.launch.collective_timeout_s,
    )
    t = recipe.training
    dp_size = parallel_state.get_data_parallel_world_size()
    schedule = training_schedule(recipe.training, recipe.optimizer)

    tokenizer = build_tokenizer(
        recipe.data.tokenizer, recipe.data.tokenizer_model, recipe.model.vocab_size
    )
    ensure_dataset(recipe, tokenizer, env)
    train_data, valid_data = build_data(recipe, tokenizer, schedule)

    modules = build_gpt_chunks(
        recipe.model,
        recipe.parallel,
        t.precision,
        vocab_size=tokenizer.vocab_size,
        seq_length=t.seq_length,
        bf16_layers=(t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16),
        fp8_format=t.fp8_format,
        params_dtype=t.params_dtype,
    )
    config = modules[0].config  # one TransformerConfig, shared by the chunks
    chunks = [
        DistributedDataParallel(
            config,
            DistributedDataParallelConfig(
                grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
            ),
            half_precision_module(module),  # bf16, fp16, FP8/FP4: megatron-core's Float16Module
            # as Megatron-LM's get_model: one bucket for every chunk after the first
            disable_bucketing=index > 0,
        )
        for index, module in enumerate(modules)
    ]
    # megatron-core's schedule finalises grads (DP all-reduce, MoE expert-bias update) via this.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync

    optimizer = MegatronExtOptimizer(
        chunk_named_parameters(modules),  # the GPTModels' names, inside any wrapper
        chunked_factory(inner_factory(recipe.optimizer, model_qkv_layout(config)), len(modules)),
        megatron_optimizer_config(recipe.optimizer, config.bf16, config.fp16),
    )
    if optimizer.loss_scale is not None:  # fp16: the schedule scales each loss before backward
        config.grad_scale_func = optimizer.scale_loss
    optimizer.overlap_param_sync_with_forward(chunk_root(modules))
    optimizer.take_over_grad_sync(chunks)  # layer-wise: reduce-scatter-v instead of all-reduce

    flops = gpt_train_flops_per_token(
        recipe.model,
        t.seq_length,
        modules[0].vocab_size,
        config.ffn_hidden_size,
        config.kv_channels,
    )
    return GPTRun(
        recipe=recipe,
        env=env,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=dp_size,
        chunks=chunks,
        optimizer=optimizer,
        schedule=schedule,
        train_data=train_data,
        valid_data=valid_data if t.eval_iters else None,
        num_microbatches=schedule.target_batch // (t.micro_batch_size * dp_size),
        flops_per_token=flops,
        run_dir=Path(recipe.run_dir),
        expert_load=(
            ExpertLoad(torch.nn.ModuleList(modules), config) if config.num_moe_experts else None
        ),
    )


def build_data(recipe: GPTRecipe, tokenizer: Any, schedule: TrainingSchedule) -> tuple[Any, Any]:
    """The training and validation splits of ``data.path`` (megatron-core GPT datasets, sized
    for ``schedule``'s samples): sample ``i`` is a dict of (seq_length,) arrays ``tokens``,
    ``labels``, ``loss_mask``, ``position_ids``. The validation split is None without one."""
    t = recipe.training
    valid_samples = t.eval_iters * schedule.target_batch if t.eval_iters else None
    train_data, valid_data, _ = build_gpt_datasets(
        recipe.data.path,
        tokenizer,
        seq_length=t.seq_length,
        split=recipe.data.split,
        seed=recipe.seed,
        num_samples=(schedule.samples_before(schedule.steps), valid_samples, None),
    )
    if t.eval_iters and valid_data is None:
        raise ConfigError(
            f"training.eval_iters={t.eval_iters} needs a validation split, but data.split="
            f"{recipe.data.split!r} gives it no documents: e.g. data.split=98,2,0"
        )
    return train_data, valid_data


def ensure_dataset(recipe: GPTRecipe, tokenizer: Any, env: DistEnv) -> None:
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
