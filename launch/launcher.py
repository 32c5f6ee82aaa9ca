"""``megatron-ext launch``: validate a recipe, then run it on every rank with torchrun.

The layout comes from one of three places, flags winning over SLURM field by field:

* one node: ``torchrun --standalone --nproc-per-node N`` (rendezvous on a free local port);
* flags: ``--nnodes``, ``--node-rank``, ``--rdzv-endpoint HOST:PORT`` (c10d rendezvous);
* SLURM (inside ``srun --ntasks-per-node=1``, one launcher per node): node count, node id,
  the first host of the node list at ``launch.master_port`` as the rendezvous, the job id as
  the rendezvous id.

The recipe is validated at the resulting world size *before* anything starts, so a layout that
does not fit fails here with one message instead of on N ranks after the rendezvous.

:func:`validate_launch` is the whole decision, free of side effects (it reads the recipe, nothing
else): a request, an environment mapping and a :class:`HostInfo` in, a :class:`ValidatedLaunch`
out; :func:`launch_command` turns it into ``(argv, env)``. :func:`launch_main` probes the host
once (:mod:`.hosts`), reads the recipe and resolves the layout once (:func:`validate_launch`),
and hands the result to the rest: it prints (``--dry-run``, :mod:`.dry_run`) or checks this node
(:mod:`.preflight`: the dataset, the run directory, the rendezvous port, free disk) and runs the
command (:mod:`.supervise`: stop signals to the ranks, their errors reported once).

This module never imports torch: it must work, and fail clearly, before any rank exists.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from megatron_ext.config.load import read_recipe
from megatron_ext.config.schema import LaunchConfig, Recipe
from megatron_ext.errors import ConfigError
from megatron_ext.launch.dry_run import describe_job, format_dry_run
from megatron_ext.launch.fit import check_fit, job_plan
from megatron_ext.launch.hosts import HostInfo, probe_host, slurm_nodes
from megatron_ext.launch.preflight import check_before_launch
from megatron_ext.launch.supervise import run_ranks
from megatron_ext.planner.report import format_plan
from megatron_ext.run.hardware import check_precision_before_launch
from megatron_ext.run.startup import LAUNCHED_AT_VAR, process_start_time
from megatron_ext.run.stopping import LAUNCH_COMMAND_VAR

if TYPE_CHECKING:
    from megatron_ext.gpt.sections import ParallelConfig

# Each rank runs the CLI's per-rank entry point with the launcher's own interpreter, so the
# ranks see exactly the packages the launcher saw (no dependence on PATH or console scripts).
RANK_ENTRY = ("-m", "megatron_ext.launch.cli", "train")
DEFAULT_RDZV_ID = "megatron-ext"
# torchrun's c10d rendezvous (torch >= 2.4) by default hands its ranks one TCP store for the
# whole job (the first node's agent hosts it; the ranks join it unprefixed as MASTER_PORT). A
# restarted worker group then finds the previous round's keys in it: gloo's full-mesh connect
# reads the dead ranks' addresses ("Connection refused", then "Connect timeout") and no
# restart ever trains. With sharing off, rank 0 of every round hosts a new store on a port the
# round publishes, so a restart starts clean (pytorch/pytorch#135712; still so in torch 2.9).
# Only with elastic restarts (launch.max_restarts): without them a job has one round.
FRESH_STORE_PER_ROUND = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass(frozen=True)
class LaunchRequest:
    """What the user asked for on the command line; None = not given."""

    recipe: str
    overrides: tuple[str, ...] = ()
    nproc_per_node: int | None = None
    nnodes: int | None = None
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None

    def argv(self) -> list[str]:
        """The ``megatron-ext launch`` arguments that ask for this again."""
        flags = {
            "--nproc-per-node": self.nproc_per_node,
            "--nnodes": self.nnodes,
            "--node-rank": self.node_rank,
            "--rdzv-endpoint": self.rdzv_endpoint,
            "--rdzv-id": self.rdzv_id,
        }
        given = [x for flag, v in flags.items() if v is not None for x in (flag, str(v))]
        return [self.recipe, *self.overrides, *given]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LaunchRequest:
        return cls(
            recipe=args.recipe,
            overrides=tuple(args.overrides),
            nproc_per_node=args.nproc_per_node,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            rdzv_endpoint=args.rdzv_endpoint,
            rdzv_id=args.rdzv_id,
        )


@dataclass(frozen=True)
class NodeLayout:
    """How the job spans nodes. ``rdzv_endpoint`` None means a standalone single node."""

    nnodes: int
    node_rank: int
    nproc_per_node: int
    rdzv_endpoint: str | None
    rdzv_id: str

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class LaunchCommand(NamedTuple):
    """The torchrun command line and the variables the launcher adds to its environment."""

    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class ValidatedLaunch:
    """A launch decided once (:func:`validate_launch`): the recipe read and checked at the
    layout's world size, the layout, and the host both were sized for. Everything after the
    decision (the command, the dry run's report, the plan, the checks on this node) reads it."""

    request: LaunchRequest
    recipe: Recipe
    layout: NodeLayout
    host: HostInfo


# --------------------------------------------------------------------------- entry point


def launch_main(args: argparse.Namespace) -> int:
    """``megatron-ext launch``: print (``--dry-run``) or run the torchrun command, after the fit
    check on a GPU host (:mod:`.fit`). The host is probed once, the recipe read and the layout
    resolved once (:func:`validate_launch`)."""
    job = validate_launch(LaunchRequest.from_args(args), os.environ, probe_host())
    request, recipe, layout = job.request, job.recipe, job.layout
    argv, env = launch_command(job)
    plan, no_plan = job_plan(
        recipe, request.recipe, request.overrides, layout.nnodes, layout.nproc_per_node, job.host
    )
    if args.dry_run:
        # every check the launch makes, writing nothing, before anything is printed
        check_before_launch(recipe, layout.rdzv_endpoint, layout.node_rank, dry_run=True)
        print(format_dry_run(argv, env))
        png = getattr(args, "schedule_png", None)
        print(describe_job(recipe, layout.world_size, Path(png) if png else None), file=sys.stderr)
        print(format_plan(plan) if plan is not None else no_plan, file=sys.stderr)
    if not args.no_fit_check:
        check_fit(plan)  # a dry run of a job that does not fit says so with launch's exit code
    if plan is None and job.host.gpus and not args.dry_run:
        print(f"megatron-ext: fit check skipped: {no_plan}", file=sys.stderr)
    if args.dry_run:
        return 0
    if importlib.util.find_spec("torch") is None:  # finds the package without importing it
        raise ConfigError(
            f"torch is not installed for {sys.executable}; install this package "
            "with its dependencies (make venv) or run inside the container"
        )
    check_before_launch(recipe, layout.rdzv_endpoint, layout.node_rank)
    resume = {
        LAUNCH_COMMAND_VAR: shlex.join(["megatron-ext", "launch", *request.argv()]),
        LAUNCHED_AT_VAR: repr(process_start_time()),  # the ranks time their start-up from it
    }
    # the trainer's stop signals (training.exit_signals); a trainer without a stop policy (no
    # training section) has none: a signal then ends its ranks as torchrun would
    training = recipe.sections.get("training")
    stop = [getattr(signal, name) for name in (training.exit_signals if training else ())]
    return run_ranks(
        argv,
        {**os.environ, **env, **resume},
        Path(recipe.run_dir),
        layout.node_rank,
        stop,
        torchrun_grace_s(layout, recipe.launch),
    )


def torchrun_grace_s(layout: NodeLayout, launch: LaunchConfig) -> float | None:
    """How long torchrun may outlive this node's failed ranks before the launcher stops it
    (multi-node only). Without elastic restarts torchrun has nothing left to do but close the
    rendezvous, which a reachable store answers at once, and its monitor notices the failure
    within 5 s: 10 s. With restarts it rejoins the rendezvous (up to the join timeout, then
    torchrun's 30 s last call), twice over for margin. None on one node: its store is local and
    torchrun always ends."""
    if layout.rdzv_endpoint is None:
        return None
    if not launch.max_restarts:
        return 10.0
    return float(2 * launch.rdzv_timeout_s + 30)


def validate_launch(
    request: LaunchRequest, environ: Mapping[str, str], host: HostInfo
) -> ValidatedLaunch:
    """Read the recipe (the one read of a launch), resolve the layout, and check the recipe at
    the job's world size: the trainer's rules, ranks per GPU, the precision on this host.

    ``environ`` is only read (SLURM variables). Raises ``ConfigError`` for any user mistake."""
    recipe = read_recipe(request.recipe, request.overrides)  # fields first: clearer messages
    layout = resolve_layout(request, environ, host, recipe.launch)
    _check_gpus_per_rank(layout, host, recipe.sections.get("parallel"))
    recipe.check(world_size=layout.world_size)  # once: the trainer's rules and the layout
    training = recipe.sections.get("training")  # FP8/FP4: TE and a GPU that runs it
    check_precision_before_launch(training.precision if training else None, host.device)
    return ValidatedLaunch(request, recipe, layout, host)


def launch_command(job: ValidatedLaunch, *, python: str = sys.executable) -> LaunchCommand:
    """The torchrun command of a validated launch; ``python`` is the interpreter that runs
    torchrun and, through it, every rank. Reads nothing."""
    argv = [
        python,
        "-m",
        "torch.distributed.run",
        *torchrun_args(job.layout, job.recipe.launch),
        *RANK_ENTRY,
        job.request.recipe,
        *job.request.overrides,
    ]
    env = rank_environment(
        job.recipe.launch, job.recipe.sections.get("parallel"), job.layout, job.host
    )
    return LaunchCommand(argv, env)


def build_launch_command(
    request: LaunchRequest,
    environ: Mapping[str, str],
    host: HostInfo,
    *,
    python: str = sys.executable,
) -> LaunchCommand:
    """:func:`validate_launch` then :func:`launch_command`: the whole decision, free of side
    effects (it reads the recipe, nothing else), for a caller that wants only the command."""
    return launch_command(validate_launch(request, environ, host), python=python)


# --------------------------------------------------------------------------- layout


def resolve_layout(
    request: LaunchRequest, environ: Mapping[str, str], host: HostInfo, launch: LaunchConfig
) -> NodeLayout:
    """Nodes, this node's rank, ranks per node and the rendezvous, from flags then SLURM
    (``launch``: the recipe's section, for the CPU rank count and the SLURM port)."""
    slurm = slurm_nodes(environ)
    nnodes = _first(request.nnodes, slurm.nnodes if slurm else None, 1)
    node_rank = _first(request.node_rank, slurm.node_rank if slurm else None, 0)
    nproc = _first(request.nproc_per_node, host.gpus or None, launch.nproc_per_node_cpu)
    if nnodes < 1:
        raise ConfigError(f"--nnodes {nnodes}: need at least one node")
    if nproc < 1:
        raise ConfigError(f"--nproc-per-node {nproc}: need at least one rank per node")
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"--node-rank {node_rank} is not in [0, {nnodes - 1}] for "
            f"{nnodes} node(s): node ranks count from 0"
        )

    endpoint = request.rdzv_endpoint
    if endpoint is None and slurm is not None and nnodes > 1:
        endpoint = f"{slurm.first_host}:{launch.master_port}"
    if endpoint is None:
        if nnodes > 1:
            raise ConfigError(
                f"--nnodes {nnodes} needs --rdzv-endpoint HOST:PORT (an address "
                "of the first node that every node can reach), or run under SLURM"
            )
        if request.rdzv_id is not None:
            raise ConfigError(
                "--rdzv-id needs --rdzv-endpoint (a single node uses a private rendezvous)"
            )
        return NodeLayout(1, 0, nproc, None, "")
    parse_endpoint(endpoint)
    rdzv_id = _first(request.rdzv_id, slurm.job_id if slurm else None, DEFAULT_RDZV_ID)
    return NodeLayout(nnodes, node_rank, nproc, endpoint, rdzv_id)


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[IPv6]:PORT`` -> (host, port); anything else is a ConfigError."""
    m = re.fullmatch(
        r"(?:\[(?P<ip6>[0-9A-Fa-f:.]+)\]|(?P<host>[^\s:\[\]]+)):(?P<port>\d+)", endpoint
    )
    port = int(m["port"]) if m else 0
    if m is None or not 1 <= port <= 65535:
        raise ConfigError(
            f"--rdzv-endpoint {endpoint!r} is not HOST:PORT with a port in "
            "1-65535 (e.g. node01:29500, 10.0.0.1:29500, [fe80::1]:29500)"
        )
    return m["ip6"] or m["host"], port


def torchrun_args(layout: NodeLayout, launch: LaunchConfig) -> list[str]:
    """torchrun's own options for this layout and the recipe's ``launch`` section."""
    restarts = ["--max-restarts", str(launch.max_restarts)] if launch.max_restarts else []
    if layout.rdzv_endpoint is None:
        return ["--standalone", "--nproc-per-node", str(layout.nproc_per_node), *restarts]
    # With the c10d backend torchrun orders global ranks at the rendezvous and only logs
    # --node-rank; it is passed so every node's command line says which node it is.
    # join_timeout bounds the wait for every node; read_timeout each call to the store on the
    # first node (also the connection to it): torchrun's defaults, 600 s and 60 s, left an
    # unreachable endpoint failing after minutes and a partitioned node's torchrun waiting.
    rdzv_conf = f"join_timeout={launch.rdzv_timeout_s},read_timeout={launch.rdzv_timeout_s}"
    return [
        "--nnodes",
        str(layout.nnodes),
        "--node-rank",
        str(layout.node_rank),
        "--nproc-per-node",
        str(layout.nproc_per_node),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        layout.rdzv_endpoint,
        "--rdzv-id",
        layout.rdzv_id,
        "--rdzv-conf",
        rdzv_conf,
        *restarts,
    ]


def _check_gpus_per_rank(
    layout: NodeLayout, host: HostInfo, parallel: ParallelConfig | None
) -> None:
    """NCCL needs a GPU per rank; more ranks than GPUs fails late and obscurely, so fail now.
    ``parallel`` None: a trainer without the section uses its own backend."""
    backend = parallel.backend if parallel is not None else "auto"
    if host.gpus and layout.nproc_per_node > host.gpus and backend != "gloo":
        raise ConfigError(
            f"--nproc-per-node {layout.nproc_per_node} exceeds the {host.gpus} "
            f"GPU(s) on this node (NCCL needs one GPU per rank): use at most "
            f"{host.gpus}, or parallel.backend=gloo"
        )


# --------------------------------------------------------------------------- environment


def rank_environment(
    launch: LaunchConfig, parallel: ParallelConfig | None, layout: NodeLayout, host: HostInfo
) -> dict[str, str]:
    """Variables every rank gets on top of the launcher's own environment.

    OMP_NUM_THREADS: ``launch.threads_per_rank``, else this node's cores shared out between its
    ranks (torchrun would otherwise force 1, starving CPU ranks).
    PYTHONUNBUFFERED: log lines reach a pipe or a SLURM output file as they are printed.
    CUDA_DEVICE_MAX_CONNECTIONS=1 (GPU, tp or cp > 1): megatron-core overlaps tensor/context
    parallel communication with compute by issue order, which holds only with one hardware
    queue (required up to Hopper; set before CUDA starts, hence here).
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (``launch.max_restarts`` > 0): a fresh store for the
    ranks of each rendezvous round (:data:`FRESH_STORE_PER_ROUND`).
    """
    threads = launch.threads_per_rank or max(1, host.cpus // layout.nproc_per_node)
    env = {"OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}
    p = parallel  # None: a trainer without the section
    if host.gpus and p and (p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1):
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"
    if launch.max_restarts:
        env.update(FRESH_STORE_PER_ROUND)
    return env


# --------------------------------------------------------------------------- helpers


def _first[T](*values: T | None) -> T:
    """The first value that is not None (the last one is the default and must not be)."""
    for value in values:
        if value is not None:
            return value
    raise AssertionError("no default given")
