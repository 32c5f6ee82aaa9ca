"""Run under torchrun (gloo, 2 ranks): verify_replicas accepts identical replicas and names the
parameter when one rank's copy differs in a single bit. Usage: replica_check.py OUT.json"""

import json
import sys

import torch
from megatron.core import parallel_state

from megatron_ext.gpt.checkpoint import verify_replicas
from tests.dist.ending import leave


def main(out: str) -> None:
    torch.distributed.init_process_group("gloo")
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
    verify_replicas(model)  # identical: must pass
    rank = torch.distributed.get_rank()
    if rank == 1:  # flip the lowest mantissa bit of one element
        with torch.no_grad():
            bits = model[1].weight.view(torch.int32)
            bits[3] ^= 1
    try:
        verify_replicas(model)
        message = None
    except RuntimeError as exc:
        message = str(exc)
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"message": message}, f)
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
