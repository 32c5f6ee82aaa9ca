"""megatron-core's ``OptimizerParamScheduler`` as a reference: its learning rate at given steps."""

from __future__ import annotations

from collections.abc import Iterable


def megatron_core_lrs(
    steps: Iterable[int], *, max_lr: float, min_lr: float, warmup: int, decay: int, style: str
) -> dict[int, float]:
    """{step: lr} of megatron-core's scheduler (init_lr 0, constant weight decay), ``steps``
    ascending; step 0 is what its constructor applies, each ``step(n)`` then advances by n."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class Groups:  # all the scheduler touches
        def __init__(self) -> None:
            self.param_groups: list[dict] = [{}]

    groups = Groups()
    scheduler = OptimizerParamScheduler(
        groups,
        init_lr=0.0,
        max_lr=max_lr,
        min_lr=min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=decay,
        lr_decay_style=style,
        start_wd=0.0,
        end_wd=0.0,
        wd_incr_steps=decay,
        wd_incr_style="constant",
    )
    out, done = {}, 0
    for step in steps:
        scheduler.step(step - done)
        done = step
        out[step] = groups.param_groups[0]["lr"]
    return out
