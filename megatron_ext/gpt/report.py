"""What the GPT trainer reports: each step's figures, its log line, and ``summary.json``.

The figures of a step are one :class:`StepRecord`; :func:`record_step` hands it to the run's
:class:`~megatron_ext.run.metrics.MetricsLogger` (log line, ``metrics.jsonl``, TensorBoard).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from megatron_ext.atomic import write_json
from megatron_ext.gpt.moe_load import format_moe
from megatron_ext.run.metrics import MetricsLogger, read_jsonl
from megatron_ext.run.peaks import memory_peaks

if TYPE_CHECKING:
    from megatron_ext.gpt.setup import GPTRun
    from megatron_ext.gpt.step import StepResult

__all__ = ["StepRecord", "format_line", "record_step", "summarize"]

# The figures TensorBoard shows, under train/<name>.
SCALARS: tuple[str, ...] = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "tokens_per_s_per_rank",
    "tflops_per_rank",
    "global_batch",
    "tokens_per_step",
)


@dataclass
class StepRecord:
    """The figures of one optimizer step (one line of ``metrics.jsonl``, in this order)."""

    step: int  # completed optimizer steps
    consumed_tokens: int
    global_batch: int  # sequences, this step's batch stage
    tokens_per_step: int  # global_batch x seq_length
    lr: float
    loss: float  # nats/token, mean over the global batch
    grad_norm: float | None  # before clipping; None: fp16 skipped the step (an overflow)
    tokens_per_s: float
    tokens_per_s_per_rank: float
    tflops_per_rank: float
    elapsed_s: float
    eta_s: float
    step_time_s: float
    optimizer_s: float  # of step_time_s: the optimizer step (clip, update, parameter sync)


def record_step(
    log: MetricsLogger,
    run: GPTRun,
    step: int,
    result: StepResult,
    step_time_s: float,
    skipped: int = 0,
) -> StepRecord:
    """Build completed step ``step``'s record (``step_time_s``: its wall time; ``skipped``:
    fp16's skipped steps so far, this one included) and log it. fp16 adds ``loss_scale`` and
    ``skipped_steps`` to the record and the line (Megatron-LM's "loss scale" and "number of
    skipped iterations")."""
    t, schedule = run.recipe.training, run.schedule
    batch = schedule.global_batch(step - 1)
    step_tokens = batch * t.seq_length
    elapsed = log.elapsed()
    eta = elapsed / max(step - run.start_step, 1) * (schedule.steps - step)
    tps = step_tokens / max(step_time_s, 1e-9)
    world = run.env.world_size
    rec = StepRecord(
        step=step,
        consumed_tokens=schedule.tokens_before(step),
        global_batch=batch,
        tokens_per_step=step_tokens,
        lr=result.lr,
        loss=result.loss,
        grad_norm=result.grad_norm,
        tokens_per_s=tps,
        tokens_per_s_per_rank=tps / world,
        tflops_per_rank=tps / world * run.flops_per_token / 1e12,
        elapsed_s=elapsed,
        eta_s=eta,
        step_time_s=step_time_s,
        optimizer_s=result.optimizer_s,
    )
    line, scalars = format_line(rec, schedule.steps), SCALARS
    extra: dict[str, Any] = dict(result.moe)
    if result.moe:  # MoE models: per-layer figures go to TensorBoard as <name>/layer_<n>
        line, scalars = line + format_moe(result.moe), SCALARS + tuple(result.moe)
    if result.loss_scale is not None:
        extra.update(loss_scale=result.loss_scale, skipped_steps=skipped)
        line += f" | loss scale {result.loss_scale:g} | skipped {skipped}"
        scalars += ("loss_scale", "skipped_steps")
    if rec.grad_norm is None:  # a skipped step has no norm to plot
        scalars = tuple(n for n in scalars if n != "grad_norm")
    log.record(step, {**asdict(rec), **extra}, line=line, scalars=scalars)
    return rec


def record_validation(log: MetricsLogger, run: GPTRun, step: int, val_loss: float) -> None:
    """The validation loss after completed step ``step``: its own ``metrics.jsonl`` line
    (``step``, ``consumed_tokens``, ``val_loss``), TensorBoard ``valid/val_loss`` and a log
    line."""
    figures = {
        "step": step,
        "consumed_tokens": run.schedule.tokens_before(step),
        "val_loss": val_loss,
    }
    log.record(step, figures, scalars=("val_loss",), group="valid", advance=False)
    steps = run.schedule.steps
    log.info(f"step {step:>{len(str(steps))}}/{steps} | validation loss {val_loss:.4f}")


def _fmt_count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _fmt_time(seconds: float) -> str:
    s = int(max(0.0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def format_line(r: StepRecord, total_steps: int) -> str:
    """The log line (docs/cluster.md, "Reading the log line")."""
    width = len(str(total_steps))
    return (
        f"step {r.step:>{width}}/{total_steps} | tokens {_fmt_count(r.consumed_tokens)}"
        f" | gbs {r.global_batch} ({_fmt_count(r.tokens_per_step)} tok)"
        f" | lr {r.lr:.3e} | loss {r.loss:.4f}"
        f" | gnorm {'skipped' if r.grad_norm is None else format(r.grad_norm, '.3f')}"
        f" | tok/s {_fmt_count(r.tokens_per_s)}"
        f" ({_fmt_count(r.tokens_per_s_per_rank)}/rank)"
        f" | TFLOP/s/rank {r.tflops_per_rank:.4f}"
        f" | elapsed {_fmt_time(r.elapsed_s)} | eta {_fmt_time(r.eta_s)}"
    )


def summarize(run: GPTRun, log: MetricsLogger) -> dict[str, Any]:
    """The run's summary; rank 0 writes it to ``summary.json`` and plots ``loss.png`` from
    ``metrics.jsonl`` (every step recorded there, resumed runs included)."""
    recs = [r for r in log.records if "loss" in r]  # training steps
    evals = [r for r in log.records if "val_loss" in r]
    # Throughput over steady-state steps (the first includes start-up work).
    timed = recs[1:] or recs
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in timed)
    seconds = sum(r["step_time_s"] for r in timed)
    world = run.env.world_size
    summary = {
        "trainer": "gpt",
        "steps": run.recipe.training.steps,
        "start_step": run.start_step,
        "world_size": world,
        "backend": run.env.backend,
        "parameters": sum(p.numel() for c in run.chunks for p in c.parameters()),
        "optimizer": run.recipe.optimizer.name,
        "precision": run.recipe.training.precision,
        "first_loss": recs[0]["loss"] if recs else None,
        "last_loss": recs[-1]["loss"] if recs else None,
        "losses": [r["loss"] for r in recs],
        "last_val_loss": evals[-1]["val_loss"] if evals else None,
        "val_losses": [[r["step"], r["val_loss"]] for r in evals],
        "tokens_per_s": tokens / seconds if seconds else None,
        "tokens_per_s_per_rank": tokens / seconds / world if seconds else None,
        "tflops_per_rank": (
            tokens / seconds / world * run.flops_per_token / 1e12 if seconds else None
        ),
        "elapsed_s": recs[-1]["elapsed_s"] if recs else 0.0,
        # rank 0: launch command -> first step, by phase (megatron_ext.run.startup)
        "startup_s": run.startup_s,
        # rank 0's gradient reduce-scatter payload this run (layer-wise optimizer only)
        "grad_sync_bytes": run.optimizer.grad_sync_bytes(),
        # rank 0's peak memory: CUDA allocator peaks, or on CPU the process's peak RSS
        "memory": memory_peaks(run.env.device),
    }
    if run.env.rank == 0:
        write_json(run.run_dir / "summary.json", summary)
        metrics = run.run_dir / "metrics.jsonl"
        if metrics.is_file():
            records = read_jsonl(metrics)  # a resumed run rewrites the steps it repeats
            train = {r["step"]: r["loss"] for r in records if "loss" in r}
            valid = {r["step"]: r["val_loss"] for r in records if "val_loss" in r}
            series = {"training": sorted(train.items())}
            if valid:
                series["validation"] = sorted(valid.items())
            log.plot(
                "loss.png",
                series,
                xlabel="step",
                ylabel="training loss (nats/token)",
                title=run.run_dir.name,
            )
    return summary
