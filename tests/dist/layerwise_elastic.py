"""Run under torchrun (gloo): continue a layer-wise optimizer run from a name-keyed checkpoint
written at any data-parallel size, then save one (plain torch format).

Usage: layerwise_elastic.py OPTIMIZER IN_DIR|- OUT_DIR FIRST_STEP STEPS [fp32|bf16]
Gradients of step s are the same on every rank (seeded by s), as in layerwise_step.py; with bf16
parameters the fp32 masters travel in the optimizer files.
"""

import os
import sys
from pathlib import Path

import torch
from layerwise_step import grads_for, make_params  # same folder (run as a script)

from megatron_ext.distributed.allgather_v import make_allgather_v
from megatron_ext.distributed.layerwise import LayerwiseOptimizer
from tests.dist.ending import leave


def save_named_state(optimizer: LayerwiseOptimizer, folder: str) -> None:
    """Each rank writes the name-keyed state of the parameters it saves (its own, plus the
    replicated ones on rank 0) to ``folder/optimizer.<rank>.pt``."""
    mine = {n: st for n, st in optimizer.named_state().items() if optimizer.saves(n)}
    Path(folder).mkdir(parents=True, exist_ok=True)
    torch.save(
        {"world": optimizer.world, "state": mine}, Path(folder) / f"optimizer.{optimizer.rank}.pt"
    )


def load_named_state_files(optimizer: LayerwiseOptimizer, folder: str) -> None:
    """Merge every rank's file (written at any data-parallel size) and load it."""
    files = sorted(Path(folder).glob("optimizer.*.pt"))
    merged = {}
    for f in files:
        merged.update(torch.load(f, map_location="cpu", weights_only=False)["state"])
    optimizer.load_named_state(merged)


def main(
    optimizer: str, in_dir: str, out_dir: str, first: int, steps: int, dtype: str = "fp32"
) -> None:
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    params = make_params(
        optimizer != "kl_soap", torch.bfloat16 if dtype == "bf16" else torch.float32
    )
    opt = LayerwiseOptimizer(params, optimizer, make_allgather_v(), bucket_numel=3000)
    if in_dir != "-":
        saved = torch.load(Path(in_dir) / "params.pt")
        with torch.no_grad():
            for n, p in params:
                p.copy_(saved[n])
        opt.reload_masters()
        load_named_state_files(opt, in_dir)
    for step in range(first, first + steps):
        opt.set_grads(grads_for(params, step))
        opt.step()
        opt.finish()
    save_named_state(opt, out_dir)
    if opt.rank == 0:
        torch.save({n: p.detach().clone() for n, p in params}, Path(out_dir) / "params.pt")
    leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), *sys.argv[6:])
