"""Measurements and helpers shared by the benchmarks (runs through the launcher, their metrics)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_ext.errors import ConfigError
from megatron_ext.progress import Tally, tally


def matmul_gflops(size: int = 1024, repeats: int = 12, device: str = "cpu") -> float:
    """Best-of-``repeats`` fp32 GFLOP/s of a ``size``³ matmul at the current torch thread count
    (or on ``device``): the machine's attainable rate, the anchor for every achieved-GFLOP/s
    figure."""
    import torch

    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else lambda: None
    a @ b  # warm-up (CUDA: kernel selection)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in ``optimizer.state`` (momenta, factors, ...), in any dtype."""
    import torch

    return sum(
        v.numel() * v.element_size()
        for st in optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )


def write_json(report: dict[str, Any], path: str | None) -> None:
    """Write a benchmark's report to ``path`` when given (the one atomic JSON writer) and say
    so. The file carries ``meta`` (:func:`run_meta`: command, date, machine, anchor) beside the
    benchmark's own keys: every results file says how, when, where and against what it was
    measured."""
    if path:
        from megatron_ext.atomic import write_json as write_json_atomic

        write_json_atomic(path, {**report, "meta": run_meta()})
        print(f"wrote {path}")


@contextmanager
def progress(benchmark: str, what: str, total: int | None, *, unit: str = "run") -> Iterator[Tally]:
    """The one progress of every benchmark: a bar ``megatron-ext: bench BENCHMARK: WHAT`` over
    its ``total`` units (runs, arms, modes, DP sizes, rounds; ``None`` where a repeat rule
    decides how many), each wrapped in ``with tally.running(name):`` so the bar names what runs
    now, ``k/n``. On a terminal only and off with ``--quiet`` (:func:`megatron_ext.progress.tally`);
    the benchmark's stdout and JSON are the same with or without it.

    Training runs a benchmark starts through :func:`launch_run` write their output, and so
    their own progress, to ``run_dir/run.log`` (not a terminal: the trainer's bar is off there,
    as before); work run in this process sees stdout as no terminal while the bar is shown.
    Either way this bar is the only one on the terminal."""
    with tally(f"bench {benchmark}", what, total=total, unit=unit) as shown:
        yield shown


def launch_run(recipe: str, overrides: list[str], run_dir: Path, label: str) -> Path:
    """One run of ``recipe`` through the normal launcher (``megatron-ext launch``), as its own
    process, into ``run_dir`` (the launcher's and the ranks' output go to ``run_dir/run.log``);
    returns ``run_dir``. A run that fails raises with the last lines of its log."""
    run_dir.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "megatron_ext.launch.cli",
        "launch",
        recipe,
        *overrides,
        f"run_dir={run_dir}",
    ]
    with open(run_dir / "run.log", "w") as log:
        done = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        tail = (run_dir / "run.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(
            f"the {label} run failed (exit {done.returncode}); last lines of {run_dir}/run.log:\n"
            + "\n".join(tail)
        )
    return run_dir


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A run's ``metrics.jsonl``: its training steps and its validation records, in order."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").open() if line.strip()]
    train = [r for r in records if "loss" in r]
    if not train:
        raise RuntimeError(f"{run_dir}/metrics.jsonl has no training steps")
    return train, [r for r in records if "val_loss" in r]


#: the recipe's step counts that a shorter or longer run scales with it
SCHEDULE_STEP_KEYS = (
    "training.lr_warmup_steps",
    "training.lr_decay_steps",
    "training.lr_wsd_decay_steps",
    "training.eval_interval",
    "training.batch_ramp.double_every",
)


def run_length_overrides(
    recipe: str, overrides: list[str], steps: int | None, label: str
) -> list[str]:
    """``overrides`` plus what makes ``recipe`` run ``steps`` optimizer steps (``None``: as the
    recipe says) with its schedule scaled to that length.

    A benchmark's ``--steps`` means "this recipe, shorter (or longer)": every step count of the
    schedule (:data:`SCHEDULE_STEP_KEYS`: warmup, decay end, WSD window, validation interval, ramp
    doubling) is multiplied by ``steps / recipe steps``, rounded, and kept at 1 or more (0 or
    unset stays so); a count set in ``overrides`` is the user's and is kept. What was scaled is
    printed.
    ``ConfigError`` when the result still does not fit, with the recipe keys and the smallest run
    that works (the schedule's own message)."""
    from megatron_ext.config import load_recipe

    if steps is None:
        return list(overrides)
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    from megatron_ext.schedules import run_steps

    base = load_recipe(recipe, overrides)
    given = {o.split("=", 1)[0] for o in overrides}
    factor = steps / run_steps(base.training)  # training.steps, or what training.train_tokens takes
    scaled, notes = [], []
    for key in SCHEDULE_STEP_KEYS:
        value = _field(base, key)
        if key in given or not value:  # the user's, or unset / 0 (off)
            continue
        new = max(1, round(value * factor))
        if new != value:
            scaled.append(f"{key}={new}")
            notes.append(f"{key} {value} -> {new}")
    length = [f"training.steps={steps}"]
    if base.training.train_tokens is not None and "training.train_tokens" not in given:
        length.append("training.train_tokens=null")  # --steps is the run's length now
        notes.append(f"training.train_tokens {base.training.train_tokens} -> unset")
    result = [*overrides, *length, *scaled]
    if notes:
        print(
            f"[{label}] --steps {steps} (the recipe runs {base.training.steps}): its schedule "
            f"scaled with it: {', '.join(notes)}"
        )
    load_recipe(recipe, result)  # still does not fit: the schedule says which key, and the fix
    return result


