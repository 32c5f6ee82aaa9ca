"""The one metrics path of every trainer: log lines, ``metrics.jsonl``, TensorBoard, PNG plots.

A trainer hands each record (a flat mapping of figures with its ``step``) to
:meth:`MetricsLogger.record` once; the logger writes it to every sink, so the terminal,
TensorBoard and ``metrics.jsonl`` never disagree. The logger also owns the logging policy
(:meth:`MetricsLogger.should_log`: every ``log_interval`` steps and the last one).

Which ranks do what: ``echo`` ranks print lines; ``write`` ranks write the files. The GPT trainer's
figures are global (reduced over ranks), so rank 0 does both. A SOMA rank under FSO trains
experts no other rank sees, so every rank echoes and writes its own records: rank 0 to
``metrics.jsonl``, rank r to ``metrics.rank<r>.jsonl`` (``file``).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from megatron_ext.atomic import save_figure
from megatron_ext.progress import QUIET_VAR

__all__ = ["MetricsLogger", "plot_curves", "read_jsonl"]

Point = tuple[float, float]


class MetricsLogger:
    """Writes records to stdout (or a progress bar), ``run_dir/<file>`` and TensorBoard.

    ``last_step``: the step count the run ends at (the progress bar's total, and always
    logged); ``start_step``: where a resumed run starts. ``prefix`` goes before every line.
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        echo: bool,
        write: bool,
        tensorboard: bool,
        log_interval: int = 1,
        last_step: int = 0,
        start_step: int = 0,
        progress_bar: str = "off",
        file: str = "metrics.jsonl",
        prefix: str = "",
    ) -> None:
        self.run_dir = run_dir
        self.echo, self.write = echo, write
        self.log_interval, self.last_step, self.start_step = log_interval, last_step, start_step
        self.prefix = prefix
        self.records: list[dict[str, Any]] = []  # every record of this process, in order
        self.t0 = time.perf_counter()
        self._jsonl = self._tb = self._bar = None
        if write:
            run_dir.mkdir(parents=True, exist_ok=True)
            self._jsonl = open(run_dir / file, "a", encoding="utf-8")  # noqa: SIM115
            if tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        auto = sys.stdout.isatty() and os.environ.get(QUIET_VAR, "") != "1"  # --quiet: off
        if echo and (progress_bar == "on" or (progress_bar == "auto" and auto)):
            from tqdm import tqdm

            self._bar = tqdm(total=last_step, initial=start_step, unit="step", dynamic_ncols=True)

    def elapsed(self) -> float:
        """Seconds since the logger was created (the run's wall clock)."""
        return time.perf_counter() - self.t0

    def should_log(self, step: int) -> bool:
        """A record's line is printed every ``log_interval`` steps and at ``last_step``."""
        return step % self.log_interval == 0 or step == self.last_step

    def record(
        self,
        step: int,
        figures: Mapping[str, Any],
        *,
        line: str | None = None,
        scalars: Iterable[str] = (),
        group: str = "train",
        persist: bool = True,
        advance: bool = True,
    ) -> None:
        """One record: ``figures`` (JSON-serialisable, ``step`` among them) as one line of the
        JSONL file; ``scalars`` (names in ``figures``) to TensorBoard as ``<group>/<name>`` at
        ``step`` (a mapping value, e.g. one figure per layer: each entry as
        ``<group>/<name>/<key>``); ``line`` printed when :meth:`should_log`. ``persist=False``:
        this rank echoes only (another rank writes the same record). ``advance=False``: a
        record that is not a step of its own (e.g. a validation after one) leaves the progress
        bar where it is."""
        self.records.append(dict(figures))
        if self.write and persist and self._jsonl is not None:
            self._jsonl.write(json.dumps(figures) + "\n")
            self._jsonl.flush()
            if self._tb is not None:
                for key in scalars:
                    value = figures[key]
                    if isinstance(value, Mapping):  # one figure per part, e.g. per layer
                        for part, v in value.items():
                            self._tb.add_scalar(f"{group}/{key}/{part}", v, step)
                    else:
                        self._tb.add_scalar(f"{group}/{key}", value, step)
        if self._bar is not None and advance:
            self._bar.update(1)
            shown = {"loss": ".4f", "lr": ".2e"}  # the figures the bar keeps in view
            postfix = {k: f"{figures[k]:{f}}" for k, f in shown.items() if k in figures}
            self._bar.set_postfix(postfix)
        if line is not None and self.should_log(step):
            self.info(line)

    def info(self, line: str) -> None:
        """Print a line on echo ranks (above the progress bar when there is one)."""
        if not self.echo:
            return
        if self._bar is not None:
            self._bar.write(self.prefix + line)
        else:
            print(self.prefix + line, flush=True)

    def plot(
        self,
        name: str,
        series: Mapping[str, Sequence[Point]],
        *,
        xlabel: str,
        ylabel: str,
        title: str = "",
    ) -> Path | None:
        """``run_dir/name`` (PNG): one line per series (x, y); write ranks only."""
        if not self.write:
            return None
        path = self.run_dir / name
        plot_curves(path, series, xlabel=xlabel, ylabel=ylabel, title=title)
        return path

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
        if self._jsonl is not None:
            self._jsonl.close()


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(
    path: Path,
    series: Mapping[str, Sequence[Point]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
) -> None:
    """The one plot writer: each series a line (a one-point series a marker), a legend when
    several are named, atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    for label, points in series.items():
        xs, ys = zip(*points, strict=True) if points else ((), ())
        # a lone point (e.g. one validation at the end) draws no line: mark it
        ax.plot(xs, ys, lw=1.2, label=label or None, marker="o" if len(points) == 1 else None)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path, dpi=100)
