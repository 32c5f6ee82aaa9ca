"""Prints, as one JSON line per rank, what a rank sees at start: the launcher's variables, its
argv, path, working directory, thread count, torch's and Python's random state, and a gloo
all-reduce. ``tests/test_warm.py`` compares a warm (forked) rank with a torchrun one."""

import json
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from tests.dist.ending import leave

KEYS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
        "ROLE_WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
        "OMP_NUM_THREADS", "EXTRA")

if __name__ == "__main__":
    if os.environ.get("RANK_FACTS_HANG"):
        time.sleep(600)
    dist.init_process_group("gloo")
    total = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(total)
    facts = {
        "env": {k: os.environ.get(k) for k in KEYS},
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "threads": torch.get_num_threads(),
        "initial_seed": torch.initial_seed(),
        "rand": torch.rand(3).tolist(),
        "py_random": random.random(),
        "sum": total.item(),
        "name": __name__,
    }
    print(json.dumps(facts))
    if sys.argv[1:] == ["fail"] and dist.get_rank() == 1:
        sys.exit(3)
    leave()
