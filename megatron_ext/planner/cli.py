"""``megatron-ext plan RECIPE [--nodes N --gpus-per-node G --gpu KIND] [key=value ...]``: memory,
communication and step time per rank of a GPT run on a cluster, before it starts
(:mod:`megatron_ext.planner.plan`). Torch-free; ``--json`` prints the same figures as JSON.

Exit codes: 0 the run fits, 1 it does not (the first change that fits is printed), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from megatron_ext.commands import Command, add_recipe_arguments
from megatron_ext.errors import ConfigError
from megatron_ext.planner.gpus import DEFAULT_MFU, DEFAULT_RESERVE_BYTES, GPUS, gpu_spec

if TYPE_CHECKING:
    from megatron_ext.planner.inputs import Cluster

__all__ = ["COMMAND", "add_cluster_arguments", "cluster_from_args"]


def add_cluster_arguments(p: argparse.ArgumentParser) -> None:
    """The cluster a plan is made for (``plan``; ``launch --dry-run`` uses its own host)."""
    p.add_argument("--gpu", default="h100", choices=sorted(GPUS), help="GPU model (default h100)")
    p.add_argument(
        "--gpus-per-node", type=int, default=8, help="GPUs per node (default 8, an HGX node)"
    )
    p.add_argument(
        "--mfu",
        type=float,
        default=DEFAULT_MFU,
        help=f"assumed model FLOPs utilisation (default {DEFAULT_MFU})",
    )
    p.add_argument(
        "--reserve-gb",
        type=float,
        default=DEFAULT_RESERVE_BYTES / 1e9,
        help="GPU memory left for the CUDA context, NCCL and fragmentation (default "
        f"{DEFAULT_RESERVE_BYTES / 1e9:g})",
    )
    p.add_argument("--nvlink-gbps", type=float, default=None, help="NVLink GB/s per GPU")
    p.add_argument("--network-gbps", type=float, default=None, help="network GB/s per GPU")


def cluster_from_args(args: argparse.Namespace, nodes: int) -> Cluster:
    if nodes < 1 or args.gpus_per_node < 1:
        raise ConfigError(
            f"--nodes {nodes} --gpus-per-node {args.gpus_per_node}: need at least one of each"
        )
    if args.reserve_gb < 0:
        raise ConfigError(f"--reserve-gb {args.reserve_gb}: give 0 or more")
    for flag, value in (("--nvlink-gbps", args.nvlink_gbps), ("--network-gbps", args.network_gbps)):
        if value is not None and value <= 0:
            raise ConfigError(f"{flag} {value}: give a positive bandwidth")
    if not 0 < args.mfu <= 1:
        raise ConfigError(f"--mfu {args.mfu}: give a fraction in (0, 1], e.g. {DEFAULT_MFU}")
    gpu = gpu_spec(args.gpu, nvlink_gbps=args.nvlink_gbps, network_gbps=args.network_gbps)
    if args.reserve_gb * 1e9 >= gpu.memory_bytes:
        raise ConfigError(
            f"--reserve-gb {args.reserve_gb:g} leaves nothing of the {gpu.kind}'s "
            f"{gpu.memory_bytes / 1e9:g} GB: give less than that (default "
            f"{DEFAULT_RESERVE_BYTES / 1e9:g})"
        )
    from megatron_ext.planner.inputs import Cluster  # the recipe schema: only when planning

    return Cluster(gpu, nodes, args.gpus_per_node, int(args.reserve_gb * 1e9))


def _arguments(p: argparse.ArgumentParser) -> None:
    add_recipe_arguments(p)
    p.add_argument("--nodes", type=int, default=1, help="number of nodes (default 1)")
    add_cluster_arguments(p)
    p.add_argument("--json", action="store_true", help="print the figures as JSON")


def plan_main(args: argparse.Namespace) -> int:
    from megatron_ext.config.load import read_recipe
    from megatron_ext.config.trainers import get_trainer

    if get_trainer(read_recipe(args.recipe, args.overrides).trainer).plan == "outer":
        return _plan_outer(args)
    from megatron_ext.planner.plan import plan_recipe
    from megatron_ext.planner.report import format_plan

    cluster = cluster_from_args(args, args.nodes)
    plan = plan_recipe(args.recipe, args.overrides, cluster, mfu=args.mfu)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else format_plan(plan))
    return 0 if plan.fits else 1


def _plan_outer(args: argparse.Namespace) -> int:
    """A recipe planned by its outer round (DiPaCo's): the bytes one round moves through the
    store (its workers' path copies, the outer executors' reads and writes), per module, phase
    and worker."""
    from megatron_ext.planner.outer import format_outer, plan_outer

    figures = plan_outer(args.recipe, args.overrides)
    print(json.dumps(figures.as_dict(), indent=2) if args.json else format_outer(figures))
    return 0


#: The ``megatron_ext.commands`` entry point ``plan`` (setup.py).
COMMAND = Command(
    name="plan",
    usage="RECIPE [key=value ...]",
    help="memory, communication and step time per rank on a cluster, before a run",
    description="Plan a GPT recipe on --nodes x --gpus-per-node GPUs of one --gpu kind: per "
    "rank, the parameters, gradients, masters, optimizer state, activations, the largest "
    "transient and the peak against the GPU's memory; the bytes each collective moves per "
    "step; the step time at an assumed MFU; the layer-wise plan's balance beside megatron-core's "
    "layer-wise optimizer and ZeRO-1. A DiPaCo recipe: the bytes of one outer round per module, "
    "phase and worker. Exit 0 when it fits, 1 when it does not (the first change that fits is "
    "printed), 2 for bad input.",
    add_arguments=_arguments,
    run=plan_main,
)
