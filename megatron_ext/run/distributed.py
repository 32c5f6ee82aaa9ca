"""Process groups for every trainer: torch.distributed from the rank environment, and teardown.

:func:`init_process_group` reads where this process sits (:mod:`megatron_ext.run.rank_env`:
torchrun, Open MPI, MPICH or SLURM variables), exports what ``env://`` reads, picks the device
and the backend and joins the default group. Trainers call it first; a second call returns the
group already joined, so a trainer runs the same under ``megatron-ext train`` and when a test
calls it in-process. Layers built on top (megatron-core's model-parallel groups) register their
own teardown with :func:`on_teardown`; :func:`destroy_process_groups` runs it, newest first, and
then leaves the default group.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch
import torch.distributed as dist

from megatron_ext.errors import ConfigError
from megatron_ext.run.peers import gather_peers
from megatron_ext.run.rank_env import detect_rank_env, export_torch_env

__all__ = ["DistEnv", "destroy_process_groups", "init_process_group", "on_teardown"]

Backend = Literal["auto", "nccl", "gloo"]
Device = Literal["auto", "cpu"]

_TEARDOWN: list[Callable[[], None]] = []


@dataclass(frozen=True)
class DistEnv:
    """This process in the job: global rank and size, the device it computes on, and the
    backend of its default group (None: a single process that joined no group)."""

    rank: int
    world_size: int
    device: torch.device
    backend: str | None


def resolve_backend(backend: Backend) -> str:
    """``auto`` = NCCL with CUDA, gloo without; NCCL without CUDA is the user's mistake."""
    cuda = torch.cuda.is_available()
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise ConfigError(
            "parallel.backend=nccl needs CUDA GPUs; this host has none "
            "(use parallel.backend=gloo or auto)"
        )
    return backend


def init_process_group(
    backend: Backend = "auto",
    *,
    master_port: int,
    timeout: timedelta,
    device: Device = "auto",
    single_rank_group: bool = True,
) -> DistEnv:
    """Join torch.distributed's default group from the environment (idempotent).

    ``device``: ``auto`` = this rank's local GPU when CUDA is present (made current), else the
    CPU; ``cpu`` = always the CPU. ``master_port``: the recipe's ``launch.master_port``, used when
    MASTER_PORT is unset (mpirun, srun); a single process without MASTER_PORT needs none (an
    in-memory store). ``single_rank_group=False`` skips the group when the job
    is one process (a trainer that never communicates then needs no rendezvous port).
    """
    if dist.is_initialized():
        # joined before: the device made current then is this rank's
        current = torch.cuda.current_device() if torch.cuda.is_available() else 0
        where = _device(device, current)
        return DistEnv(dist.get_rank(), dist.get_world_size(), where, dist.get_backend())
    env = detect_rank_env(os.environ)
    where = _device(device, env.local_rank)
    if env.world_size == 1 and not single_rank_group:
        return DistEnv(0, 1, where, None)
    resolved = resolve_backend(backend)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if env.world_size == 1 and "MASTER_PORT" not in os.environ:
        # One process that no launcher gave a rendezvous: an in-memory store, so there is no
        # port to choose (independent single-process workers on one host cannot collide).
        dist.init_process_group(
            backend=resolved, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
        return DistEnv(0, 1, where, resolved)
    export_torch_env(env, os.environ, default_port=master_port)
    dist.init_process_group(
        backend=resolved, rank=env.rank, world_size=env.world_size, timeout=timeout
    )
    # where every rank runs, so that a lost peer can be named (run.peers)
    gather_peers(dist, env.rank, env.world_size, timeout.total_seconds())
    return DistEnv(env.rank, env.world_size, where, resolved)


def _device(device: Device, local_rank: int) -> torch.device:
    if device == "auto" and torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def on_teardown(fn: Callable[[], None]) -> None:
    """Run ``fn`` in :func:`destroy_process_groups`, before the default group is left (for
    groups built on top of it, e.g. megatron-core's ``parallel_state``)."""
    _TEARDOWN.append(fn)


def destroy_process_groups() -> None:
    """Tear down what was registered (newest first), then leave the default group."""
    while _TEARDOWN:
        _TEARDOWN.pop()()
    if dist.is_initialized():
        dist.destroy_process_group()