def _field(recipe: Any, dotted: str) -> Any:
    value = recipe
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


def machine() -> dict[str, Any]:
    """The machine a benchmark ran on, for its report: CPU model, cores, torch's thread count,
    the GPU (``None`` without CUDA) and the torch and megatron-core versions."""
    import os
    import platform
    from importlib.metadata import PackageNotFoundError, version

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    try:
        mcore: str | None = version("megatron-core")
    except PackageNotFoundError:  # said in the JSON as null, not guessed
        mcore = None
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "gpu": gpu,
        "torch": torch.__version__,
        "megatron_core": mcore,
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command line as a user types it (``megatron-ext bench ...``): ``argv`` (the
    arguments after ``megatron-ext``), by default this process's."""
    import shlex

    return shlex.join(["megatron-ext", *(sys.argv[1:] if argv is None else argv)])


#: the running benchmark's ``meta`` (set once per run by the bench dispatcher, :func:`begin_run`)
_RUN_META: dict[str, Any] | None = None


def begin_run(benchmark: str, anchor: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Record this run's ``meta`` -- ``benchmark``, ``command`` (:func:`command_line` of
    ``argv``), ``date`` (UTC, minutes), ``machine`` (:func:`machine`), ``load_average`` (the
    1/5/15-minute load of the host when the run started: a loaded machine distorts times,
    same-run ratios survive)
    and ``anchor`` (the baseline the benchmark's ratios are against, the module's ``ANCHOR``) --
    which :func:`write_json` stamps on every JSON the run writes. Called by ``megatron-ext bench``
    before the benchmark runs, so no benchmark repeats it."""
    import datetime
    import os

    global _RUN_META
    _RUN_META = {
        "benchmark": benchmark,
        "command": command_line(argv),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "anchor": anchor,
    }
    return _RUN_META


def set_anchor(anchor: str) -> None:
    """Replace this run's ``meta.anchor`` (a benchmark whose option picks another baseline,
    e.g. ``bench layerwise --against megatron-core``); nothing when no run was begun."""
    if _RUN_META is not None:
        _RUN_META["anchor"] = anchor


def run_meta() -> dict[str, Any]:
    """This run's ``meta`` (:func:`begin_run`); a benchmark run outside ``megatron-ext bench``
    has none, and writing its JSON then stops with that said (a results file without its
    provenance is no result)."""
    if _RUN_META is None:
        raise RuntimeError(
            "no benchmark run begun: a benchmark's JSON is written through `megatron-ext bench "
            "NAME` (bench.common.begin_run stamps its command, date, machine and anchor)"
        )
    return _RUN_META


# What a results page says of a run: the benchmarks own ``meta`` (begin_run stamps it), so its
# reading lives here too; docs/render.py and bench paper's reports both print it.
#: the ``meta`` keys every results JSON must carry
META_KEYS = ("benchmark", "command", "date", "machine", "anchor")


def fmt(value: Any) -> str:
    """One figure as the pages print it: ints with thousands commas, floats to 4 significant
    digits (scientific below 1e-3), booleans and ``None`` as words."""
    if isinstance(value, bool) or value is None:
        return {True: "yes", False: "no", None: "–"}[value]
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and abs(value) < 1e-3:
            return f"{value:.3e}"
        text = f"{value:.4g}"
        if "e" in text:  # large floats: digits with commas, not 1.2e+06
            return f"{value:,.0f}"
        return text
    return str(value).replace("|", "/").replace("\n", " ")


def machine_words(machine: dict[str, Any]) -> str:
    """``CPU, N cores, GPU (or no GPU); torch X, megatron-core Y``."""
    gpu = f"GPU {machine['gpu']}" if machine.get("gpu") else "no GPU"
    words = f"{machine['cpu']}, {machine['cores']} cores, {gpu}; torch {machine['torch']}"
    if machine.get("megatron_core"):
        words += f", megatron-core {machine['megatron_core']}"
    return words


def provenance(meta: dict[str, Any]) -> list[str]:
    """The lines that head every table: command, date, machine (with the host's load when the
    run started: a shared machine slows times; same-run ratios survive it) and anchor."""
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ConfigError(f"results meta lacks {', '.join(missing)}")
    load = meta.get("load_average")
    loaded = (
        f" (load average {' / '.join(fmt(x) for x in load)} at the start: a shared machine)"
        if load
        else " (load not recorded)"
    )
    return [
        f"- command: `{meta['command']}`",
        f"- date: {meta['date']}",
        f"- machine: {machine_words(meta['machine'])}{loaded}",
        f"- anchor: {meta['anchor']}",
        "",
    ]
