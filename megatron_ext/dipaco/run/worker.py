"""A DiPaCo worker: join the run's queue, claim tasks until the run is complete.

Workers are interchangeable and may come and go: a rank started by the launcher is one, and so
is every ``megatron-ext dipaco worker RECIPE`` process. Each worker

1. checks what could stop the run before anything is written (the queue is reachable, the base
   checkpoint matches the model), binds the queue to this run and enqueues the plan (both
   idempotent: the first worker does it, the others find it done);
2. claims a task, renews its lease from a heartbeat thread while working (every
   ``heartbeat_seconds``; a lost lease stops the task at its next step), writes the task's
   files to its attempt folder and completes it. A rejected completion (a zombie: another worker
   took the task over) deletes its files;
3. stops when every task is done, or when a task has failed ``max_attempts`` times
   (:class:`TaskFailedError`). Bad input found by a task (a :class:`ConfigError`, e.g. a path with
   an empty shard) and a diverged loss stop the run at once: they would fail again;
4. stops cleanly when asked to (a stop signal of ``training.exit_signals``, or
   ``training.exit_duration_in_mins``: :mod:`megatron_ext.run.stopping`): a task in progress is
   given back unfinished at its next step (:meth:`TaskQueue.release`, no attempt spent; its
   files discarded) and the worker raises :class:`RunStopped` (exit 0). The run goes on with
   the other workers, or when workers are started again.

A worker of ``dipaco.ranks_per_worker`` = R > 1 ranks (:mod:`.group`) does all of this on its
first rank, which sends each train task to the other R − 1; they train the path with it,
data-parallel, and write nothing.
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from megatron_ext.atomic import write_json
from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.queue.heartbeat import Heartbeat
from megatron_ext.dipaco.queue.task_queue import Lease, TaskQueue
from megatron_ext.dipaco.recipe import DipacoConfig, queue_url
from megatron_ext.dipaco.run.group import WorkerGroup
from megatron_ext.dipaco.run.plan import build_plan, run_fingerprint
from megatron_ext.dipaco.run.store import RunFiles, discard_attempt
from megatron_ext.dipaco.run.tools import LeaseLost, TaskTools
from megatron_ext.errors import ConfigError, TrainingDivergedError
from megatron_ext.run.metrics import MetricsLogger
from megatron_ext.run.stopping import RunStopped, StopPolicy

__all__ = ["WorkerReport", "open_run_queue", "run_worker"]


@dataclass
class WorkerReport:
    """What one worker did: tasks completed, rejected (it was a zombie), given back."""

    completed: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    released: list[str] = field(default_factory=list)  # given back unfinished on a stop
    stopped: str = ""  # why the worker stopped early (a signal, the time limit), if it did
    progress: tuple[int, int] = (0, 0)  # (done, all) tasks of the run when it stopped
    follower: bool = False  # a multi-rank worker's other rank: ``completed`` it trained along


def open_run_queue(recipe: Recipe, worker: str = "") -> TaskQueue:
    """The run's queue, bound to this run, with its plan enqueued; writes
    ``run_dir/dipaco/run.json`` (for ``megatron-ext dipaco status``)."""
    d = recipe.section(DipacoConfig)
    url = queue_url(recipe)
    if not d.queue:  # the default queue lives in the run folder, made here
        Path(recipe.run_dir).mkdir(parents=True, exist_ok=True)
    queue = TaskQueue(
        url, lease_seconds=d.lease_seconds, max_attempts=d.max_attempts, worker=worker
    )
    queue.bind_run(run_fingerprint(recipe), recipe.run_dir)
    queue.enqueue(build_plan(recipe))
    info = Path(recipe.run_dir) / "dipaco" / "run.json"
    if not info.exists():
        write_json(info, {"queue": d.queue or f"sqlite:///{url.path}", "run_dir": recipe.run_dir})
    return queue


def run_worker(recipe: Recipe, name: str = "", max_tasks: int | None = None) -> WorkerReport:
    """Work on the run of ``recipe`` until it is complete (or ``max_tasks`` were done).

    With ``dipaco.ranks_per_worker`` = R > 1 every rank of the job calls this: R consecutive
    ranks are one worker (:mod:`.group`), whose first rank leads (claims, writes, completes)
    and sends its train tasks to the others.

    Raises :class:`RunStopped` when asked to stop (every rank of a multi-rank worker installs
    the stop signals; its first rank decides, the others follow it)."""
    stop = StopPolicy.from_training(recipe.training)
    try:
        group = _worker_group(recipe)
        if not group.leader:
            return _follow(recipe, group)
        try:
            report = _lead(recipe, group, name, max_tasks, stop)
        finally:
            group.broadcast(None)  # the followers stop
    finally:
        stop.uninstall()
    if report.stopped:
        done, total = report.progress
        raise RunStopped(done, total, report.stopped, None, unit="task")
    return report


def _worker_group(recipe: Recipe) -> WorkerGroup:
    r = recipe.section(DipacoConfig).ranks_per_worker
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world % r:
        raise ConfigError(
            f"dipaco.ranks_per_worker={r} does not divide this job's {world} rank(s): start the "
            f"worker with a multiple of {r} ranks (megatron-ext launch, or torchrun "
            f"--nproc-per-node {r} -m megatron_ext.launch.cli dipaco worker ...)"
        )
    return WorkerGroup.form(r)


def _lead(
    recipe: Recipe,
    group: WorkerGroup,
    name: str,
    max_tasks: int | None,
    stop: StopPolicy,
) -> WorkerReport:
    d = recipe.section(DipacoConfig)
    _check_before_writing(recipe)
    queue = open_run_queue(recipe, worker=name)
    beat = Heartbeat(
        lambda: TaskQueue(
            queue.url,
            lease_seconds=d.lease_seconds,
            max_attempts=d.max_attempts,
            worker=queue.worker,
        ),
        d.heartbeat_seconds,
    )
    log = MetricsLogger(
        Path(recipe.run_dir),
        echo=True,
        write=False,
        tensorboard=False,
        prefix=f"[dipaco {name or queue.worker}] ",
    )
    files, tools = RunFiles(recipe, queue), TaskTools(recipe, lost=lambda: beat.lost, group=group)
    report = WorkerReport()
    try:
        while max_tasks is None or len(report.completed) < max_tasks:
            if reason := stop.requested(len(report.completed)):
                report.stopped = reason
                report.progress = _progress(queue)
                log.info(f"stopping ({reason}); the run goes on with the other workers")
                break
            lease = queue.claim()
            if lease is None:
                if queue.unfinished() == 0:
                    break
                time.sleep(d.poll_seconds)
                continue
            shared = group.size > 1 and lease.kind == "train"
            if shared:  # the followers train with us; the leader's lease state is agreed
                group.broadcast(lease)
            tools.lost = _lost_check(beat, stop, group if shared else None)
            _work(recipe, files, tools, beat, lease, log, report, stop)
    finally:
        beat.close()
        queue.close()
        log.close()
    return report


def _follow(recipe: Recipe, group: WorkerGroup) -> WorkerReport:
    """A follower rank: train the leader's train tasks with it until it says stop."""
    from megatron_ext.dipaco.run.tasks import run_task

    d, report = recipe.section(DipacoConfig), WorkerReport(follower=True)
    files = tools = None
    try:
        while (lease := group.broadcast()) is not None:
            if files is None:  # the leader has made the run's queue by now
                queue = TaskQueue(
                    queue_url(recipe),
                    lease_seconds=d.lease_seconds,
                    max_attempts=d.max_attempts,
                    worker=f"{dist.get_rank()}-follower",
                )
                files = RunFiles(recipe, queue)
                tools = TaskTools(recipe, lost=lambda: group.agree(False), group=group)
            try:
                run_task(recipe, files, tools, lease)
            except (LeaseLost, TrainingDivergedError):  # the leader drops or reports it
                report.lost.append(lease.task)
                continue
            report.completed.append(lease.task)
    finally:
        if files is not None:
            files.queue.close()
    return report


