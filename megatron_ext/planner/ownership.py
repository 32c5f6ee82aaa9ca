"""Who updates which parameter in a planned run: the routes (which optimizer), the layer-wise
ownership plans of the matrices and the element-sharded (ZeRO-1) buckets of the AdamW-routed
parameters, built by the trainer's own functions, and the buckets they imply.

Torch-free.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.distributed.plan import (
    BucketLayout,
    OwnershipPlan,
    ParamSpec,
    bucket_layout,
    plan_ownership,
)
from megatron_ext.distributed.shard_layout import piece_ranges, shard_buckets
from megatron_ext.optimizers.options import MatrixRouting
from megatron_ext.optimizers.routing import chunk_of, route_parameter
from megatron_ext.planner.params import PlannedParam

__all__ = [
    "BUCKET_NUMEL",
    "FP32",
    "OptimizerLayout",
    "domain_buckets",
    "matrices",
    "optimizer_layout",
    "shard_domains",
]

#: the layer-wise optimizer's bucket size (elements), LayerwiseOptimizer.bucket_numel
BUCKET_NUMEL = 4_000_000
FP32 = 4


def matrices(shape: Sequence[int]) -> tuple[int, int, int]:
    """(count, rows, cols) the optimizer specs cost a tensor as (a 1-D tensor is 1×n)."""
    return ParamSpec("", tuple(shape), "adamw").matrices


@dataclass
class OptimizerLayout:
    """Who updates what: the routes; the layer-wise plans of the matrices over the
    data-parallel group (dense) and the expert-data-parallel group (experts), ``None`` where a
    domain has no matrix (plain AdamW); and the AdamW-routed parameters' element-sharded
    buckets over the same groups (``sharded``: names; ``dense_shards`` / ``expert_shards``)."""

    routes: dict[str, str]
    dense: OwnershipPlan | None
    expert: OwnershipPlan | None
    sharded: frozenset[str] = frozenset()
    dense_shards: list[BucketLayout] = field(default_factory=list)
    expert_shards: list[BucketLayout] = field(default_factory=list)

    def held(self, params: Sequence[PlannedParam], dense_rank: int, expert_rank: int) -> list:
        """The whole parameters the given ranks update (own or replicate); element-sharded
        ones are in :meth:`shard_elements`."""
        out = []
        for p in params:
            if p.name in self.sharded:
                continue
            plan, rank = (self.expert, expert_rank) if p.is_expert else (self.dense, dense_rank)
            assert plan is not None
            if plan.owner[p.name] in (rank, OwnershipPlan.REPLICATED):
                out.append(p)
        return out

    def shard_elements(
        self, params: Sequence[PlannedParam], dense_rank: int, expert_rank: int
    ) -> dict[str, int]:
        """Per element-sharded parameter, the elements the given ranks hold (0 included)."""
        numel = {p.name: p.numel for p in params}
        out: dict[str, int] = {}
        for buckets, rank in ((self.dense_shards, dense_rank), (self.expert_shards, expert_rank)):
            for b in buckets:
                pieces = piece_ranges(b, [numel[n] for n in b.members], rank)
                for name, (lo, hi, _) in zip(b.members, pieces, strict=True):
                    out[name] = hi - lo
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
    """Routes, ownership plans and shard buckets exactly as the trainer builds them (the same
    functions: :func:`~megatron_ext.megatron.optimizer_factories.layerwise_factory` gives the
    AdamW-routed parameters to the element-sharded AdamW, the rest to the layer-wise plan)."""
    routes = {
        p.name: route_parameter(
            p.name, p.shape, matrix_optimizer=optimizer, overrides=overrides, rules=rules
        )
        for p in params
    }
    sharded = frozenset(n for n, r in routes.items() if r == "adamw")

    def plan(members: list[PlannedParam], world: int) -> OwnershipPlan | None:
        specs = [
            ParamSpec(p.name, p.shape, routes[p.name], master_bytes_per_element=4 if bf16 else 0)
            for p in members
            if p.name not in sharded
        ]
        return plan_ownership(specs, world, hyperparameters) if specs else None

    def shards(members: list[PlannedParam], world: int) -> list[BucketLayout]:
        named = [(p.name, p.numel, "param") for p in members if p.name in sharded]
        # a tied embedding's stage copies in a bucket of their own, as the trainer's
        # element-sharded AdamW puts them (megatron_ext.distributed.sharded_adam)
        alone = {p.name for p in members if p.shared_embedding}
        return shard_buckets(named, world, BUCKET_NUMEL, alone=alone)

    # one layer-wise optimizer and one element-sharded AdamW per model chunk, as the trainer
    # builds them with virtual pipeline stages (chunked_factory): each planned alone
    chunks = _by_chunk(params)
    dense = [[p for p in c if not p.is_expert] for c in chunks]
    expert = [[p for p in c if p.is_expert] for c in chunks]
    has_expert = any(expert)
    return OptimizerLayout(
        routes,
        _merged([plan(c, dp) for c in dense], dp),
        _merged([plan(c, edp) for c in expert], edp) if has_expert else None,
        sharded,
        [b for c in dense for b in shards(c, dp)],
        [b for c in expert for b in shards(c, edp)] if has_expert else [],
    )


def _by_chunk(params: Sequence[PlannedParam]) -> list[list[PlannedParam]]:
    """``params`` split by model chunk (their ``chunk<v>.``), in order; one group without."""
    groups: dict[int | None, list[PlannedParam]] = {}
    for p in params:
        groups.setdefault(chunk_of(p.name)[0], []).append(p)
    return list(groups.values())


def _merged(plans: Sequence[OwnershipPlan | None], world: int) -> OwnershipPlan | None:
    """The model chunks' ownership plans as one (their names are distinct): owners side by
    side, per-rank loads summed."""
    present = [p for p in plans if p is not None]
    if len(present) <= 1:
        return present[0] if present else None
    return OwnershipPlan(
        world,
        {n: r for p in present for n, r in p.owner.items()},
        [sum(p.compute[r] for p in present) for r in range(world)],
        [sum(p.memory[r] for p in present) for r in range(world)],
        [n for p in present for n in p.replicated],
    )


def shard_domains(layout: OptimizerLayout, dp: int, edp: int) -> list[tuple[int, list]]:
    """``(world, buckets)`` of each element-sharded domain (dense, then experts); a domain of
    one rank moves nothing (its optimizer runs no collective)."""
    return [(dp, layout.dense_shards), (edp, layout.expert_shards)]


def domain_buckets(
    params: Sequence[PlannedParam], layout: OptimizerLayout
) -> list[tuple[OwnershipPlan, list[BucketLayout]]]:
    """Each layer-wise domain's plan and its buckets (dense first, then experts)."""
    out = []
    for plan, expert in ((layout.dense, False), (layout.expert, True)):
        if plan is None:
            continue
        buckets = []
        for chunk in _by_chunk(params):  # each chunk's optimizer buckets its own
            members = [
                (p.name, p.numel, "param")
                for p in chunk
                if p.is_expert == expert and p.name not in layout.sharded
            ]
            buckets += bucket_layout(members, plan, BUCKET_NUMEL)
        out.append((plan, buckets))
    return out
