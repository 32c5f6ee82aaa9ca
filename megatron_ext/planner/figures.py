"""What a plan holds: per data-parallel rank of a domain (:class:`RankLoads`), per pipeline stage
(:class:`StagePlan`) and for the whole run (:class:`Plan`), each with its JSON form
(``as_dict``, what ``megatron-ext plan --json`` prints). :mod:`.plan` computes them,
:mod:`.report` renders them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.planner.comm import CommFigures
from megatron_ext.planner.inputs import Cluster, RunLayout
from megatron_ext.planner.memory import MemoryFigures
from megatron_ext.planner.steptime import StepTime

__all__ = ["Plan", "RankLoads", "StagePlan"]


@dataclass
class RankLoads:
    """Per data-parallel rank of one domain (dense or experts): what the layer-wise plan gives
    it to update beyond the replicated parameters (bytes, FLOPs per step)."""

    state_bytes: list[int]
    master_bytes: list[int]
    flops: list[float]
    gather_bytes: list[int]  # all-gather-v bytes received per step

    @property
    def ranks(self) -> int:
        return len(self.state_bytes)

    def imbalance(self, values: Sequence[float]) -> float:
        """max / mean (1 = perfectly balanced; 0 work anywhere counts as balanced)."""
        mean = sum(values) / len(values)
        return max(values) / mean if mean else 1.0

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ranks": self.ranks}
        for key in ("state_bytes", "master_bytes", "flops", "gather_bytes"):
            values = getattr(self, key)
            out[key] = {
                "max": max(values),
                "mean": sum(values) / len(values),
                "imbalance": self.imbalance(values),
            }
        return out


@dataclass
class StagePlan:
    """One pipeline stage: its most loaded rank's memory and communication, the mean rank's
    memory, and the per-rank loads of the layer-wise plan."""

    stage: int
    params: int  # elements on one rank of the stage
    memory: MemoryFigures  # the most loaded rank
    mean_static: float  # the mean rank's static bytes
    comm: CommFigures
    dense: RankLoads | None
    expert: RankLoads | None
    optimizer_flops: float  # the most loaded rank's optimizer step
    #: micro-batches whose activations are alive at once at the peak (1F1B); with virtual
    #: stages, micro-batch x chunk forward passes (megatron_ext.planner.schedule)
    in_flight: int
    dense_rank: int  # the most loaded rank's ranks in the dense / expert domains
    expert_rank: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "params": self.params,
            "most_loaded_rank": {"dense": self.dense_rank, "expert": self.expert_rank},
            "memory": self.memory.as_dict(),
            "mean_static": self.mean_static,
            "comm": self.comm.as_dict(),
            "optimizer_flops": self.optimizer_flops,
            "micro_batches_in_flight": self.in_flight,
            "layerwise_dense": self.dense.as_dict() if self.dense else None,
            "layerwise_expert": self.expert.as_dict() if self.expert else None,
        }


@dataclass
class Plan:
    """The whole plan (:func:`~megatron_ext.planner.plan.plan_run`; its module docstring)."""

    recipe: str
    cluster: Cluster
    layout: RunLayout
    optimizer: str
    precision: str
    vocab: int
    total_params: int  # elements of the whole model
    stages: list[StagePlan]
    step: StepTime
    tokens_per_step: int
    train_tokens: int
    model_flops_per_rank: float
    assumptions: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    baselines: dict[str, Any] = field(default_factory=dict)
    fix: str | None = None  # the first change that makes it fit, when it does not

    @property
    def worst(self) -> StagePlan:
        """The stage whose most loaded rank peaks highest."""
        return max(self.stages, key=lambda s: s.memory.peak)

    @property
    def usable_bytes(self) -> int:
        return self.cluster.gpu.memory_bytes - self.cluster.reserve_bytes

    @property
    def fits(self) -> bool:
        return self.worst.memory.peak <= self.usable_bytes

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step.total_s

    @property
    def time_to_budget_s(self) -> float:
        return self.train_tokens / self.tokens_per_second

    def as_dict(self) -> dict[str, Any]:
        gpu = self.cluster.gpu
        return {
            "recipe": self.recipe,
            "cluster": {
                "gpu": gpu.kind,
                "gpu_name": gpu.name,
                "nodes": self.cluster.nodes,
                "gpus_per_node": self.cluster.gpus_per_node,
                "world": self.cluster.world,
                "gpu_memory_bytes": gpu.memory_bytes,
                "reserve_bytes": self.cluster.reserve_bytes,
            },
            "layout": self.layout.as_dict(),
            "optimizer": self.optimizer,
            "precision": self.precision,
            "vocab_size": self.vocab,
            "total_params": self.total_params,
            "stages": [s.as_dict() for s in self.stages],
            "worst_stage": self.worst.stage,
            "peak_bytes": self.worst.memory.peak,
            "usable_bytes": self.usable_bytes,
            "fits": self.fits,
            "fix": self.fix,
            "step": self.step.as_dict(),
            "model_flops_per_rank": self.model_flops_per_rank,
            "tokens_per_step": self.tokens_per_step,
            "tokens_per_second": self.tokens_per_second,
            "train_tokens": self.train_tokens,
            "time_to_budget_s": self.time_to_budget_s,
            "baselines": self.baselines,
            "assumptions": self.assumptions,
            "notes": list(self.notes),
        }
