"""Run under torchrun (or alone): one forward/backward of a megatron-core GPTModel wrapped in
megatron-core DDP on CPU/gloo; rank 0 saves the synchronised gradients.

Each rank takes its contiguous slice of one fixed global batch, so a 1-rank run on the whole
batch is the reference for a 2-rank run.  ``moe_ep2`` splits the 4 experts over 2 ranks (expert
parallelism, alltoall dispatch); every weight is then re-initialised from its *global* name so
the split model equals the unsplit one, and each rank saves its own gradients (``OUT.rank<r>``).
Usage: ddp_grads.py OUT.pt dense|moe|moe_ep2
"""

import os
import re
import sys
import zlib

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
from megatron_ext.megatron.model import build_gpt_model
from megatron_ext.megatron.parallel import init_distributed
from tests.dist.ending import leave

GLOBAL_BATCH, SEQ, VOCAB = 4, 16, 64


def global_name(name: str) -> str:
    """Local expert index -> global expert index (experts are split evenly over EP ranks)."""
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    local = 4 // parallel_state.get_expert_model_parallel_world_size()
    return re.sub(
        r"local_experts\.(\d+)\.",
        lambda m: f"local_experts.{ep_rank * local + int(m.group(1))}.",
        name,
    )


def reinit_by_global_name(module: torch.nn.Module) -> None:
    """Weights drawn from a generator seeded by the parameter's global name."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(global_name(name).encode()))
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05 + (1.0 if p.ndim == 1 else 0.0))


def main(out: str, kind: str) -> None:
    torch.set_num_threads(1)
    # moe_ep2 on one rank is the unsplit reference (EP=1) with the same global-name init.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    parallel = ParallelConfig(
        expert_model_parallel_size=2 if kind == "moe_ep2" and world > 1 else 1
    )
    env = init_distributed(parallel, seed=7, master_port=int(os.environ.get("MASTER_PORT", 29501)))
    model_cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=1,
    )
    if kind in ("moe", "moe_ep2"):
        model_cfg.num_moe_experts = 4
        model_cfg.moe_router_topk = 2
        model_cfg.moe_ffn_hidden_size = 32
        model_cfg.moe_router_score_function = "sigmoid"
        model_cfg.moe_router_enable_expert_bias = True
    module = build_gpt_model(model_cfg, parallel, "fp32", vocab_size=VOCAB, seq_length=SEQ)
    if kind == "moe_ep2":
        reinit_by_global_name(module)
    model = DistributedDataParallel(
        module.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), module
    )

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    per_rank = GLOBAL_BATCH // parallel_state.get_data_parallel_world_size()
    dp_rank = parallel_state.get_data_parallel_rank()
    mine = tokens[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    position_ids = torch.arange(SEQ).expand(per_rank, SEQ)
    losses = model(mine[:, :-1], position_ids, None, labels=mine[:, 1:])
    losses.mean().backward()
    model.finish_grad_sync()
    if kind == "moe_ep2":
        grads = {global_name(n): p.main_grad.clone() for n, p in model.module.named_parameters()}
        torch.save(
            {
                "grads": grads,
                "world": env.world_size,
                "dp": parallel_state.get_data_parallel_world_size(),
            },
            f"{out}.rank{env.rank}",
        )
    elif env.rank == 0:
        grads = {n: p.main_grad.clone() for n, p in model.module.named_parameters()}
        torch.save(
            {
                "grads": grads,
                "world": env.world_size,
                "dp": parallel_state.get_data_parallel_world_size(),
            },
            out,
        )
    leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