def _progress(queue: TaskQueue) -> tuple[int, int]:
    """(done, all) tasks of the run."""
    counts = queue.counts().values()
    return sum(c.get("done", 0) for c in counts), sum(sum(c.values()) for c in counts)


def _lost_check(beat: Heartbeat, stop: StopPolicy, group: WorkerGroup | None) -> Callable[[], bool]:
    """The task's ``tools.lost``: the lease was lost or this worker is asked to stop (agreed
    with the followers when ``group`` trains the task with it)."""

    def lost() -> bool:
        gone = beat.lost or stop.requested(1) is not None
        return group.agree(gone) if group is not None else gone

    return lost


def _work(
    recipe: Recipe,
    files: RunFiles,
    tools: TaskTools,
    beat: Heartbeat,
    lease: Lease,
    log: MetricsLogger,
    report: WorkerReport,
    stop: StopPolicy,
) -> None:
    """Run one claimed task and complete it, or give it back (lost, failed, stopped)."""
    queue = files.queue
    start = time.perf_counter()
    beat.hold(lease)
    try:
        result = _run(recipe, files, tools, lease)
    except LeaseLost:
        discard_attempt(files.run_dir, lease.task, lease.token)
        reason = None if beat.lost else stop.requested(1)
        if reason and queue.release(lease, reason):
            report.released.append(lease.task)
            log.info(f"{lease.task}: given back unfinished ({reason}); files discarded")
        else:
            report.lost.append(lease.task)
            log.info(f"{lease.task}: lease lost to another worker; dropped")
        return
    except (ConfigError, TrainingDivergedError) as exc:
        queue.fail(lease, f"{type(exc).__name__}: {exc}", fatal=True)
        raise
    except Exception as exc:  # given back: another attempt (up to max_attempts)
        traceback.print_exc()
        queue.fail(lease, f"{type(exc).__name__}: {exc}")
        report.failed.append(lease.task)
        return
    finally:
        beat.hold(None)
    if queue.complete(lease, result):
        report.completed.append(lease.task)
        took = time.perf_counter() - start
        log.info(f"{lease.task} done in {took:.1f} s (attempt {lease.attempt}) {_brief(result)}")
    else:
        discard_attempt(files.run_dir, lease.task, lease.token)
        report.rejected.append(lease.task)
        log.info(f"{lease.task}: completion rejected (lease taken over); files discarded")


