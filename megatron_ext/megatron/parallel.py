"""megatron-core's model-parallel groups and RNG streams, on top of the run layer's default group.

torch.distributed itself (rank environment, backend, device) is joined by
:func:`megatron_ext.run.distributed.init_process_group`; this module adds what megatron-core needs
on top: its CPU compatibility, ``parallel_state``'s tensor/pipeline/context/expert groups and the
seeds of its RNG tracker. Teardown is registered with the run layer.
"""

from __future__ import annotations

import random
from datetime import timedelta
from typing import TYPE_CHECKING

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_ext.megatron.cpu_compat import apply_cpu_compat
from megatron_ext.run.distributed import DistEnv, init_process_group, on_teardown

if TYPE_CHECKING:  # the recipe sections this module reads (never builds)
    from megatron_ext.megatron.sections import ParallelConfig

# A slow rank (dataset build, checkpoint write) must not time the others out.
TIMEOUT = timedelta(minutes=10)


def init_distributed(
    parallel: ParallelConfig, seed: int, master_port: int = 29500, collective_timeout_s: float = 0
) -> DistEnv:
    """The default group (``parallel.backend``; this rank's GPU when CUDA is present), then
    megatron-core's model-parallel groups and the RNG streams. ``collective_timeout_s``: how long
    a collective waits for a peer (the recipe's ``launch.collective_timeout_s``; 0 = 600 s)."""
    timeout = timedelta(seconds=collective_timeout_s) if collective_timeout_s else TIMEOUT
    env = init_process_group(parallel.backend, master_port=master_port, timeout=timeout)
    apply_cpu_compat()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_model_parallel_size,
            pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
            context_parallel_size=parallel.context_parallel_size,
            expert_model_parallel_size=parallel.expert_model_parallel_size,
            # its groups' own timeout (default 30 min): the data-parallel collectives run on
            # them, so a lost peer would otherwise hold a survivor that long
            distributed_timeout_minutes=timeout.total_seconds() / 60,
        )
        on_teardown(parallel_state.destroy_model_parallel)
    set_seeds(seed)
    return env


def set_seeds(seed: int) -> None:
    """Same seed on every data-parallel replica; megatron-core's tracker offsets per TP/EP rank
    (so weights initialise identically across data-parallel ranks)."""
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    seed = seed + 100 * pp_rank
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
