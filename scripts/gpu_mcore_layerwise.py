"""megatron-ext's layer-wise Muon beside megatron-core's own ``LayerWiseDistributedOptimizer`` on
one GPU: the same 144 matrices (the optimizers' reference workload), the same bf16 weights and
the same fp32 gradients, the same Muon (5 Newton-Schulz steps of the (3.4445, -4.7750, 2.0315)
quintic -- megatron-core/Emerging-Optimizers call it ``simple`` -- in fp32, momentum 0.95
without Nesterov, spectral scale, no weight decay, no QKV split, no clipping).

megatron-core's side is built as Megatron-LM builds it: the matrices as parameters of a
``MegatronModule`` in megatron-core's DDP (fp32 gradient buffer), ``get_megatron_optimizer``
with ``optimizer="muon"``, ``use_layer_wise_distributed_optimizer=True`` and bf16 (its bf16 path
wraps the Muon in ``Float16OptimizerWithFloat16Params``, which needs CUDA tensors: why this
cannot run on a CPU host). Ours is :class:`~megatron_ext.distributed.layerwise.LayerwiseOptimizer`
over the same parameters. Writes one JSON: seconds per step (median of ``--steps`` after
``--warmup``, CUDA-synchronised), and how far the two first updates are apart
(``||W_ours - W_mcore|| / ||W_ours - W_0||`` over all matrices, bf16 weights).

Usage: python -m torch.distributed.run --standalone --nproc-per-node 1
    scripts/gpu_mcore_layerwise.py --out OUT.json [--steps 5] [--warmup 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

LR = 0.02


def workload(device: torch.device) -> tuple[list[tuple[str, torch.Tensor]], list[torch.Tensor]]:
    """The reference workload's named bf16 weights and fp32 gradients (seeded, drawn on CPU)."""
    from megatron_ext.bench._layerwise_worker import workload_names

    gen = torch.Generator().manual_seed(0)
    named = workload_names()
    weights = [(n, (torch.randn(s, generator=gen) * 0.02).bfloat16().to(device)) for n, s in named]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for _, s in named]
    return weights, grads


def timed(step: Any, steps: int, warmup: int) -> list[float]:
    times = []
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def megatron_core_side(weights, grads, steps: int, warmup: int) -> tuple[dict, list[torch.Tensor]]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import MegatronModule
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=4,
        hidden_size=512,
        num_attention_heads=8,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
    )

    class Matrices(MegatronModule):
        """The workload's matrices as parameters (flat names: no QKV or embedding routing)."""

        def __init__(self) -> None:
            super().__init__(config)
            self.weights = torch.nn.ParameterList(
                [torch.nn.Parameter(w.clone()) for _, w in weights]
            )

    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        Matrices(),
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="muon",
            lr=LR,
            min_lr=LR,
            weight_decay=0.0,
            clip_grad=0.0,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=False,
            use_layer_wise_distributed_optimizer=True,
            muon_momentum=0.95,
            muon_nesterov=False,
            muon_split_qkv=False,
            muon_scale_mode="spectral",
            muon_fp32_matmul_prec="highest",
            muon_coefficient_type="simple",
            muon_num_ns_steps=5,
        ),
        [model],
    )
    params = list(model.module.weights)

    def step() -> None:
        for p, (_, g) in zip(params, grads, strict=True):
            p.main_grad.copy_(g)
        opt.step()

    step()  # the first update, compared below
    first = [p.detach().clone() for p in params]
    times = timed(step, steps, warmup)
    return {
        "s_per_step": statistics.median(times),
        "times": times,
        "kind": type(opt).__name__,
    }, first


def megatron_ext_side(weights, grads, steps: int, warmup: int) -> tuple[dict, list[torch.Tensor]]:
    from megatron_ext.distributed.allgather_v import make_allgather_v
    from megatron_ext.distributed.layerwise import LayerwiseOptimizer

    params = [(n, torch.nn.Parameter(w.clone())) for n, w in weights]
    hp = {
        "muon": {
            "lr": LR,
            "momentum": 0.95,
            "nesterov": False,
            "coefficients": "quintic",
            "num_steps": 5,
            "scale_mode": "spectral",
            "weight_decay": 0.0,
        }
    }
    opt = LayerwiseOptimizer(params, "muon", make_allgather_v(), hyperparameters=hp)

    def step() -> None:
        opt.set_grads({n: g for (n, _), g in zip(params, grads, strict=True)})
        opt.step()
        opt.finish()

    step()
    first = [p.detach().clone() for _, p in params]
    times = timed(step, steps, warmup)
    return {"s_per_step": statistics.median(times), "times": times}, first


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl")
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    weights, grads = workload(device)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "matrices": len(weights),
        "parameters": sum(w.numel() for _, w in weights),
        "precision": "bf16 weights, fp32 masters and gradients",
    }
    ours, ours_first = megatron_ext_side(weights, grads, args.steps, args.warmup)
    report["megatron_ext"] = ours
    try:
        theirs, theirs_first = megatron_core_side(weights, grads, args.steps, args.warmup)
    except Exception as exc:  # recorded, not hidden: the JSON says why there is no comparison
        report["megatron_core"] = {"error": f"{type(exc).__name__}: {exc}"}
    else:
        report["megatron_core"] = theirs
        report["ratio_ours_over_mcore"] = ours["s_per_step"] / theirs["s_per_step"]
        w0 = [w.float() for _, w in weights]
        num = sum(
            float((a.float() - b.float()).norm() ** 2)
            for a, b in zip(ours_first, theirs_first, strict=True)
        )
        den = sum(float((a.float() - w).norm() ** 2) for a, w in zip(ours_first, w0, strict=True))
        report["first_update_rel_diff"] = (num / den) ** 0.5 if den else None
    Path(args.out).write_text(json.dumps(report, indent=1), encoding="utf-8")
    print(
        json.dumps({k: v for k, v in report.items() if k not in ("megatron_ext", "megatron_core")})
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
