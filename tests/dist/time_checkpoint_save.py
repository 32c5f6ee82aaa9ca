"""Time every checkpoint save of a GPT run and the manifest part of it (hashing the files and
writing manifest.json), for the README's figures. Prints one JSON line on rank 0.

Usage (under torchrun): time_checkpoint_save.py RECIPE [key=value ...]
e.g. python -m torch.distributed.run --standalone --nproc-per-node 2 \\
     tests/dist/time_checkpoint_save.py tiny_cpu_gpt run_dir=/tmp/t training.steps=3 \\
     checkpoint.save_interval=1 training.eval_iters=0 training.lr_warmup_steps=1 \\
     training.lr_wsd_decay_steps=1
"""

import json
import os
import sys
import time

import torch.distributed as dist

import megatron_ext.gpt.checkpoint as ckpt
from megatron_ext.run.entry import train_main

saves: list[dict] = []
_save, _manifest = ckpt.dist_checkpointing.save, ckpt.write_manifest_collectively


def timed_save(*args, **kwargs):
    dist.barrier()
    t0 = time.perf_counter()
    result = _save(*args, **kwargs)
    dist.barrier()
    saves.append({"save_s": time.perf_counter() - t0})
    return result


def timed_manifest(folder, **kwargs):
    t0 = time.perf_counter()
    _manifest(folder, **kwargs)
    saves[-1]["manifest_s"] = time.perf_counter() - t0
    if dist.get_rank() == 0:
        saves[-1]["bytes"] = json.loads((folder / "manifest.json").read_text())["bytes"]


# Guarded: dist_checkpointing's writer starts helper processes that re-import __main__.
if __name__ == "__main__":
    ckpt.dist_checkpointing.save, ckpt.write_manifest_collectively = timed_save, timed_manifest
    code = train_main(sys.argv[1], sys.argv[2:])
    if os.environ.get("RANK") == "0":
        print(json.dumps({"saves": saves}))
    sys.exit(code)
