"""Run the SOMA trainer on this rank (torchrun), optionally counting collective calls made while
the experts train (FSO must make none). Usage: soma_run.py RECIPE COUNT_FILE [overrides...]."""

from __future__ import annotations

import json
import os
import sys
from tests.dist.ending import leave


def main() -> None:
    recipe_path, count_file, *overrides = sys.argv[1:]
    import torch.distributed as dist

    from megatron_ext.config import load_recipe
    from megatron_ext.soma import trainer

    calls: list[str] = []
    names = [
        n
        for n in (
            "all_reduce",
            "all_gather",
            "all_gather_into_tensor",
            "all_gather_object",
            "broadcast",
            "broadcast_object_list",
            "reduce",
            "reduce_scatter",
            "barrier",
            "send",
            "recv",
            "isend",
            "irecv",
            "all_to_all",
            "all_to_all_single",
            "scatter",
            "gather",
        )
        if hasattr(dist, n)
    ]
    originals = {n: getattr(dist, n) for n in names}
    inner = trainer._expert_run

    def counted(*args, **kwargs):
        def wrap(n):
            def f(*a, **k):
                calls.append(n)
                return originals[n](*a, **k)

            return f

        for n in names:
            setattr(dist, n, wrap(n))
        try:
            return inner(*args, **kwargs)
        finally:
            for n in names:
                setattr(dist, n, originals[n])

    trainer._expert_run = counted
    recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    trainer.train(recipe)
    rank = dist.get_rank() if dist.is_initialized() else 0
    with open(f"{count_file}.{rank}", "w") as f:
        json.dump(calls, f)
    leave()


if __name__ == "__main__":
    main()
