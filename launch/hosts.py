"""What the launcher learns of its node, without CUDA or torch: the GPUs and CPU cores this
process may use (:class:`HostInfo`) and the SLURM step it runs in (:class:`SlurmNodes`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.errors import ConfigError
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
    """The local hardware the launcher sizes the job for."""

    gpus: int
    cpus: int
    gpu_name: str = ""  # as nvidia-smi names GPU 0 ("" when unknown or no GPU)


def probe_host(environ: Mapping[str, str] | None = None) -> HostInfo:
    """GPUs and CPU cores available to this process, and the GPUs' model."""
    environ = os.environ if environ is None else environ
    gpus = count_gpus(environ)
    return HostInfo(gpus=gpus, cpus=count_cpus(), gpu_name=gpu_name() if gpus else "")


def gpu_name(nvidia_smi: str | None = None) -> str:
    """GPU 0's name from ``nvidia-smi --query-gpu=name`` ("" when it cannot say)."""
    smi = nvidia_smi or shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        out = subprocess.run(
            [smi, "--query-gpu=name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return ""
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    return lines[0] if lines else ""


def count_gpus(
    environ: Mapping[str, str], dev_dir: Path = Path("/dev"), nvidia_smi: str | None = None
) -> int:
    """NVIDIA GPUs visible to this process, found without CUDA or torch.

    CUDA_VISIBLE_DEVICES when set (SLURM sets it for the GPUs it allocated), else the
    /dev/nvidiaN device files, else ``nvidia-smi -L`` (``nvidia_smi`` overrides its path).
    """
    if "CUDA_VISIBLE_DEVICES" in environ:
        return count_visible_devices(environ["CUDA_VISIBLE_DEVICES"])
    devices = [p for p in dev_dir.glob("nvidia[0-9]*") if p.name[len("nvidia") :].isdigit()]
    if devices:
        return len(devices)
    smi = nvidia_smi or shutil.which("nvidia-smi")
    if smi is None:
        return 0
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0  # a broken driver install counts as no GPU; the CPU path still works
    return sum(line.startswith("GPU ") for line in out.splitlines())


def count_visible_devices(value: str) -> int:
    """Devices named by CUDA_VISIBLE_DEVICES.

    Like CUDA, count up to the first entry that is not a device (an index >= 0 or a GPU/MIG
    UUID): ``""``, ``-1`` and SLURM's ``NoDevFiles`` hide every GPU; ``0,1,-1,2`` shows two.
    """
    count = 0
    for item in value.split(","):
        item = item.strip()
        if not (item.isdigit() or item.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return count


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
