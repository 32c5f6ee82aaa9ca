"""Run under torchrun (gloo): the GPT trainer with ``optimizer.decoupled_lr`` against
megatron-core's own parameter groups and LR scheduler, for ``tests/test_decoupled_lr.py``.

For each optimizer in ``OPTIMIZERS`` (AdamW: element-sharded AdamW alone; Muon: the layer-wise
optimizer with AdamW beside it) the tiny GPT (2 layers, untied embeddings, synthetic tokens)
trains :data:`STEPS` steps, and per step the LR each of its parameter groups was given is
recorded. The reference is megatron-core's: ``_get_param_groups`` over the same model with
``get_standard_config_overrides`` of an ``OptimizerConfig`` carrying the same LRs (the groups
Megatron-LM's ``get_megatron_optimizer`` builds), stepped by megatron-core's
``OptimizerParamScheduler`` in samples as Megatron-LM's ``get_optimizer_param_scheduler`` sets
it up from iterations (positions times the global batch).

Writes ``OUT/decoupled.json`` (rank 0): {optimizer: {"ours": {...}, "theirs": {...},
"losses": [...]}}, each side {"decoupled": [LR per step], "other": [LR per step], "names":
[the parameters in its decoupled group(s)]}.

Usage: decoupled_lr_check.py OUT
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from tests.dist.planner_measure import model_parallel_groups, trainer_run

STEPS = 5
BATCH = 4  # global batch (sequences)
LR, MIN_LR, DECOUPLED_LR, DECOUPLED_MIN_LR = 3e-3, 3e-4, 8e-4, 5e-5
WARMUP, WSD, DECAY = 1, 2, STEPS - 1  # steps: the last step is at the decoupled floor
OVERRIDES = [
    "model.num_layers=2",
    "model.hidden_size=64",
    "model.ffn_hidden_size=128",
    "training.eval_iters=0",
    "checkpoint.save_interval=0",
    "training.seq_length=16",
    "training.micro_batch_size=2",
    f"training.global_batch_size={BATCH}",
    f"training.steps={STEPS}",
    f"training.lr_warmup_steps={WARMUP}",
    f"training.lr_wsd_decay_steps={WSD}",
    f"training.lr_decay_steps={DECAY}",
    f"optimizer.lr={LR}",
    f"optimizer.min_lr={MIN_LR}",
    f"optimizer.decoupled_lr={DECOUPLED_LR}",
    f"optimizer.decoupled_min_lr={DECOUPLED_MIN_LR}",
]
OPTIMIZERS = ("adamw", "muon")


def ours(optimizer: str) -> dict[str, Any]:
    """The trainer's run: the LR of its decoupled and other groups at each step."""
    import torch.distributed as dist

    from megatron_ext.gpt.step import train_step

    run = trainer_run("tiny_cpu_gpt", [*OVERRIDES, f"optimizer.name={optimizer}"])
    inner = run.optimizer.optimizer
    parts = list(getattr(inner, "parts", [inner]))
    names = set()
    for part in parts:
        masters = getattr(part, "masters", {})
        for group in part.param_groups:
            if group.get("is_decoupled_lr"):
                held = {id(p) for p in group["params"]}
                names |= {n for n, m in masters.items() if id(m) in held}
    out: dict[str, Any] = {"decoupled": [], "other": [], "losses": []}
    for step in range(STEPS):
        result = train_step(run, step)
        assert result.success
        out["losses"].append(result.loss)
        lrs = {bool(g.get("is_decoupled_lr")): g["lr"] for g in run.optimizer.param_groups}
        out["decoupled"].append(lrs.get(True))
        out["other"].append(lrs[False])
    # every rank's element-sharded AdamW holds ranges of some parameters: the union
    held: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(held, sorted(names))
    out["names"] = sorted({n for rank in held for n in rank})
    out["model"] = run.chunks[0].module
    return out


class _Groups:
    """What megatron-core's scheduler touches of an optimizer: its parameter groups."""

    def __init__(self, groups: list[dict[str, Any]]) -> None:
        self.param_groups = groups


def theirs(model: Any) -> dict[str, Any]:
    """megatron-core's param groups of ``model`` and its scheduler's LR for them per step."""
    from megatron.core.optimizer import (
        OptimizerConfig,
        _get_param_groups,
        get_standard_config_overrides,
    )
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        lr=LR, min_lr=MIN_LR, decoupled_lr=DECOUPLED_LR, decoupled_min_lr=DECOUPLED_MIN_LR
    )
    groups = _get_param_groups([model], config, get_standard_config_overrides(config))
    named = {id(p): n for n, p in model.named_parameters()}
    scheduler = OptimizerParamScheduler(
        _Groups(groups),
        init_lr=0.0,
        max_lr=LR,
        min_lr=MIN_LR,
        lr_warmup_steps=WARMUP * BATCH,
        lr_decay_steps=DECAY * BATCH,
        lr_decay_style="WSD",
        start_wd=0.1,
        end_wd=0.1,
        wd_incr_steps=STEPS * BATCH,
        wd_incr_style="constant",
        wsd_decay_steps=WSD * BATCH,
        lr_wsd_decay_style="minus_sqrt",
    )
    decoupled = [g for g in groups if g["max_lr"] == DECOUPLED_LR]
    other = [g for g in groups if g["max_lr"] == LR]
    out: dict[str, Any] = {"decoupled": [], "other": []}
    for step in range(STEPS):
        # Megatron-LM's loop: the rate of iteration k is set after k iterations' samples
        scheduler.num_steps = 0
        scheduler.step(step * BATCH)
        out["decoupled"].append(sorted({g["lr"] for g in decoupled}))
        out["other"].append(sorted({g["lr"] for g in other}))
    out["names"] = sorted(named[id(p)] for g in decoupled for p in g["params"])
    return out


def main() -> None:
    import torch.distributed as dist

    start = time.perf_counter()
    got: dict[str, Any] = {"seconds": 0.0}
    with model_parallel_groups():
        for optimizer in OPTIMIZERS:
            mine = ours(optimizer)
            model = mine.pop("model")
            got[optimizer] = {"ours": mine, "theirs": theirs(model)}
    got["seconds"] = time.perf_counter() - start
    if dist.get_rank() == 0:
        Path(sys.argv[1], "decoupled.json").write_text(json.dumps(got))


if __name__ == "__main__":
    main()
