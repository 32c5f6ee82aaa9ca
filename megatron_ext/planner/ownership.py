"""Who updates which parameter in a planned run: the routes (which optimizer) and the layer-wise
ownership plans, built by the trainer's own functions, and the all-gather buckets they imply.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ext.distributed.plan import (
    BucketLayout,
    OwnershipPlan,
    ParamSpec,
    bucket_layout,
    plan_ownership,
)
from megatron_ext.optimizers.options import MatrixRouting
from megatron_ext.optimizers.routing import route_parameter
from megatron_ext.planner.params import PlannedParam

__all__ = [
    "BUCKET_NUMEL",
    "FP32",
    "OptimizerLayout",
    "domain_buckets",
    "matrices",
    "optimizer_layout",
]

#: the layer-wise optimizer's bucket size (elements), LayerwiseOptimizer.bucket_numel
BUCKET_NUMEL = 4_000_000
FP32 = 4


def matrices(shape: Sequence[int]) -> tuple[int, int, int]:
    """(count, rows, cols) the optimizer specs cost a tensor as (a 1-D tensor is 1×n)."""
    return ParamSpec("", tuple(shape), "adamw").matrices


@dataclass
class OptimizerLayout:
    """Who updates what: the routes, and the plans over the data-parallel group (dense) and the
    expert-data-parallel group (experts); ``None`` plans for plain AdamW (every rank all)."""

    routes: dict[str, str]
    dense: OwnershipPlan | None
    expert: OwnershipPlan | None

    def held(self, params: Sequence[PlannedParam], dense_rank: int, expert_rank: int) -> list:
        """The parameters the given ranks update (own or replicate)."""
        if self.dense is None:
            return list(params)
        out = []
        for p in params:
            plan, rank = (self.expert, expert_rank) if p.is_expert else (self.dense, dense_rank)
            assert plan is not None
            if plan.owner[p.name] in (rank, OwnershipPlan.REPLICATED):
                out.append(p)
        return out


def optimizer_layout(
    params: Sequence[PlannedParam],
    optimizer: str,
    hyperparameters: Mapping[str, Mapping[str, Any]],
    *,
    dp: int,
    edp: int,
    bf16: bool,
    overrides: Sequence[tuple[str, str]] = (),
    rules: MatrixRouting = "megatron_ext",
) -> OptimizerLayout:
    """Routes and ownership plans exactly as the trainer builds them (the same functions)."""
    routes = {
        p.name: route_parameter(
            p.name, p.shape, matrix_optimizer=optimizer, overrides=overrides, rules=rules
        )
        for p in params
    }
    if optimizer == "adamw":
        return OptimizerLayout(routes, None, None)

    def plan(members: list[PlannedParam], world: int) -> OwnershipPlan:
        specs = [
            ParamSpec(p.name, p.shape, routes[p.name], master_bytes_per_element=4 if bf16 else 0)
            for p in members
        ]
        return plan_ownership(specs, world, hyperparameters)

    expert = [p for p in params if p.is_expert]
    return OptimizerLayout(
        routes,
        plan([p for p in params if not p.is_expert], dp),
        plan(expert, edp) if expert else None,
    )


def domain_buckets(
    params: Sequence[PlannedParam], layout: OptimizerLayout
) -> list[tuple[OwnershipPlan, list[BucketLayout]]]:
    """Each layer-wise domain's plan and its buckets (dense first, then experts)."""
    out = []
    for plan, expert in ((layout.dense, False), (layout.expert, True)):
        if plan is None:
            continue
        members = [(p.name, p.numel, "param") for p in params if p.is_expert == expert]
        out.append((plan, bucket_layout(members, plan, BUCKET_NUMEL)))
    return out
