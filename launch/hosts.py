"""What the launcher learns of its node, without CUDA or torch: the GPUs and CPU cores this
process may use (:class:`HostInfo`, probed once per launch; nvidia-smi is read by
:mod:`megatron_ext.run.nvidia_smi`) and the SLURM step it runs in (:class:`SlurmNodes`)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.errors import ConfigError
from megatron_ext.run.hardware import DeviceDescription, probe_device
from megatron_ext.run.nvidia_smi import count_visible_devices
from megatron_ext.run.rank_env import SLURM_NUM_NODES_VARS, slurm_first_host

__all__ = [
    "HostInfo",
    "SlurmNodes",
    "count_cpus",
    "count_gpus",
    "count_visible_devices",
    "probe_host",
    "slurm_nodes",
]


@dataclass(frozen=True)
class HostInfo:
    """The local hardware the launcher sizes the job for, probed once per launch
    (:func:`probe_host`)."""

    gpus: int
    cpus: int
    gpu_name: str = ""  # as nvidia-smi names the first visible GPU ("" when unknown or no GPU)
    #: the precision gate's view of this machine (GPUs' compute capabilities, CUDA build of
    #: torch, Transformer Engine); the default describes a machine with none of them
    device: DeviceDescription = field(default_factory=DeviceDescription)


def probe_host(
    environ: Mapping[str, str] | None = None,
    *,
    dev_dir: Path = Path("/dev"),
    nvidia_smi: str | None = None,
) -> HostInfo:
    """GPUs and CPU cores available to this process, the GPUs' model and what they can run:
    one ``nvidia-smi`` query (:func:`~megatron_ext.run.hardware.probe_device`) serves the
    count, the name and the precision gate."""
    environ = os.environ if environ is None else environ
    device = probe_device(environ, nvidia_smi)
    gpus = count_gpus(environ, device, dev_dir)
    name = device.names[0] if gpus and device.names else ""
    return HostInfo(gpus=gpus, cpus=count_cpus(), gpu_name=name, device=device)


def count_gpus(
    environ: Mapping[str, str], device: DeviceDescription, dev_dir: Path = Path("/dev")
) -> int:
    """NVIDIA GPUs visible to this process, found without CUDA or torch.

    CUDA_VISIBLE_DEVICES when set (SLURM sets it for the GPUs it allocated), else the
    /dev/nvidiaN device files, else the GPUs nvidia-smi listed (``device``, from
    :func:`probe_host`'s one query).
    """
    if "CUDA_VISIBLE_DEVICES" in environ:
        return count_visible_devices(environ["CUDA_VISIBLE_DEVICES"])
    devices = [p for p in dev_dir.glob("nvidia[0-9]*") if p.name[len("nvidia") :].isdigit()]
    if devices:
        return len(devices)
    return device.gpus


def count_cpus() -> int:
    """Cores this process may run on (respects taskset, cgroups cpusets and srun binding)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class SlurmNodes:
    """The job step this launcher runs in, one launcher per node."""

    nnodes: int
    node_rank: int
    first_host: str
    job_id: str


def slurm_nodes(environ: Mapping[str, str]) -> SlurmNodes | None:
    """The SLURM step's nodes, or None outside a SLURM step (no SLURM_JOB_ID/SLURM_NODEID)."""
    if "SLURM_JOB_ID" not in environ or "SLURM_NODEID" not in environ:
        return None
    nnodes = _first_int(environ, SLURM_NUM_NODES_VARS)
    host = slurm_first_host(environ)
    if nnodes is None or host is None:
        raise ConfigError(
            "SLURM_JOB_ID is set but the node count (SLURM_JOB_NUM_NODES) or the "
            "node list (SLURM_JOB_NODELIST) is missing"
        )
    tasks = _first_int(environ, ("SLURM_STEP_NUM_TASKS",))
    if tasks is not None and tasks != nnodes:
        # torchrun starts the ranks itself: one launcher per node, not one per rank.
        raise ConfigError(
            f"this SLURM step runs {tasks} tasks on {nnodes} node(s); run one "
            "launcher per node (srun --ntasks-per-node=1 megatron-ext launch ...), "
            "or one rank per task with `srun ... megatron-ext train`"
        )
    node_rank = _first_int(environ, ("SLURM_NODEID",))
    return SlurmNodes(nnodes, 0 if node_rank is None else node_rank, host, environ["SLURM_JOB_ID"])


def _first_int(environ: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise ConfigError(f"environment variable {name}={value!r} is not an integer")
            return int(value)
    return None
