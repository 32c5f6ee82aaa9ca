"""Run under torchrun (gloo, 2 ranks): how many forward passes megatron-core's interleaved
schedule holds at once on each pipeline rank of a GPT-trainer step, for
``tests/test_virtual_pipeline.py`` (the planner's :func:`megatron_ext.planner.schedule.peak_held`
is the prediction).

The tiny GPT at PP=2 x 2 chunks runs one training step per micro-batch count of
:data:`MICRO_BATCHES`; megatron-core's module-level ``forward_step`` / ``backward_step`` are
wrapped to count the passes whose activations are alive (a forward adds one, its backward
removes it). Rank r writes ``OUT/rank{r}.json``: ``{micro-batches: most passes alive}``.

Usage: interleaved_held.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from tests.dist.planner_measure import model_parallel_groups, trainer_run

MICRO_BATCHES = (2, 4, 6)  # per rank (one data-parallel rank); 2 = all passes in the warmup


def main(out: str) -> None:
    import megatron.core.pipeline_parallel.schedules as schedules
    import torch.distributed as dist

    from megatron_ext.gpt.step import train_step
    from tests.dist.ending import leave

    alive = {"now": 0, "most": 0}
    forward, backward = schedules.forward_step, schedules.backward_step

    def counted_forward(*args: Any, **kwargs: Any) -> Any:
        alive["now"] += 1
        alive["most"] = max(alive["most"], alive["now"])
        return forward(*args, **kwargs)

    def counted_backward(*args: Any, **kwargs: Any) -> Any:
        alive["now"] -= 1
        return backward(*args, **kwargs)

    schedules.forward_step, schedules.backward_step = counted_forward, counted_backward
    got: dict[int, int] = {}
    with model_parallel_groups():
        for micro in MICRO_BATCHES:
            run = trainer_run(
                "tiny_cpu_gpt",
                [
                    "parallel.pipeline_model_parallel_size=2",
                    "parallel.virtual_pipeline_model_parallel_size=2",
                    "model.transformer_config={overlap_p2p_comm: true, batch_p2p_comm: false}",
                    "model.hidden_size=32",
                    "model.ffn_hidden_size=64",
                    "training.seq_length=16",
                    "training.micro_batch_size=1",
                    f"training.global_batch_size={micro}",
                    "training.eval_iters=0",
                    "checkpoint.save_interval=0",
                ],
            )
            alive.update(now=0, most=0)
            train_step(run, 0)
            assert alive["now"] == 0, alive  # every forward's backward ran
            got[micro] = alive["most"]
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(got))
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
