"""Which data-parallel rank owns which whole parameter matrix: the ownership plan.

Matrix optimizers need whole matrices, so the layer-wise distributed optimizer gives each
parameter to one rank of its data-parallel group (dense weights: the data-parallel group; MoE
expert weights: the expert-data-parallel group).  The plan is a pure function of parameter names,
shapes and optimizers, so every rank computes the same plan without communicating.

Assignment is greedy longest-processing-time (LPT): parameters in decreasing cost order, each to
the rank with the least compute so far, among the ranks whose memory stays within
``memory_slack`` × the ideal per-rank memory (if none does, the one with the least memory).  LPT
guarantees a makespan within 4/3 of the optimum; with many parameters it is close to perfect.

Small 1-D parameters (norm weights, biases) are *replicated*: every rank updates them, which costs
a few element-wise FLOPs and saves communicating them.

Cost model, per optimizer step of one parameter: each optimizer's spec
(:mod:`megatron_ext.optimizers.spec`) gives the FLOPs of one step of one matrix from its
keyword hyperparameters (Newton–Schulz for Muon, a thin SVD for MOP, KL-SOAP's whole step, 12 per
element for AdamW and Lion) and the bytes of its fp32 state; a 3-D expert stack is that many
matrices, a 1-D tensor a 1×n one.

Memory: the optimizer state plus the parameter's fp32 master when the model holds bf16.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from megatron_ext.optimizers.spec import optimizer_spec


@dataclass(frozen=True)
class ParamSpec:
    """What the plan knows of one parameter."""

    name: str
    shape: tuple[int, ...]
    optimizer: str  # a registered optimizer name
    is_expert: bool = False
    master_bytes_per_element: int = 0  # 4 for bf16 params with an fp32 master, else 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def matrices(self) -> tuple[int, int, int]:
        """(count, rows, cols): a 3-D stacked-expert tensor is ``count`` matrices."""
        if len(self.shape) == 3:
            return self.shape[0], self.shape[1], self.shape[2]
        if len(self.shape) == 2:
            return 1, self.shape[0], self.shape[1]
        return 1, 1, self.numel


def compute_cost(spec: ParamSpec, hyperparameters: Mapping[str, Any] | None = None) -> float:
    """FLOPs of one optimizer step for ``spec`` given its optimizer's keyword hyperparameters."""
    count, rows, cols = spec.matrices
    return count * optimizer_spec(spec.optimizer).flops(rows, cols, hyperparameters or {})


def state_bytes(spec: ParamSpec) -> int:
    """Bytes of optimizer state (fp32) plus the fp32 master copy, if any."""
    count, rows, cols = spec.matrices
    state = count * optimizer_spec(spec.optimizer).state_bytes(rows, cols)
    return state + spec.master_bytes_per_element * spec.numel


@dataclass
class OwnershipPlan:
    """The result: owner rank per parameter name (``REPLICATED`` = every rank)."""

    world: int
    owner: dict[str, int]
    compute: list[float]  # FLOPs per rank (owned parameters)
    memory: list[int]  # optimizer-state bytes per rank (owned parameters)
    replicated: list[str] = field(default_factory=list)

    REPLICATED = -1

    def owned_by(self, rank: int) -> list[str]:
        return [n for n, r in self.owner.items() if r == rank]

    @staticmethod
    def _imbalance(loads: list[float]) -> float:
        mean = sum(loads) / len(loads)
        return max(loads) / mean if mean > 0 else 1.0

    @property
    def compute_imbalance(self) -> float:
        return self._imbalance(self.compute)

    @property
    def memory_imbalance(self) -> float:
        return self._imbalance([float(m) for m in self.memory])

    def describe(self) -> str:
        gflops = ", ".join(f"{c / 1e9:.2f}" for c in self.compute)
        mib = ", ".join(f"{m / 2**20:.1f}" for m in self.memory)
        return (
            f"ownership plan over {self.world} ranks: compute imbalance "
            f"{self.compute_imbalance:.3f} (GFLOP/step per rank: {gflops}), memory "
            f"imbalance {self.memory_imbalance:.3f} (MiB per rank: {mib}); "
            f"{len(self.replicated)} small parameters replicated on every rank"
        )


