"""Run under torchrun (gloo): a few steps of the layer-wise optimizer with identical gradients
on every rank; rank 0 saves the resulting parameters (every rank checks they agree) and every
rank its fp32-master and all-gather byte counts.

Usage: layerwise_step.py OPTIMIZER OUT.pt [fp32|bf16]
"""

import os
import sys

import torch

from megatron_ext.distributed.allgather_v import make_allgather_v
from megatron_ext.distributed.layerwise import LayerwiseOptimizer
from tests.dist.ending import leave

STEPS = 3


def make_params(
    with_experts: bool, dtype: torch.dtype = torch.float32
) -> list[tuple[str, torch.nn.Parameter]]:
    """A miniature GPT's parameters in forward order, identical on every rank."""
    gen = torch.Generator().manual_seed(0)
    shapes = [("embedding.word_embeddings.weight", (50, 32))]
    for layer in range(2):
        pre = f"decoder.layers.{layer}"
        shapes += [
            (f"{pre}.input_layernorm.weight", (32,)),
            (f"{pre}.self_attention.linear_qkv.weight", (48, 32)),
            (f"{pre}.self_attention.linear_proj.weight", (32, 32)),
            (f"{pre}.pre_mlp_layernorm.weight", (32,)),
            (f"{pre}.mlp.linear_fc1.weight", (64, 32)),
            (f"{pre}.mlp.linear_fc2.weight", (32, 64)),
        ]
        if with_experts:
            shapes += [
                (f"{pre}.mlp.experts.linear_fc1.weight", (4, 16, 32)),
                (f"{pre}.mlp.experts.linear_fc2.weight", (4, 32, 16)),
            ]
    shapes += [("decoder.final_layernorm.weight", (32,)), ("output_layer.weight", (50, 32))]
    return [
        (n, torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype))) for n, s in shapes
    ]


def grads_for(params: list[tuple[str, torch.nn.Parameter]], step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s fp32 gradients (as DDP's fp32 ``main_grad`` would hold them)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=gen) * 0.01 for n, p in params}


def set_grads(params: list[tuple[str, torch.nn.Parameter]], step: int) -> None:
    for (_, p), g in zip(params, grads_for(params, step).values(), strict=True):
        p.grad = g


def main(optimizer: str, out: str, dtype: str = "fp32") -> None:
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    params = make_params(
        optimizer != "kl_soap", torch.bfloat16 if dtype == "bf16" else torch.float32
    )
    # Small buckets so that several all-gathers are in flight at once.
    gather = make_allgather_v()
    opt = LayerwiseOptimizer(params, optimizer, gather, bucket_numel=3000)
    for step in range(STEPS):
        opt.set_grads(grads_for(params, step))
        opt.step()
        opt.finish()
    flat = torch.cat([p.detach().reshape(-1) for _, p in params])
    gathered = [torch.empty_like(flat) for _ in range(opt.world)]
    torch.distributed.all_gather(gathered, flat)
    if not all(torch.equal(g, flat) for g in gathered):
        raise SystemExit("ranks disagree on the parameters after the layer-wise step")
    counts = {
        "master_bytes": opt.master_bytes(),
        "masters": sorted(n for n, m in opt.masters.items() if m.dtype != flat.dtype),
        "gather_sent": gather.stats.sent,
        "gather_received": gather.stats.received,
    }
    torch.save(counts, f"{out}.rank{opt.rank}")
    torch.distributed.barrier()  # leave together (see layerwise_elastic.py)
    if opt.rank == 0:
        torch.save(
            {
                "params": {n: p.detach().clone() for n, p in params},
                "buckets": len(opt.buckets),
                "plan": opt.plan.owner,
            },
            out,
        )
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:])
