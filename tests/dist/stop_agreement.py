"""Two gloo ranks: only rank 1 catches a stop signal, yet StopPolicy.check gives both ranks the
same reason, while the local answers differ. Prints one JSON line per rank.

Usage (under torchrun): stop_agreement.py
"""

import json
import os
import signal

import torch.distributed as dist

from megatron_ext.run.stopping import StopPolicy
from tests.dist.ending import leave

if __name__ == "__main__":
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    stop = StopPolicy(["SIGUSR1"])
    before = stop.check(1)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
    dist.barrier()
    local, agreed = stop.requested(2), stop.check(2)
    stop.uninstall()
    print(json.dumps({"rank": rank, "before": before, "local": local, "agreed": agreed}))
    leave()
