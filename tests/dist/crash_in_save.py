"""``megatron-ext train`` that dies (os._exit, like a node failure) right after writing the
files of checkpoint ``CRASH_AT_STEP`` and before that checkpoint is committed.

Usage (under torchrun): crash_in_save.py RECIPE [key=value ...]
"""

import os
import sys

import psutil

import megatron_ext.gpt.checkpoint as ckpt
from megatron_ext.launch.cli import main

_real_save = ckpt.dist_checkpointing.save


def _save_then_die(state, path, *args, **kwargs):
    result = _real_save(state, path, *args, **kwargs)
    if f"step_{int(os.environ['CRASH_AT_STEP']):06d}" in os.path.basename(path):
        # A node failure takes the rank's helper processes (the checkpoint writer) with it.
        for child in psutil.Process().children(recursive=True):
            child.kill()
        os._exit(17)
    return result


# Guarded: dist_checkpointing's writer starts helper processes that re-import __main__.
if __name__ == "__main__":
    ckpt.dist_checkpointing.save = _save_then_die
    sys.exit(main(["train", *sys.argv[1:]]))
