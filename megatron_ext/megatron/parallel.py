"""Process-group setup: torch.distributed, megatron-core ``parallel_state`` and RNG seeds."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_ext.config.schema import ParallelConfig
from megatron_ext.megatron.cpu_compat import apply_cpu_compat


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits: global rank/size, data-parallel rank/size, device."""

    rank: int
    world_size: int
    local_rank: int
    dp_rank: int
    dp_size: int
    device: torch.device
    backend: str


def resolve_backend(parallel: ParallelConfig) -> str:
    cuda = torch.cuda.is_available()
    if parallel.backend == "auto":
        return "nccl" if cuda else "gloo"
    if parallel.backend == "nccl" and not cuda:
        raise RuntimeError(
            "parallel.backend=nccl needs CUDA GPUs; this host has none "
            "(use parallel.backend=gloo or auto)"
        )
    return parallel.backend


def init_distributed(parallel: ParallelConfig, seed: int, master_port: int = 29500) -> DistEnv:
    """Initialise torch.distributed from the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``... set by torchrun or exported from MPI/SLURM variables), then
    megatron-core's model-parallel groups and the RNG streams."""
    from megatron_ext.launch.rank_env import detect_rank_env, export_torch_env

    env = detect_rank_env(os.environ)
    export_torch_env(env, os.environ, default_port=master_port)
    apply_cpu_compat()
    backend = resolve_backend(parallel)
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend, rank=env.rank, world_size=env.world_size, timeout=timedelta(minutes=10)
        )
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
        )
    set_seeds(seed)
    return DistEnv(
        rank=env.rank,
        world_size=env.world_size,
        local_rank=env.local_rank,
        dp_rank=parallel_state.get_data_parallel_rank(),
        dp_size=parallel_state.get_data_parallel_world_size(),
        device=device,
        backend=backend,
    )


def set_seeds(seed: int) -> None:
    """Same seed on every data-parallel replica; megatron-core's tracker offsets per TP/EP rank
    (so weights initialise identically across data-parallel ranks)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    seed = seed + 100 * pp_rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_distributed() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
