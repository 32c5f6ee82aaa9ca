"""The layer-wise optimizer at DP=2 and DP=4 against the single-process optimizer.

Reference: the registry's optimizers over *all* parameters in one process (routed the same way),
stepped with the same gradients. Each parameter is updated by one rank with the same arithmetic
and all-gathered bit for bit, so the parameters must be identical, not merely close.
"""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext.optimizers import build_optimizer, route_parameter
from tests.conftest import DIST, run_torchrun
from tests.dist.layerwise_step import STEPS, make_params, set_grads


def single_process(
    optimizer: str, steps: int = STEPS, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Parameters after ``steps`` steps; for bf16, the fp32 masters (started from the bf16
    values), which the model holds rounded to bf16."""
    torch.set_num_threads(1)
    params = [
        (n, torch.nn.Parameter(p.detach().float()))
        for n, p in make_params(optimizer != "kl_soap", dtype)
    ]
    by_route: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, p in params:
        route = route_parameter(name, tuple(p.shape), matrix_optimizer=optimizer)
        by_route.setdefault(route, []).append((name, p))
    # megatron-core's convention, which the layer-wise optimizer follows: no decay on 1-D tensors
    opts = [
        build_optimizer(
            route,
            [
                {"params": [p for _, p in named if p.ndim >= 2]},
                {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
            ],
        )
        for route, named in by_route.items()
    ]
    for step in range(steps):
        set_grads(params, step)
        for opt in opts:
            opt.step()
    return {n: p.detach().clone() for n, p in params}


@pytest.mark.parametrize("optimizer", ["muon", "kl_soap", "adamw"])
@pytest.mark.parametrize("world", [2, 4])
def test_layerwise_equals_single_process(tmp_path, optimizer, world):
    out = tmp_path / "params.pt"
    run_torchrun(DIST / "layerwise_step.py", world, optimizer, str(out))
    saved = torch.load(out)
    owners = {r for r in saved["plan"].values() if r >= 0}
    assert owners == set(range(world)), "every rank should own something"
    assert saved["buckets"] > 1
    ref = single_process(optimizer)
    initial = dict(make_params(with_experts=optimizer != "kl_soap"))
    for name, want in ref.items():
        assert not torch.equal(want, initial[name].detach()), f"{name} did not move"
        assert torch.equal(saved["params"][name], want), name


@pytest.mark.parametrize(("optimizer", "world"), [("muon", 2), ("kl_soap", 4)])
def test_bf16_parameters_keep_fp32_masters_only_where_updated(tmp_path, optimizer, world):
    """bf16 parameters: every rank keeps fp32 masters only for the parameters it owns plus the
    replicated ones (so each non-replicated master exists once across ranks), the all-gather
    carries bf16 (received: exactly the bf16 bytes of the others' parameters), and the model
    ends bit-identical to the single-process optimizer's fp32 masters rounded to bf16."""
    from megatron_ext.distributed.plan import OwnershipPlan

    out = tmp_path / "params.pt"
    run_torchrun(DIST / "layerwise_step.py", world, optimizer, str(out), "bf16")
    saved = torch.load(out)
    plan = saved["plan"]
    ref = single_process(optimizer, dtype=torch.bfloat16)
    for name, want in ref.items():
        assert saved["params"][name].dtype == torch.bfloat16
        assert torch.equal(saved["params"][name], want.to(torch.bfloat16)), name
    params = dict(make_params(optimizer != "kl_soap", torch.bfloat16))
    for r in range(world):
        counts = torch.load(f"{out}.rank{r}")
        held = sorted(n for n in params if plan[n] in (r, OwnershipPlan.REPLICATED))
        assert counts["masters"] == held
        assert counts["master_bytes"] == 4 * sum(params[n].numel() for n in held)
        others = sum(params[n].numel() for n in params if n not in held)
        assert counts["gather_received"] == STEPS * 2 * others, (r, counts)
    replicated = sum(p.numel() for n, p in params.items() if plan[n] == OwnershipPlan.REPLICATED)
    total = sum(p.numel() for p in params.values())
    assert sum(torch.load(f"{out}.rank{r}")["master_bytes"] for r in range(world)) == 4 * (
        total + (world - 1) * replicated
    )


def test_allgathers_overlap_the_step_and_the_next_forward(tmp_path):
    """Each bucket's all-gather is launched right after its own updates (before the next
    bucket's updates), stays in flight through the rest of the step, and the next forward waits
    for each bucket only just before the layer that uses it."""
    out = tmp_path / "events.json"
    run_torchrun(DIST / "layerwise_overlap.py", 2, str(out))
    rec = json.loads(out.read_text())
    events = [tuple(e) for e in rec["events"]]
    layers = len(rec["owners"])
    assert set(rec["owners"]) == {0, 1}
    forward_1 = [("forward", i) for i in range(layers)]
    assert events[: rec["after_backward"]] == forward_1
    step = events[rec["after_backward"] : rec["after_step"]]
    assert step == [e for i in range(layers) for e in (("update", i), ("launch", i))]
    assert rec["in_flight_after_step"] == [True] * layers
    forward_2 = events[rec["after_step"] :]
    assert forward_2 == [e for i in range(layers) for e in (("wait", i), ("forward", i))]
    assert rec["ranks_agree"]


@pytest.mark.parametrize(
    ("optimizer", "dtype"), [("muon", "fp32"), ("kl_soap", "fp32"), ("muon", "bf16")]
)
def test_name_keyed_state_moves_between_dp_sizes(tmp_path, optimizer, dtype):
    """Save at DP=4, continue at DP=2, then DP=1, then back at DP=4 (2 steps each, plain torch
    format): the parameters equal 8 uninterrupted single-process steps bit for bit, so every
    momentum / KL-SOAP factor and eigenbasis -- and with bf16 parameters every fp32 master --
    reached its new owner intact."""
    previous = "-"
    for i, world in enumerate([4, 2, 1, 4]):
        out = tmp_path / f"leg{i}_dp{world}"
        run_torchrun(
            DIST / "layerwise_elastic.py",
            world,
            optimizer,
            previous,
            str(out),
            str(2 * i),
            "2",
            dtype,
        )
        assert len(list(out.glob("optimizer.*.pt"))) == world
        previous = str(out)
    final = torch.load(tmp_path / "leg3_dp4" / "params.pt")
    bf16 = dtype == "bf16"
    ref = single_process(optimizer, steps=8, dtype=torch.bfloat16 if bf16 else torch.float32)
    for name, want in ref.items():
        assert torch.equal(final[name], want.to(final[name].dtype)), name


def test_state_from_a_different_model_is_refused(tmp_path):
    from megatron_ext.distributed.allgather_v import make_allgather_v
    from megatron_ext.distributed.layerwise import LayerwiseOptimizer

    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(
            "gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1
        )
    try:
        params = make_params(with_experts=False)
        opt = LayerwiseOptimizer(params, "muon", make_allgather_v())
        with pytest.raises(ValueError, match="missing for"):
            opt.load_state_dict({"state": {"embedding.word_embeddings.weight": {}}})
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_gradients_reduce_scatter_to_their_owners(tmp_path, world):
    """Different gradients on every rank: after reduce_grads each owner holds the rank-ordered
    sum bit for bit, and each rank sent only the gradients it does not own and received
    (world - 1) copies of the ones it does (no padding); the element-sharded AdamW's
    reduce_grads leaves each rank's range of every gradient the rank-ordered sum."""
    out = tmp_path / "reduce"
    run_torchrun(DIST / "layerwise_reduce.py", world, str(out))
    results = [json.loads((tmp_path / f"reduce.{r}.json").read_text()) for r in range(world)]
    for r in results:
        assert r["wrong"] == [], r["wrong"]
        assert r["sharded_wrong"] == [], r["sharded_wrong"]
        assert r["owned"] > 0
        assert r["sent"] == r["expected_sent"] and r["received"] == r["expected_received"], r
