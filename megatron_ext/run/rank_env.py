"""Where this process sits in the job, read from whichever launcher started it.

``megatron-ext train`` runs under torchrun (the normal path), but also when the ranks were
started directly by ``mpirun``/``mpiexec`` (Open MPI, MPICH/Hydra, Intel MPI) or by ``srun``.
:func:`detect_rank_env` reads the launcher's variables into one :class:`RankEnv`;
:func:`export_torch_env` then writes the variables that ``torch.distributed``'s ``env://``
initialisation reads (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, ...).

Also here: SLURM's compact host lists (``gpu[001-004,007],cpu01``) and task counts
(``2(x3),1``), expanded in pure Python because ``scontrol`` is not on every compute node or
inside every container.

No torch import: the launcher uses this module (the SLURM lists) before any process starts;
:mod:`megatron_ext.run.distributed` uses the rest on every rank.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Literal

from megatron_ext.errors import ConfigError

RankSource = Literal["torchrun", "mpi", "slurm", "single"]

# Step-scoped variables first: inside `srun` SLURM_NODEID and SLURM_PROCID count within the job
# *step*, which may use fewer nodes than the allocation, so the lists must be the step's too.
SLURM_NODELIST_VARS = ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
SLURM_NUM_NODES_VARS = ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
SLURM_TASKS_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


@dataclass(frozen=True)
class RankEnv:
    """This process's place in the job. ``master_addr``/``master_port`` are None when unset."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str | None
    master_port: int | None
    source: RankSource


def detect_rank_env(environ: Mapping[str, str]) -> RankEnv:
    """Read rank, world size and local rank from torchrun, MPI or SLURM variables.

    The first launcher whose rank and size variables are both set wins, in this order:
    torchrun (it may itself run inside srun or mpirun, and its values are the ones that
    count), Open MPI, MPICH/Hydra/Intel MPI (PMI_*), SLURM's srun. Nothing set: one process.
    SLURM comes last because ``mpirun`` inside an allocation starts its daemons with srun,
    so the ranks also carry SLURM_PROCID values that describe the daemons, not the ranks.
    """
    for read in (_from_torchrun, _from_open_mpi, _from_pmi, _from_slurm):
        env = read(environ)
        if env is not None:
            _check_consistent(env)
            return env
    addr, port = _master(environ)
    return RankEnv(0, 1, 0, 1, addr, port, "single")


def export_torch_env(
    env: RankEnv, environ: MutableMapping[str, str], *, default_port: int = 29500
) -> None:
    """Set the variables ``torch.distributed.init_process_group("env://")`` reads.

    MASTER_ADDR (the host of rank 0, which serves the rendezvous store) is, in order: the
    existing MASTER_ADDR; the first host of the SLURM node list (srun and mpirun place rank 0
    there by default); 127.0.0.1 when every rank is on this host. Ranks spread over several
    hosts with none of these known is an error, since guessing would hang every other host.
    MASTER_PORT is the existing one or ``default_port`` (the recipe's ``launch.master_port``).
    """
    addr = env.master_addr or slurm_first_host(environ)
    if addr is None:
        if env.world_size != env.local_world_size:
            raise ConfigError(
                f"cannot tell which host runs rank 0: the {env.world_size} ranks span several "
                f"hosts ({env.local_world_size} on this one, started by {env.source}) and "
                "MASTER_ADDR is not set; export MASTER_ADDR=<rank 0's host> to every rank "
                "(e.g. mpirun -x MASTER_ADDR=node01, mpiexec -genv MASTER_ADDR node01)"
            )
        addr = "127.0.0.1"
    environ.update(
        {
            "RANK": str(env.rank),
            "WORLD_SIZE": str(env.world_size),
            "LOCAL_RANK": str(env.local_rank),
            "LOCAL_WORLD_SIZE": str(env.local_world_size),
            "MASTER_ADDR": addr,
            "MASTER_PORT": str(env.master_port or default_port),
        }
    )


# --------------------------------------------------------------------------- launchers


def _from_torchrun(environ: Mapping[str, str]) -> RankEnv | None:
    if "RANK" not in environ or "WORLD_SIZE" not in environ:
        return None
    return _rank_env(
        environ,
        "torchrun",
        rank=("RANK",),
        size=("WORLD_SIZE",),
        local_rank=("LOCAL_RANK",),
        local_size=("LOCAL_WORLD_SIZE",),
    )


def _from_open_mpi(environ: Mapping[str, str]) -> RankEnv | None:
    if "OMPI_COMM_WORLD_RANK" not in environ or "OMPI_COMM_WORLD_SIZE" not in environ:
        return None
    return _rank_env(
        environ,
        "mpi",
        rank=("OMPI_COMM_WORLD_RANK",),
        size=("OMPI_COMM_WORLD_SIZE",),
        local_rank=("OMPI_COMM_WORLD_LOCAL_RANK",),
        local_size=("OMPI_COMM_WORLD_LOCAL_SIZE",),
    )


