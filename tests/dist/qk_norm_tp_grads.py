"""Run under torchrun (gloo, 2 ranks): OLMoE's projection q/k norm at TP=2 against TP=1.

For each layout, TP=1 (two data-parallel replicas, each half of the batch) then TP=2 (one
replica, the whole batch), every rank builds the same GPT model with
:func:`megatron_ext.megatron.model.build_gpt_model` (megatron-core initialises the whole weight
and keeps this rank's shard, so both layouts start from the same model), gives the q/k norms
the same non-uniform weights, runs one training forward/backward of one fixed global batch
through megatron-core's schedule and DDP (``finalize_model_grads`` included, as the GPT trainer
does), and asks the optimizer adapter for the global gradient norm (what the trainer logs).
Each rank then writes a checkpoint with the trainer's :func:`save_checkpoint` and reloads it.

Rank 0 writes ``OUT`` (JSON) as each layout's figures are known: ``{"tp1"|"tp2": {"grad_norm":
float, "grad_squares": {name: squared norm of the whole gradient (TP shards summed over the TP
group, TP duplicates once)}}}``, and for TP=2 ``"reloaded"``: the checkpoint was written and
read back into the same weights (a failed save exits non-zero after the gradient figures).

Usage: qk_norm_tp_grads.py OUT.json CKPT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

VOCAB, SEQ, GLOBAL_BATCH = 100, 16, 4
MODEL: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "ffn_hidden_size": 64,
    "qk_layernorm": True,
    "qk_layernorm_scope": "projection",
    "transformer_impl": "local",
    "make_vocab_size_divisible_by": 64,
}


def batch(dp_rank: int, dp_size: int) -> dict[str, torch.Tensor]:
    """This data-parallel rank's contiguous slice of one fixed global batch."""
    gen = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=gen)
    rows = slice(dp_rank * GLOBAL_BATCH // dp_size, (dp_rank + 1) * GLOBAL_BATCH // dp_size)
    return {
        "tokens": tokens[rows, :-1],
        "labels": tokens[rows, 1:],
        "loss_mask": torch.ones(GLOBAL_BATCH // dp_size, SEQ),
        "position_ids": torch.arange(SEQ).expand(GLOBAL_BATCH // dp_size, SEQ),
    }


def projection_norm_weights(module: torch.nn.Module) -> dict[str, tuple[torch.Tensor, int]]:
    """Each projection q/k norm weight and the width of the whole vector across TP ranks (read
    from the norm, not from the parameter's tensor-parallel marks, which the test checks)."""
    from megatron_ext.megatron.qk_norm import _ProjectionRMSNorm

    return {
        f"{name}.weight": (m.weight, m.full_width)
        for name, m in module.named_modules()
        if isinstance(m, _ProjectionRMSNorm)
    }


def is_tp_shard(name: str, p: torch.Tensor, norms: dict[str, tuple[torch.Tensor, int]]) -> bool:
    """Whether ``p`` holds a part of a tensor split over the TP group."""
    if name in norms:
        return p.numel() < norms[name][1]
    return bool(getattr(p, "tensor_model_parallel", False))


def set_norm_weights(module: torch.nn.Module) -> None:
    """Every projection q/k norm weight from a generator seeded by its name's position: the whole
    vector is drawn and this rank keeps the part it holds (its TP rank's slice of a shard)."""
    from megatron.core import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for i, (p, width) in enumerate(projection_norm_weights(module).values()):
            full = torch.rand(width, generator=torch.Generator().manual_seed(100 + i)) + 0.5
            p.copy_(full if p.numel() == width else full.reshape(-1, p.numel())[rank])


def grad_squares(module: torch.nn.Module) -> dict[str, float]:
    """Per parameter, the squared L2 norm of its whole gradient: TP shards summed over the TP
    group, TP duplicates taken once."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    norms = projection_norm_weights(module)
    out = {}
    for name, p in module.named_parameters():
        sq = p.main_grad.double().pow(2).sum().reshape(1)
        if is_tp_shard(name, p, norms):
            dist.all_reduce(sq, group=parallel_state.get_tensor_model_parallel_group())
        out[name] = float(sq)
    return out


def write(out: Path, tp: int, result: dict[str, Any]) -> None:
    """Rank 0 adds layout ``tp``'s figures to ``out``."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        done = json.loads(out.read_text()) if out.exists() else {}
        out.write_text(json.dumps({**done, f"tp{tp}": result}))


def run_layout(tp: int, out: Path, ckpt_dir: Path) -> None:
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.config.optimizer import OptimizerConfig
    from megatron_ext.gpt.checkpoint import load_checkpoint, save_checkpoint
    from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
    from megatron_ext.gpt.step import forward_step
    from megatron_ext.megatron.model import build_gpt_model
    from megatron_ext.megatron.optimizer import MegatronExtOptimizer
    from megatron_ext.megatron.optimizer_factories import inner_factory, megatron_optimizer_config

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    module = build_gpt_model(
        ModelConfig(**MODEL), ParallelConfig(tensor_model_parallel_size=tp), "fp32", VOCAB, SEQ
    )
    set_norm_weights(module)
    config = module.config
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        module,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    model.zero_grad_buffer()
    get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([batch(dp_rank, dp_size)]),
        model=[model],
        num_microbatches=1,
        seq_length=SEQ,
        micro_batch_size=GLOBAL_BATCH // dp_size,
        forward_only=False,
    )
    cfg = OptimizerConfig(name="adamw", lr=1e-3)
    optimizer = MegatronExtOptimizer(
        list(module.named_parameters()), inner_factory(cfg), megatron_optimizer_config(cfg, False)
    )
    optimizer.prepare_grads()
    result: dict[str, Any] = {
        "grad_norm": optimizer.get_grad_norm(),
        "grad_squares": grad_squares(module),
    }
    if tp > 1:  # the trainer's checkpoint of this layout, written and read back
        optimizer.step()
        loop = {"step": 1, "consumed_samples": GLOBAL_BATCH}
        write(out, tp, result)  # the gradient figures, whatever the save does
        path = save_checkpoint(ckpt_dir, 1, model, optimizer, loop, keep_last=1)
        weights = {n: p.detach().clone() for n, p in module.named_parameters()}
        for p in module.parameters():
            p.data.zero_()
        load_checkpoint(path, model, optimizer)
        result["reloaded"] = all(torch.equal(p, weights[n]) for n, p in module.named_parameters())
    write(out, tp, result)
    parallel_state.destroy_model_parallel()


def main(out: str, ckpt_dir: str) -> None:
    import torch.distributed as dist

    from megatron_ext.megatron.cpu_compat import apply_cpu_compat
    from tests.dist.ending import leave

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    apply_cpu_compat()
    for tp in (1, 2):
        run_layout(tp, Path(out), Path(ckpt_dir))
    leave()


if __name__ == "__main__":
    main(*sys.argv[1:])
