"""The schedule a user sees before spending cluster time: the stage table and ``schedule.png``.

``megatron-ext launch RECIPE --dry-run`` prints :func:`describe_schedule`'s text: one row per
batch stage (from step, from token, global batch, micro-batches per data-parallel rank, tokens
per step, the learning rate at the stage's first step) and the token positions of the warmup's
end and of the decay; with ``--schedule-png PATH`` it also writes the plot there (global batch
and learning rate against consumed tokens). A dry run writes nothing unless asked.

No torch import (the launcher's dry run).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_ext.schedules.plan import TrainingSchedule, TrainingSection, training_schedule

if TYPE_CHECKING:
    from megatron_ext.config.optimizer import OptimizerConfig

__all__ = ["describe_schedule", "format_stage_table", "plot_schedule", "stage_rows"]

HEADER = ("stage", "from step", "from token", "global batch", "micro/rank", "tokens/step", "lr")


def stage_rows(
    schedule: TrainingSchedule, micro_batch_size: int, dp_size: int
) -> list[tuple[int, int, int, int, int, int, float]]:
    """Per stage of the run: (index, first step, first token, global batch, micro-batches per
    data-parallel rank, tokens per step, learning rate of its first step)."""
    return [
        (
            index,
            stage.first_step,
            stage.first_sample * schedule.seq_length,
            stage.global_batch,
            stage.global_batch // (micro_batch_size * dp_size),
            stage.global_batch * schedule.seq_length,
            schedule.lr_at(stage.first_step),
        )
        for index, stage in enumerate(schedule.run_stages())
    ]


def format_stage_table(schedule: TrainingSchedule, micro_batch_size: int, dp_size: int) -> str:
    """The stage table and the schedule's token positions, as printed by the dry run."""
    rows = [
        (str(i), f"{s:,}", f"{tok:,}", str(b), str(m), f"{per:,}", f"{lr:.3e}")
        for i, s, tok, b, m, per, lr in stage_rows(schedule, micro_batch_size, dp_size)
    ]
    widths = [max(len(h), *(len(r[c]) for r in rows)) for c, h in enumerate(HEADER)]
    line = "  ".join
    scaling = f"lr x sqrt(B/{schedule.target_batch})" if schedule.sqrt_lr else "lr not scaled"
    lr = schedule.lr
    out = [
        f"batch schedule: {schedule.steps:,} steps, {schedule.total_tokens:,} tokens, target "
        f"global batch {schedule.target_batch}, {scaling}, data-parallel size {dp_size}",
        line(h.rjust(w) for h, w in zip(HEADER, widths, strict=True)),
        *(line(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows),
        f"lr {lr.decay_style}: warmup ends at token {lr.warmup_steps:,}; " + _decay_text(schedule),
    ]
    longer = _longer_than_the_run(schedule)
    return "\n".join([*out, longer] if longer else out)


def _longer_than_the_run(schedule: TrainingSchedule) -> str | None:
    """A note when the run stops inside its LR schedule's warmup or before its decay ends."""
    lr, last = schedule.lr, schedule.total_tokens
    final = schedule.lr_at(schedule.steps - 1)
    where = None
    if lr.warmup_steps > last:
        where = f"inside the warmup (it ends at token {lr.warmup_steps:,})"
    elif lr.decay_style != "constant" and lr.decay_steps > last:
        where = f"before the decay ends (at token {lr.decay_steps:,})"
    if where is None:
        return None
    return (
        f"note: the LR schedule is longer than the run, which stops at token {last:,} {where}: "
        f"its last step's lr is {final:.3e} ({final / lr.max_lr:.3g} x optimizer.lr), as "
        "Megatron-LM runs such a schedule"
    )


def _decay_text(schedule: TrainingSchedule) -> str:
    lr, last = schedule.lr, schedule.total_tokens
    if lr.decay_style == "constant":
        return "no decay"
    end = "the run's last token" if lr.decay_steps == last else f"the run ends at token {last:,}"
    if lr.decay_style == "WSD":
        start = lr.decay_steps - (lr.wsd_decay_steps or 0)
        return f"{lr.wsd_decay_style} decay from token {start:,} to {lr.decay_steps:,}, {end}"
    return f"decay to min_lr at token {lr.decay_steps:,}, {end}"


def plot_schedule(schedule: TrainingSchedule, path: Path) -> Path:
    """``path`` (PNG): global batch (top) and learning rate (bottom) against consumed tokens."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatron_ext.atomic import save_figure

    stride = max(1, schedule.steps // 2000)
    edges = {s.first_step for s in schedule.run_stages()} | {schedule.steps - 1}
    edges |= {max(0, s - 1) for s in edges}
    steps = sorted(set(range(0, schedule.steps, stride)) | edges)
    tokens = [schedule.tokens_before(s) for s in steps]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(7, 5), dpi=120)
    top.step(tokens, [schedule.global_batch(s) for s in steps], where="post", lw=1.2)
    top.set_ylabel("global batch (sequences)")
    bottom.plot(tokens, [schedule.lr_at(s) for s in steps], lw=1.2)
    bottom.set_ylabel("learning rate")
    bottom.set_xlabel("consumed tokens")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
        ax.axvline(schedule.total_tokens, color="grey", lw=0.8, ls=":")
    top.set_title(f"{schedule.steps:,} steps, {schedule.total_tokens:,} tokens")
    save_figure(fig, path, dpi=100)
    return path


def describe_schedule(
    training: TrainingSection,
    optimizer: OptimizerConfig,
    parallel: Any,  # the recipe's parallel section (megatron_ext.megatron.sections)
    world_size: int,
    png: Path | None = None,
) -> str:
    """The dry run's schedule text for a GPT run of these sections at ``world_size`` ranks;
    with ``png``, after writing the plot there."""
    t, p = training, parallel
    schedule = training_schedule(t, optimizer)
    dp = world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )
    table = format_stage_table(schedule, t.micro_batch_size, dp)
    if png is None:
        return table
    return f"{table}\nwrote {plot_schedule(schedule, png)}"
