"""What two reference schemes give each data-parallel rank, beside our layer-wise plan (no torch).

For the parameters of one data-parallel group (``ParamSpec`` in forward order, each with the
optimizer it is routed to), each scheme's load per rank — elements, optimizer-state bytes,
optimizer FLOPs, all-gather bytes — so the planner can print them side by side:

- **ours** (:func:`ours_load`): :func:`~megatron_ext.distributed.plan.plan_ownership` (LPT on
  the optimizers' cost models) and :func:`~megatron_ext.distributed.plan.bucket_layout`, whose
  all-gather-v carries no padding.
- **megatron-core layer-wise** (:func:`megatron_layerwise_load`): the owners of megatron-core's
  ``LayerWiseDistributedOptimizer`` (:func:`~.mcore_layout.layerwise_layout`: LPT on element
  counts, bucket by bucket, padded shards), costed with our specs; its updated parameters
  travel in the distributed optimizer's equal-shard all-gather of each padded bucket
  (``use_buffer_param_sync``).
- **ZeRO-1** (:func:`zero1_load`): megatron-core's ``DistributedOptimizer``
  (:func:`~.mcore_layout.distributed_optimizer_layout`): every bucket split into ``dp`` equal
  element ranges across parameter boundaries, and all-gathered the same way.

Which parameters: megatron-core's layer-wise optimizer manages the 2-D parameters that are not
embeddings or the output layer (``is_managed_by_layer_wise_optimizer``, layer_wise_optimizer.py);
the others go to a ``DistributedOptimizer`` in a buffer of their own
(``LayerWiseDistributedOptimizer.compute_full_param_layout``), and expert-parallel parameters to
buffers over the expert data-parallel group. The comparison applies the three schemes to what our
routes send to a matrix optimizer (:func:`matrix_routed`: a spec that ``couples_matrix_entries``),
one data-parallel group at a time. Our routes differ from megatron-core's rule on one parameter,
the MoE router weight (AdamW here, layer-wise there).

ZeRO-1 with a matrix optimizer: its state would be sharded by elements (a rank holds
``held/numel`` of a matrix's state: exact for the per-element states of AdamW, Lion, Muon and
MOP, an attribution only for KL-SOAP's factor matrices), but its step needs the whole matrix, so
the matrix must be gathered first or the step computed on every rank: ``flops`` is None rather
than a figure for either.

Units: elements, bytes, FLOPs per optimizer step.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_ext.distributed.plan import (
    OwnershipPlan,
    ParamSpec,
    bucket_layout,
    compute_cost,
    plan_ownership,
    state_bytes,
)
from megatron_ext.optimizers.routing import route_parameter
from megatron_ext.optimizers.spec import optimizer_spec
from megatron_ext.planner.mcore_layout import (
    BufferLayout,
    distributed_optimizer_layout,
    layerwise_layout,
)
from megatron_ext.planner.params import PlannedParam

__all__ = [
    "PerRank",
    "SchemeLoad",
    "matrix_routed",
    "megatron_layerwise_load",
    "ours_load",
    "routed_specs",
    "scheme_loads",
    "zero1_load",
]


class PerRank(tuple[float, ...]):
    """One figure per data-parallel rank (a tuple), with its spread."""

    __slots__ = ()

    @property
    def max(self) -> float:
        return max(self)

    @property
    def mean(self) -> float:
        return sum(self) / len(self)

    @property
    def imbalance(self) -> float:
        """max / mean (1.0: perfectly even; 1.0 when every rank has nothing)."""
        mean = self.mean
        return self.max / mean if mean > 0 else 1.0


@dataclass(frozen=True)
class SchemeLoad:
    """What one scheme gives each rank of one data-parallel group, per optimizer step.

    owned_numel: elements whose optimizer step the rank runs (or, ZeRO-1, whose state it holds).
    state_bytes: optimizer state (the spec's ``state_bytes``) plus the fp32 master if the
        ``ParamSpec`` carries one, bytes.
    flops: the optimizer step's FLOPs (the spec's model); None where the scheme has no honest
        figure (ZeRO-1 with a matrix optimizer).
    gather_bytes: bytes the rank receives in the parameter all-gather (padding included).
    padding_numel: elements of padding in the scheme's buffer (0 for ours: no padding).
    """

    name: str
    owned_numel: PerRank
    state_bytes: PerRank
    flops: PerRank | None
    gather_bytes: PerRank
    padding_numel: int = 0


def routed_specs(
    params: Sequence[PlannedParam],
    *,
    matrix_optimizer: str,
    overrides: Sequence[tuple[str, str]] = (),
    master_bytes_per_element: int = 0,
) -> list[ParamSpec]:
    """``params`` with the optimizer :func:`route_parameter` gives each (order kept);
    ``master_bytes_per_element``: 4 for bf16 parameters with an fp32 master, else 0."""
    return [
        ParamSpec(
            p.name,
            p.shape,
            route_parameter(
                p.name, p.shape, matrix_optimizer=matrix_optimizer, overrides=overrides
            ),
            is_expert=p.is_expert,
            master_bytes_per_element=master_bytes_per_element,
        )
        for p in params
    ]


def matrix_routed(specs: Sequence[ParamSpec]) -> list[ParamSpec]:
    """The specs routed to a matrix optimizer (one whose update couples a matrix's entries),
    order kept: what the layer-wise comparison is made on."""
    return [s for s in specs if optimizer_spec(s.optimizer).couples_matrix_entries]


def ours_load(
    specs: Sequence[ParamSpec],
    dp_size: int,
    *,
    hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
    bucket_numel: int = 4_000_000,
    element_bytes: int = 2,
) -> SchemeLoad:
    """Our layer-wise plan over ``specs`` (forward order): owners from ``plan_ownership``,
    buckets of ``bucket_numel`` elements from ``bucket_layout``; ``element_bytes``: bytes per
    gathered element (the model dtype: 2 for bf16). Replicated parameters count on every rank
    and are not gathered."""
    plan = plan_ownership(list(specs), dp_size, hyperparameters)
    hp = hyperparameters or {}
    numel, state, flops = [0] * dp_size, [0] * dp_size, [0.0] * dp_size
    for s in specs:
        owner = plan.owner[s.name]
        ranks = range(dp_size) if owner == OwnershipPlan.REPLICATED else (owner,)
        for r in ranks:
            numel[r] += s.numel
            state[r] += state_bytes(s)
            flops[r] += compute_cost(s, hp.get(s.optimizer))
    layouts = bucket_layout([(s.name, s.numel, "") for s in specs], plan, bucket_numel)
    gather = [sum(b.gather_bytes(r, element_bytes)[1] for b in layouts) for r in range(dp_size)]
    return SchemeLoad("ours", PerRank(numel), PerRank(state), PerRank(flops), PerRank(gather))


def _gather_bytes(layout: BufferLayout, element_bytes: int) -> PerRank:
    """Equal-shard all-gather of every bucket: each rank receives the other dp−1 shards."""
    received = sum(layout.shard_sizes) * (layout.dp_size - 1) * element_bytes
    return PerRank([received] * layout.dp_size)


def megatron_layerwise_load(
    specs: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None,
    hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
    element_bytes: int = 2,
    pad_buckets_for_high_nccl_busbw: bool = False,
    shared_embeddings: Collection[str] = (),
) -> SchemeLoad:
    """megatron-core's layer-wise assignment (:func:`layerwise_layout`) of ``specs`` (forward
    order), costed with our specs: a rank steps the whole parameters in its shards."""
    layout = layerwise_layout(
        [(s.name, s.numel) for s in specs],
        dp_size=dp_size,
        bucket_size=bucket_size,
        pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
        shared_embeddings=shared_embeddings,
    )
    hp = hyperparameters or {}
    numel, state, flops = [0] * dp_size, [0] * dp_size, [0.0] * dp_size
    for s in specs:
        r = layout.shard_of(s.name)
        numel[r] += s.numel
        state[r] += state_bytes(s)
        flops[r] += compute_cost(s, hp.get(s.optimizer))
    return SchemeLoad(
        "megatron-core layer-wise",
        PerRank(numel),
        PerRank(state),
        PerRank(flops),
        _gather_bytes(layout, element_bytes),
        layout.padding,
    )


def zero1_load(
    specs: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None,
    hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
    element_bytes: int = 2,
    pad_buckets_for_high_nccl_busbw: bool = False,
    shared_embeddings: Collection[str] = (),
) -> SchemeLoad:
    """ZeRO-1 (:func:`distributed_optimizer_layout`) of ``specs`` (forward order): a rank holds
    the state of the elements in its shards, ``state_bytes · held / numel`` of each parameter
    (floor), and steps them: FLOPs pro rata for element-wise optimizers, None as soon as one
    parameter is routed to a matrix optimizer (module docstring)."""
    layout = distributed_optimizer_layout(
        [(s.name, s.numel) for s in specs],
        dp_size=dp_size,
        bucket_size=bucket_size,
        pad_buckets_for_high_nccl_busbw=pad_buckets_for_high_nccl_busbw,
        shared_embeddings=shared_embeddings,
    )
    hp = hyperparameters or {}
    by_name = {s.name: s for s in specs}
    elementwise = not matrix_routed(specs)
    numel, state, flops = [0] * dp_size, [0] * dp_size, [0.0] * dp_size
    for r in range(dp_size):
        for name, held in layout.held(r).items():
            s = by_name[name]
            numel[r] += held
            state[r] += state_bytes(s) * held // s.numel
            if elementwise:
                flops[r] += compute_cost(s, hp.get(s.optimizer)) * held / s.numel
    return SchemeLoad(
        "ZeRO-1",
        PerRank(numel),
        PerRank(state),
        PerRank(flops) if elementwise else None,
        _gather_bytes(layout, element_bytes),
        layout.padding,
    )


def scheme_loads(
    specs: Sequence[ParamSpec],
    dp_size: int,
    *,
    bucket_size: int | None,
    bucket_numel: int = 4_000_000,
    hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
    element_bytes: int = 2,
    pad_buckets_for_high_nccl_busbw: bool = False,
    shared_embeddings: Collection[str] = (),
) -> tuple[SchemeLoad, SchemeLoad, SchemeLoad]:
    """(ours, megatron-core layer-wise, ZeRO-1) over the same ``specs`` and data-parallel group
    (pass :func:`matrix_routed` specs for the matrix-optimizer comparison). ``bucket_size`` is
    megatron-core's (elements; see :func:`default_bucket_size`), ``bucket_numel`` ours."""
    common: dict[str, Any] = {
        "hyperparameters": hyperparameters,
        "element_bytes": element_bytes,
    }
    mcore: dict[str, Any] = {
        **common,
        "bucket_size": bucket_size,
        "pad_buckets_for_high_nccl_busbw": pad_buckets_for_high_nccl_busbw,
        "shared_embeddings": shared_embeddings,
    }
    return (
        ours_load(specs, dp_size, bucket_numel=bucket_numel, **common),
        megatron_layerwise_load(specs, dp_size, **mcore),
        zero1_load(specs, dp_size, **mcore),
    )
