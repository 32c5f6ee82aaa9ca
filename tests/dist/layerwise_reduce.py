"""Run under torchrun (gloo): the layer-wise optimizer's gradient reduce-scatter-v.

Every rank has different gradients; after ``reduce_grads`` each owned (and replicated) gradient
must equal the sum over ranks added in rank order, bit for bit, computed here from every rank's
regenerated gradients; the same for the element-sharded AdamW (``ShardedAdamW.reduce_grads``,
small buckets): each rank's range of every parameter. Writes ``OUT.<rank>.json`` with the
checks and the byte counters.

Usage: layerwise_reduce.py OUT
"""

import json
import sys

import torch
from layerwise_step import make_params  # same folder (run as a script)

from megatron_ext.distributed.allgather_v import make_allgather_v
from megatron_ext.distributed.layerwise import LayerwiseOptimizer
from megatron_ext.distributed.plan import OwnershipPlan
from megatron_ext.distributed.sharded_adam import ShardedAdamW
from tests.dist.ending import leave


def grads_of(rank: int, params) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(77 + rank)
    return {n: torch.randn(p.shape, generator=gen) for n, p in params}


def sharded_wrong(params, every: list[dict[str, torch.Tensor]], rank: int) -> list[str]:
    """Names whose range on this rank is not the rank-ordered sum after ShardedAdamW's
    reduce_grads (fresh parameters and gradients: the layer-wise run above moved its own)."""
    fresh = [(n, torch.nn.Parameter(p.detach().clone())) for n, p in params]
    adam = ShardedAdamW(fresh, torch.optim.AdamW, make_allgather_v(), bucket_numel=5000)
    grads = {n: g.clone() for n, g in every[rank].items()}
    adam.reduce_grads(grads)
    wrong = []
    for name, _ in fresh:
        lo, hi = adam.flat_range(name)
        want = every[0][name].reshape(-1)[lo:hi].clone()
        for r in range(1, len(every)):
            want += every[r][name].reshape(-1)[lo:hi]
        if not torch.equal(grads[name].reshape(-1)[lo:hi], want):
            wrong.append(name)
    return wrong


def main(out: str) -> None:
    torch.distributed.init_process_group("gloo")
    params = make_params(with_experts=True)
    opt = LayerwiseOptimizer(params, "muon", make_allgather_v(), bucket_numel=3000)
    mine = grads_of(opt.rank, params)
    opt.reduce_grads(mine)
    every = [grads_of(r, params) for r in range(opt.world)]
    wrong = []
    for name, _ in params:
        if opt.plan.owner[name] not in (opt.rank, OwnershipPlan.REPLICATED):
            continue
        want = every[0][name].clone()
        for r in range(1, opt.world):
            want += every[r][name]
        exact = opt.plan.owner[name] != OwnershipPlan.REPLICATED  # all-reduce: backend's order
        ok = torch.equal(mine[name], want) if exact else torch.allclose(mine[name], want)
        if not ok:
            wrong.append(name)
    nbytes = {n: p.numel() * 4 for n, p in params if opt.plan.owner[n] != OwnershipPlan.REPLICATED}
    owned = sum(b for n, b in nbytes.items() if opt.plan.owner[n] == opt.rank)
    result = {
        "wrong": wrong,
        "sharded_wrong": sharded_wrong(params, every, opt.rank),
        "sent": opt.grad_wire.sent,
        "received": opt.grad_wire.received,
        "expected_sent": sum(nbytes.values()) - owned,
        "expected_received": (opt.world - 1) * owned,
        "owned": owned,
    }
    with open(f"{out}.{opt.rank}.json", "w") as f:
        json.dump(result, f)
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
