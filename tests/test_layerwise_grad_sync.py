"""The layer-wise optimizer's gradient path under megatron-core's DDP (:mod:`megatron_ext.
distributed.grad_sync`): bucketed reduce-scatter-v started from backward, in DDP's own grad
buffer, with buffers allocated once and nothing done at one rank. One torchrun launch per
data-parallel size (tests/dist/layerwise_grad_sync.py) gives every check its figures."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_ext.distributed.grad_sync import GradSync
from tests.conftest import DIST, run_torchrun


@pytest.fixture(scope="module", params=[1, 2], ids=["dp1", "dp2"])
def ranks(request, tmp_path_factory) -> list[dict]:
    world = request.param
    out = tmp_path_factory.mktemp(f"grad_sync_dp{world}") / "run"
    run_torchrun(DIST / "layerwise_grad_sync.py", world, str(out))
    return [json.loads(out.with_name(f"run.{r}.json").read_text()) for r in range(world)]


def test_gradient_sync_starts_before_backward_ends(ranks):
    """Every step, buckets start in descending order as backward completes them, all but the
    one holding the last gradient (the tied word embedding) before backward ends, and each is
    waited for only in finish_grad_sync."""
    for rank in ranks:
        steps = _split(rank["events"])
        assert len(steps) == 3 and rank["buckets"] >= 4, rank["buckets"]
        for events in steps:
            end = events.index(("backward_end", -1))
            launched = [i for what, i in events[:end] if what == "grad_launch"]
            assert launched == list(range(rank["buckets"] - 1, 0, -1)), events
            waits = [i for what, i in events if what == "grad_wait"]
            assert events.index(("grad_wait", waits[0])) > end
            assert sorted(waits) == list(range(-1, rank["buckets"])), events


def test_no_communication_buffer_is_allocated_per_step(ranks):
    """The gradient storage, the receive buffers, the all-gather buffers, every main_grad and
    every parameter keep their addresses from step to step, and the sync's own ops create no
    storage. At DP=2 the parameters live in their buckets' all-gather buffers (gathered in
    place); at DP=1 there is no all-gather buffer at all."""
    for rank in ranks:
        first, *later = rank["pointers"]
        assert all(p == first for p in later), rank["pointers"]
        assert rank["allocations"] == 0, rank["ops"]
        if rank["world"] == 1:
            assert first["gather"] == [] and not any(rank["params_in_buckets"])
        else:
            assert len(first["gather"]) == rank["buckets"] and all(rank["params_in_buckets"])


def test_gradients_accumulate_in_ddp_buffer_and_equal_megatron_cores(ranks):
    """Backward accumulates straight into the send buffers (views of DDP's own grad buffer),
    and after the sync every owned and replicated gradient equals megatron-core DDP's
    all-reduced one bit for bit."""
    for rank in ranks:
        assert rank["inside_ddp"]
        assert rank["equal_to_mcore"] and all(rank["equal_to_mcore"].values()), rank
        assert len(rank["equal_to_mcore"]) > rank["replicated"]  # some owned ones among them


def test_collectives_one_per_bucket_and_one_for_the_replicated(ranks):
    """DP=2: one batched point-to-point exchange per bucket, the replicated gradients (norms)
    in a single all-gather, no all-reduce. DP=1: no collective, no receive buffer and no op
    at all (no copy, no scaling: 1/dp = 1)."""
    for rank in ranks:
        assert rank["replicated"] >= 5
        for calls in rank["calls"]:
            if rank["world"] == 1:
                assert calls == {}, calls
            else:
                want = {"batch_isend_irecv": rank["buckets"], "all_gather_into_tensor": 1}
                assert calls == want, calls
        if rank["world"] == 1:
            assert rank["ops"] == {} and rank["recv_buffers"] == 0, rank["ops"]


def test_sharded_adamw_part_joins_the_same_path(ranks):
    """The AdamW-routed parameters in the element-sharded AdamW beside the matrices (as the GPT
    trainer builds them, small buckets): their buckets' reduce-scatter-v start from backward
    in descending order (all but the word embedding's before backward ends), out of DDP's own
    grad buffer into receive buffers allocated once; the parameters live in their buckets'
    all-gather buffers; the sync allocates nothing, issues one batched exchange per bucket at
    DP=2 and nothing at DP=1; every rank's ranges equal megatron-core's all-reduced gradients
    bit for bit."""
    for rank in ranks:
        sh = rank["sharded"]
        assert sh["buckets"] >= 3 and sh["inside_ddp"], sh["buckets"]
        for events in _split(sh["events"]):
            end = events.index(("backward_end", -1))
            launched = [i for what, i in events[:end] if what == "grad_launch"]
            assert launched == list(range(sh["buckets"] - 1, 0, -1)), events
            waits = [i for what, i in events if what == "grad_wait"]
            assert events.index(("grad_wait", waits[0])) > end
            assert sorted(waits) == [-1, *range(sh["buckets"])], events
        first, *later = sh["pointers"]
        assert all(p == first for p in later), sh["pointers"]
        assert sh["allocations"] == 0, sh["ops"]
        assert sh["equal_to_mcore"] and all(sh["equal_to_mcore"].values()), sh["equal_to_mcore"]
        if rank["world"] == 1:
            assert all(c == {} for c in sh["calls"]) and sh["ops"] == {}, sh
            assert first["gather"] == [] and sh["recv_buffers"] == 0
            assert not any(sh["params_in_buckets"])
        else:
            assert all(c == {"batch_isend_irecv": sh["buckets"]} for c in sh["calls"]), sh
            assert sh["recv_buffers"] == sh["buckets"] == len(first["gather"])
            assert all(sh["params_in_buckets"])


def _split(events: list) -> list[list[tuple[str, int]]]:
    steps: list[list[tuple[str, int]]] = []
    for what, i in events:
        if what == "step":
            steps.append([])
        else:
            steps[-1].append((what, i))
    return steps


def test_a_gradient_reported_twice_in_a_step_is_refused():
    """Several micro-batches without DDP's no_sync would report a gradient complete more than
    once and start its bucket on a partial sum: refused, naming the fix."""
    sync = GradSync([([("a", 4), ("b", 2)], [6])], [("norm", 3)], rank=0, world=1, group=None)
    sync.allocate(torch.float32, torch.device("cpu"))
    sync.grad_ready("a")
    with pytest.raises(RuntimeError, match=r"gradient of a .* no_sync"):
        sync.grad_ready("a")
    sync.grad_ready("b")
    sync.finish()  # a new step starts afresh
    sync.grad_ready("a")
