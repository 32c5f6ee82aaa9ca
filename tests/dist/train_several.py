"""Several ``megatron-ext train`` runs one after another in the same ranks and process groups
(one torchrun start for all of them): each argument group, separated by ``--``, is
``RECIPE [key=value ...]``; the groups are torn down after the last run.

Usage (under torchrun): train_several.py RECIPE [key=value ...] -- RECIPE [key=value ...] ...
"""

import sys

import megatron_ext.run.distributed as run_distributed
from megatron_ext.run.entry import train_main

# Guarded: dist_checkpointing's writer starts helper processes that re-import __main__.
if __name__ == "__main__":
    runs, current = [], []
    for arg in sys.argv[1:]:
        if arg == "--":
            runs.append(current)
            current = []
        else:
            current.append(arg)
    runs.append(current)
    teardown = run_distributed.destroy_process_groups
    run_distributed.destroy_process_groups = lambda: None  # the same groups for every run
    try:
        for recipe, *overrides in runs:
            code = train_main(recipe, overrides)
            if code:
                sys.exit(code)
    finally:
        teardown()