def _run(recipe: Recipe, files: RunFiles, tools: TaskTools, lease: Lease) -> dict:
    from megatron_ext.dipaco.run.tasks import run_task

    return run_task(recipe, files, tools, lease)


def _brief(result: dict) -> str:
    keys = ("loss_last", "val_before", "best_version", "perplexity")
    return " ".join(f"{k}={result[k]}" for k in keys if k in result and result[k] is not None)


def _check_before_writing(recipe: Recipe) -> None:
    """The base checkpoint against the model (its tokenizer must exist already)."""
    d = recipe.section(DipacoConfig)
    if not d.base_checkpoint:
        return
    from megatron_ext.data.tokenizers import build_tokenizer
    from megatron_ext.dipaco.model.base import load_base_checkpoint
    from megatron_ext.dipaco.model.path_model import PathModel

    data = recipe.data
    if data.tokenizer == "sentencepiece" and not os.path.isfile(data.tokenizer_model):
        raise ConfigError(
            f"dipaco.base_checkpoint is set but its tokenizer data.tokenizer_model="
            f"{data.tokenizer_model!r} does not exist: give the tokenizer the base was trained with"
        )
    tokenizer = build_tokenizer(data.tokenizer, data.tokenizer_model, recipe.model.vocab_size)
    path_model = PathModel(recipe, tokenizer.vocab_size)
    load_base_checkpoint(d.base_checkpoint, path_model.init_state, path_model.model)