def plan_ownership(
    specs: list[ParamSpec],
    world: int,
    hyperparameters: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    memory_slack: float = 1.25,
    replicate_below: int = 65536,
) -> OwnershipPlan:
    """Assign each parameter in ``specs`` to one of ``world`` ranks (see module docstring).

    ``hyperparameters``: per optimizer name, its keyword hyperparameters (they set the cost of
    e.g. Muon's Newton–Schulz). 1-D parameters with fewer than ``replicate_below`` elements are
    replicated.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique for an ownership plan")
    owner: dict[str, int] = {}
    replicated = [s.name for s in specs if len(s.shape) <= 1 and s.numel < replicate_below]
    for name in replicated:
        owner[name] = OwnershipPlan.REPLICATED
    planned = [s for s in specs if s.name not in owner]
    hp = hyperparameters or {}
    costs = {s.name: compute_cost(s, hp.get(s.optimizer)) for s in planned}
    mems = {s.name: state_bytes(s) for s in planned}
    memory_bound = memory_slack * sum(mems.values()) / world
    compute = [0.0] * world
    memory = [0] * world
    # Largest first; ties broken by name so that every rank builds the identical plan.
    for spec in sorted(planned, key=lambda s: (-costs[s.name], s.name)):
        heap = [(compute[r], r) for r in range(world)]
        heapq.heapify(heap)
        choice = None
        while heap:
            _, r = heapq.heappop(heap)
            if memory[r] + mems[spec.name] <= memory_bound:
                choice = r
                break
        if choice is None:
            choice = min(range(world), key=lambda r: (memory[r], r))
        owner[spec.name] = choice
        compute[choice] += costs[spec.name]
        memory[choice] += mems[spec.name]
    return OwnershipPlan(
        world=world, owner=owner, compute=compute, memory=memory, replicated=replicated
    )


@dataclass(frozen=True)
class BucketLayout:
    """One all-gather bucket of the layer-wise optimizer: its parameters in forward order and
    the elements each rank owns in it (its buffer is laid out rank by rank)."""

    members: tuple[str, ...]
    counts: tuple[int, ...]  # elements per owner rank; sum = the bucket's elements
    dtype: str  # the parameters' dtype (one per bucket), e.g. "torch.bfloat16"

    @cached_property
    def numel(self) -> int:
        """The bucket's elements (``sum(counts)``, computed once)."""
        return sum(self.counts)

    def gather_bytes(self, rank: int, element_bytes: int) -> tuple[int, int]:
        """(sent, received) payload bytes of ``rank`` in the bucket's all-gather-v: its own
        segment out, everyone else's in (what :class:`~.allgather_v.WireStats` counts); at one
        rank there is no all-gather (the parameters are updated where they are): (0, 0)."""
        if len(self.counts) == 1:
            return 0, 0
        own = self.counts[rank]
        return own * element_bytes, (self.numel - own) * element_bytes

    def reduce_scatter_bytes(self, rank: int, element_bytes: int) -> tuple[int, int]:
        """(sent, received) payload bytes of ``rank`` in the bucket's gradient
        reduce-scatter-v: the gradients it does not own out, ``world − 1`` copies of its own in
        (:func:`~.reduce_scatter_v.reduce_scatter_v`)."""
        own = self.counts[rank]
        world = len(self.counts)
        return (self.numel - own) * element_bytes, (world - 1) * own * element_bytes


def bucket_layout(
    params: Sequence[tuple[str, int, str]], plan: OwnershipPlan, bucket_numel: int
) -> list[BucketLayout]:
    """The buckets of ``params`` — ``(name, numel, dtype)`` in forward order: consecutive
    non-replicated parameters of one dtype, a bucket closing before it would exceed
    ``bucket_numel`` elements (a larger parameter gets a bucket of its own)."""
    groups: list[list[tuple[str, int, str]]] = [[]]
    size = 0
    for name, numel, dtype in params:
        if plan.owner[name] == OwnershipPlan.REPLICATED:
            continue
        current = groups[-1]
        if current and (size + numel > bucket_numel or current[-1][2] != dtype):
            groups.append([])
            size = 0
        groups[-1].append((name, numel, dtype))
        size += numel
    layouts = []
    for members in (g for g in groups if g):
        counts = [0] * plan.world
        for name, numel, _ in members:
            counts[plan.owner[name]] += numel
        layouts.append(BucketLayout(tuple(n for n, _, _ in members), tuple(counts), members[0][2]))
    return layouts