def _from_pmi(environ: Mapping[str, str]) -> RankEnv | None:
    """MPICH's Hydra (and Intel MPI, built on it) set MPI_LOCAL*; PMIx-style PMI_LOCAL_*."""
    if "PMI_RANK" not in environ or "PMI_SIZE" not in environ:
        return None
    return _rank_env(
        environ,
        "mpi",
        rank=("PMI_RANK",),
        size=("PMI_SIZE",),
        local_rank=("MPI_LOCALRANKID", "PMI_LOCAL_RANK"),
        local_size=("MPI_LOCALNRANKS", "PMI_LOCAL_SIZE"),
    )


def _from_slurm(environ: Mapping[str, str]) -> RankEnv | None:
    if "SLURM_PROCID" not in environ or "SLURM_NTASKS" not in environ:
        return None
    rank = _int_var(environ, ("SLURM_PROCID",))
    size = _int_var(environ, ("SLURM_NTASKS",))
    local_rank = _int_var(environ, ("SLURM_LOCALID",))
    addr, port = _master(environ)
    return RankEnv(rank, size, local_rank, _slurm_local_size(environ), addr, port, "slurm")


def _rank_env(
    environ: Mapping[str, str],
    source: RankSource,
    *,
    rank: tuple[str, ...],
    size: tuple[str, ...],
    local_rank: tuple[str, ...],
    local_size: tuple[str, ...],
) -> RankEnv:
    addr, port = _master(environ)
    return RankEnv(
        _int_var(environ, rank),
        _int_var(environ, size),
        _int_var(environ, local_rank),
        _int_var(environ, local_size),
        addr,
        port,
        source,
    )


def _slurm_local_size(environ: Mapping[str, str]) -> int:
    """Tasks on this node: this node's entry of the per-node task counts."""
    for var in SLURM_TASKS_PER_NODE_VARS:
        if var in environ:
            counts = expand_tasks_per_node(environ[var])
            node = _int_var(environ, ("SLURM_NODEID",))
            if node >= len(counts):
                raise ConfigError(
                    f"SLURM_NODEID={node} but {var}={environ[var]!r} lists "
                    f"only {len(counts)} node(s)"
                )
            return counts[node]
    return _int_var(environ, ("SLURM_NTASKS_PER_NODE",))


def _master(environ: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = environ.get("MASTER_ADDR") or None
    port = _int_var(environ, ("MASTER_PORT",)) if environ.get("MASTER_PORT") else None
    return addr, port


def _int_var(environ: Mapping[str, str], names: tuple[str, ...]) -> int:
    """The first of ``names`` that is set, as a non-negative int."""
    for name in names:
        if name in environ:
            value = environ[name].strip()
            if not value.isdigit():
                raise ConfigError(
                    f"environment variable {name}={environ[name]!r} is not a non-negative integer"
                )
            return int(value)
    raise ConfigError(
        f"environment variable {' or '.join(names)} is not set (the launcher "
        "that started this process set the rank but not this)"
    )


def _check_consistent(env: RankEnv) -> None:
    if not (
        0 <= env.rank < env.world_size
        and 0 <= env.local_rank < env.local_world_size
        and env.local_world_size <= env.world_size
    ):
        raise ConfigError(
            f"inconsistent {env.source} environment: rank {env.rank} of {env.world_size}, "
            f"local rank {env.local_rank} of {env.local_world_size}"
        )


# --------------------------------------------------------------------------- SLURM lists


def slurm_first_host(environ: Mapping[str, str]) -> str | None:
    """First host of this SLURM step's (else job's) node list; None outside SLURM."""
    for var in SLURM_NODELIST_VARS:
        if environ.get(var):
            return expand_nodelist(environ[var])[0]
    return None


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compact host list, in order.

    ``gpu[001-003,007],cpu01`` -> gpu001 gpu002 gpu003 gpu007 cpu01. A range keeps the width of
    its lower bound (``[08-10]`` -> 08 09 10); several bracket groups in one name expand as a
    product (``r[1-2]n[1-2]`` -> r1n1 r1n2 r2n1 r2n2).
    """
    hosts = [host for item in _split_outside_brackets(nodelist) for host in _expand_item(item)]
    if not hosts:
        raise ConfigError(f"empty SLURM node list {nodelist!r}")
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's per-node task counts: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for item in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if m is None:
            raise ConfigError(f"cannot parse SLURM tasks-per-node {spec!r} (item {item!r})")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def _split_outside_brackets(text: str) -> list[str]:
    """Split on commas that are not inside ``[...]``."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth not in (0, 1):
            raise ConfigError(f"unbalanced brackets in SLURM node list {text!r}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"unbalanced brackets in SLURM node list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str) -> list[str]:
    pieces = [p for p in re.split(r"(\[[^\]]*\])", item) if p]
    options = [_expand_ranges(p[1:-1], item) if p.startswith("[") else [p] for p in pieces]
    return ["".join(parts) for parts in itertools.product(*options)]


def _expand_ranges(ranges: str, item: str) -> list[str]:
    """``001-003,007`` -> 001 002 003 007."""
    out = []
    for part in ranges.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if m is None or (m[2] is not None and int(m[2]) < int(m[1])):
            raise ConfigError(f"cannot parse range {part!r} in SLURM node list item {item!r}")
        lo, hi = m[1], m[2] or m[1]
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out
