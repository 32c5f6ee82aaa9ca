"""One logging path: the per-step log line, TensorBoard, a JSONL file, the loss plot, summary.json.

Only rank 0 writes.  Every figure of a step goes to all three sinks, so the terminal, TensorBoard
and ``metrics.jsonl`` never disagree.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.atomic import atomic_path
from megatron_ext.config.schema import ModelConfig


def gpt_train_flops_per_token(
    model: ModelConfig, seq_length: int, vocab_size: int, ffn_hidden_size: int, kv_channels: int
) -> float:
    """Training FLOPs per token of the standard GPT estimate (matmuls only).

    forward = 2 FLOPs per multiply-add over every weight matmul a token passes through
    (QKV, output projection, MLP or its top-k experts plus the router, the logits) plus the
    attention score and value products, 2·2·s·d_attn per layer (full, not causal-halved, as in
    Megatron's convention); training = 3 × forward (backward costs two forwards).
    """
    h, n_layers = model.hidden_size, model.num_layers
    heads = model.num_attention_heads
    groups = model.num_query_groups or heads
    attn_dim = heads * kv_channels
    qkv = h * (attn_dim + 2 * groups * kv_channels)
    proj = attn_dim * h
    mlp_mats = 3 if model.activation == "swiglu" else 2
    if model.num_moe_experts:
        expert_ffn = model.moe_ffn_hidden_size or ffn_hidden_size
        mlp = model.moe_router_topk * mlp_mats * h * expert_ffn + h * model.num_moe_experts
    else:
        mlp = mlp_mats * h * ffn_hidden_size
    per_layer = 2 * (qkv + proj + mlp) + 2 * 2 * seq_length * attn_dim
    forward = n_layers * per_layer + 2 * h * vocab_size
    return 3.0 * forward


def _fmt_count(x: float) -> str:
    for unit, scale in (("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def _fmt_time(seconds: float) -> str:
    s = int(max(0.0, seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


@dataclass
class StepRecord:
    """The figures of one optimizer step."""

    step: int
    consumed_tokens: int
    global_batch: int
    lr: float
    loss: float
    grad_norm: float
    tokens_per_s: float
    tokens_per_s_per_rank: float
    tflops_per_rank: float
    elapsed_s: float
    eta_s: float
    step_time_s: float


class MetricsLogger:
    """Writes step records on rank 0 to stdout (or a progress bar), TensorBoard and JSONL."""

    def __init__(
        self,
        run_dir: Path,
        total_steps: int,
        world_size: int,
        flops_per_token: float,
        enabled: bool,
        tensorboard: bool,
        progress_bar: str,
        log_interval: int,
        start_step: int = 0,
    ) -> None:
        self.enabled = enabled
        self.total_steps = total_steps
        self.world_size = world_size
        self.flops_per_token = flops_per_token
        self.log_interval = log_interval
        self.start_step = start_step
        self.records: list[StepRecord] = []
        self.t0 = time.perf_counter()
        self._tb = None
        self._bar = None
        self._jsonl = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir = run_dir
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")  # noqa: SIM115
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        use_bar = progress_bar == "on" or (progress_bar == "auto" and sys.stdout.isatty())
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True)

    def record(
        self,
        step: int,
        consumed_tokens: int,
        global_batch: int,
        lr: float,
        loss: float,
        grad_norm: float,
        step_time_s: float,
        step_tokens: int,
    ) -> StepRecord:
        """Record step ``step`` (1-based count of completed steps) and emit it."""
        elapsed = time.perf_counter() - self.t0
        done = step - self.start_step
        eta = elapsed / max(done, 1) * (self.total_steps - step)
        tps = step_tokens / max(step_time_s, 1e-9)
        rec = StepRecord(
            step=step,
            consumed_tokens=consumed_tokens,
            global_batch=global_batch,
            lr=lr,
            loss=loss,
            grad_norm=grad_norm,
            tokens_per_s=tps,
            tokens_per_s_per_rank=tps / self.world_size,
            tflops_per_rank=tps / self.world_size * self.flops_per_token / 1e12,
            elapsed_s=elapsed,
            eta_s=eta,
            step_time_s=step_time_s,
        )
        self.records.append(rec)
        if not self.enabled:
            return rec
        self._jsonl.write(json.dumps(rec.__dict__) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key in (
                "loss",
                "lr",
                "grad_norm",
                "tokens_per_s",
                "tokens_per_s_per_rank",
                "tflops_per_rank",
                "global_batch",
            ):
                self._tb.add_scalar(f"train/{key}", getattr(rec, key), step)
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}")
        if step % self.log_interval == 0 or step == self.total_steps:
            self._emit(self.format(rec))
        return rec

    def format(self, r: StepRecord) -> str:
        width = len(str(self.total_steps))
        return (
            f"step {r.step:>{width}}/{self.total_steps} | tokens {_fmt_count(r.consumed_tokens)}"
            f" | gbs {r.global_batch} | lr {r.lr:.3e} | loss {r.loss:.4f}"
            f" | gnorm {r.grad_norm:.3f} | tok/s {_fmt_count(r.tokens_per_s)}"
            f" ({_fmt_count(r.tokens_per_s_per_rank)}/rank)"
            f" | TFLOP/s/rank {r.tflops_per_rank:.4f}"
            f" | elapsed {_fmt_time(r.elapsed_s)} | eta {_fmt_time(r.eta_s)}"
        )

    def _emit(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def info(self, line: str) -> None:
        if self.enabled:
            self._emit(line)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_loss(metrics_path: Path, out_png: Path) -> None:
    """Loss curve (all steps recorded in ``metrics.jsonl``, resumed runs included)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(metrics_path)
    by_step = {r["step"]: r["loss"] for r in rows}  # a resumed run rewrites later steps
    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(steps, [by_step[s] for s in steps], lw=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title(out_png.parent.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_path(out_png) as tmp:
        fig.savefig(tmp)
    plt.close(fig)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
