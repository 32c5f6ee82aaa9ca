"""The ownership plan: deterministic, complete, balanced (LPT bound), memory-bounded."""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_ext.distributed.plan import (
    OwnershipPlan,
    ParamSpec,
    compute_cost,
    plan_ownership,
    state_bytes,
)


def reference_workload(optimizer: str = "muon") -> list[ParamSpec]:
    """The optimizers issue's workload: 4 layers of a d=512 block, 16 experts each."""
    specs = []
    for layer in range(4):
        pre = f"decoder.layers.{layer}"
        for name, shape in (
            ("self_attention.linear_qkv.weight", (1536, 512)),
            ("self_attention.linear_proj.weight", (512, 512)),
            ("mlp.linear_fc1.weight", (2048, 512)),
            ("mlp.linear_fc2.weight", (512, 2048)),
        ):
            specs.append(ParamSpec(f"{pre}.{name}", shape, optimizer))
        for e in range(16):
            for name, shape in (("linear_fc1", (256, 512)), ("linear_fc2", (512, 256))):
                specs.append(
                    ParamSpec(
                        f"{pre}.mlp.experts.{name}.weight{e}", shape, optimizer, is_expert=True
                    )
                )
        specs.append(ParamSpec(f"{pre}.input_layernorm.weight", (512,), "adamw"))
    return specs


def test_reference_workload_has_the_stated_size():
    matrices = [s for s in reference_workload() if len(s.shape) == 2]
    assert len(matrices) == 144
    assert sum(s.numel for s in matrices) == 29_360_128


@pytest.mark.parametrize("optimizer", ["muon", "kl_soap", "adamw"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_parameter_has_one_owner_and_balance_meets_target(optimizer, world):
    specs = reference_workload(optimizer)
    plan = plan_ownership(specs, world)
    assert set(plan.owner) == {s.name for s in specs}
    assert all(plan.owner[s.name] == OwnershipPlan.REPLICATED for s in specs if len(s.shape) == 1)
    owned = [n for n, r in plan.owner.items() if r != OwnershipPlan.REPLICATED]
    assert all(0 <= plan.owner[n] < world for n in owned)
    # Loads add up to the per-parameter costs.
    costs = {s.name: compute_cost(s) for s in specs}
    for r in range(world):
        assert plan.compute[r] == pytest.approx(sum(costs[n] for n in plan.owned_by(r)))
    assert plan.compute_imbalance <= 1.05, plan.describe()


def test_plan_is_independent_of_input_order():
    specs = reference_workload("kl_soap")
    shuffled = specs[:]
    random.Random(3).shuffle(shuffled)
    assert plan_ownership(specs, 4).owner == plan_ownership(shuffled, 4).owner


def test_lpt_is_within_four_thirds_of_the_optimum():
    rng = random.Random(0)
    for _ in range(20):
        specs = [
            ParamSpec(f"w{i}", (rng.randint(8, 64), rng.randint(8, 64)), "muon") for i in range(7)
        ]
        costs = [compute_cost(s) for s in specs]
        best = min(
            max(sum(c for c, r in zip(costs, assign, strict=True) if r == k) for k in range(3))
            for assign in itertools.product(range(3), repeat=len(specs))
        )
        plan = plan_ownership(specs, 3, memory_slack=float("inf"))
        assert max(plan.compute) <= 4 / 3 * best + 1e-6


def test_memory_bound_is_respected_when_it_can_be():
    # One expensive-but-small matrix and many cheap-but-big AdamW tensors: pure compute
    # balancing would pile memory onto the ranks without the expensive matrix.
    specs = [ParamSpec("hot", (512, 512), "muon")]
    specs += [ParamSpec(f"big{i}", (1024, 1024), "adamw") for i in range(6)]
    plan = plan_ownership(specs, 2, memory_slack=1.25)
    bound = 1.25 * sum(state_bytes(s) for s in specs) / 2
    assert max(plan.memory) <= bound
    assert plan.memory_imbalance <= 1.25


def test_state_bytes_follow_the_optimizers():
    p = ParamSpec("w", (64, 32), "adamw", master_bytes_per_element=4)
    assert state_bytes(p) == 64 * 32 * 4 * 3  # exp_avg, exp_avg_sq, fp32 master
    k = ParamSpec("w", (64, 32), "kl_soap")
    assert state_bytes(k) == 4 * (2 * 64 * 64 + 2 * 32 * 32 + 2 * 64 * 32)
    with pytest.raises(ValueError, match=r"optimizer.name='sgd' is not a registered optimizer"):
        state_bytes(ParamSpec("w", (4, 4), "sgd"))


def test_describe_reports_both_imbalances():
    text = plan_ownership(reference_workload(), 4).describe()
    assert "compute imbalance" in text and "memory imbalance" in text and "replicated" in text
