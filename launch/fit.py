"""The launcher's fit check: on a GPU host, a GPT recipe is planned for the job's nodes × ranks
per node on this host's GPU model (:mod:`megatron_ext.planner`) before anything starts; a
layout that does not fit the GPU's memory is refused (exit 2, the first change that fits in
the message) unless ``--no-fit-check``. ``--dry-run`` prints the plan.

CPU hosts, GPUs the plan's catalog does not hold and recipes the plan has no model for (an
uneven pipeline split, a recomputation form: :class:`~megatron_ext.planner.params.NotModelled`)
are not checked (the reason is printed by ``--dry-run``). Torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import get_trainer
from megatron_ext.errors import ConfigError
from megatron_ext.launch.hosts import HostInfo
from megatron_ext.planner.figures import Plan
from megatron_ext.planner.gpus import GPUS, gpu_kind, gpu_spec
from megatron_ext.planner.inputs import Cluster
from megatron_ext.planner.params import NotModelled
from megatron_ext.planner.plan import plan_with_fix

__all__ = ["check_fit", "job_plan"]


def job_plan(
    recipe: Recipe, source: str, overrides: Sequence[str], nnodes: int, nproc: int, host: HostInfo
) -> tuple[Plan | None, str]:
    """(the plan of the job on this host's GPUs, "") or (None, why there is none). ``recipe`` is
    ``source`` with ``overrides`` as the launcher read it (not read again here)."""
    if get_trainer(recipe.trainer).plan != "memory":
        return None, f"no plan: trainer={recipe.trainer} (megatron-ext plan plans GPT runs)"
    if not host.gpus:
        return None, "no plan: no GPU on this host (the plan is of GPU memory)"
    kind = gpu_kind(host.gpu_name)
    if kind is None:
        return None, (
            f"no plan: GPU {host.gpu_name or '(name unknown)'!r} is not in the plan's catalog "
            f"({', '.join(GPUS)}); run `megatron-ext plan --gpu KIND` for the closest one"
        )
    cluster = Cluster(gpu_spec(kind), nnodes, nproc)
    try:
        return plan_with_fix(recipe, source, overrides, cluster), ""
    except NotModelled as err:  # megatron-core trains it; the plan cannot size it
        return None, f"no plan: {err}"


def check_fit(plan: Plan | None) -> None:
    """Refuse a plan whose most loaded rank exceeds the GPU's usable memory."""
    if plan is None or plan.fits:
        return
    fix = (
        f"the first change that fits: {plan.fix}"
        if plan.fix
        else "no single change (SP, recompute, micro-batch, TP, PP) fits: use more GPUs"
    )
    raise ConfigError(
        f"the planned peak of {plan.worst.memory.peak / 1e9:.1f} GB per rank (stage "
        f"{plan.worst.stage}) exceeds the {plan.usable_bytes / 1e9:.1f} GB usable on "
        f"{plan.cluster.gpu.name}: {fix}; `megatron-ext plan` shows every figure; "
        "--no-fit-check launches anyway"
    )
