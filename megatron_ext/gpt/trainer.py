"""The GPT trainer's loop (``trainer: gpt``): megatron-core GPTModel + DDP + megatron-ext's
optimizer adapter.

Read top to bottom: set up (:mod:`.setup`), resume, then per step -- forward/backward through
megatron-core's schedule, optimizer step (:mod:`.step`) -> stop on a non-finite loss -> record
(the logger decides when to print) -> validation (the evaluator decides when) -> checkpoint
(the checkpointer decides when) -> stop early, cleanly (a stop signal, the time limit or
``training.exit_interval``: :mod:`megatron_ext.run.stopping`).
"""

from __future__ import annotations

import math
import time
from typing import Any

from megatron_ext.ckpt.manifest import recipe_hash
from megatron_ext.config.optimizer import update_rms_note
from megatron_ext.config.schema import recipe_dict
from megatron_ext.errors import TrainingDivergedError
from megatron_ext.gpt.checkpoint import Checkpointer
from megatron_ext.gpt.evaluate import Evaluator
from megatron_ext.gpt.recipe import GPTRecipe
from megatron_ext.gpt.report import record_step, record_validation, summarize
from megatron_ext.gpt.setup import setup
from megatron_ext.gpt.step import train_step
from megatron_ext.run.metrics import MetricsLogger
from megatron_ext.run.startup import StartupClock
from megatron_ext.run.stopping import RunStopped, StopPolicy

__all__ = ["train"]


def resume_loss_scale(run: Any, loop_state: dict[str, Any] | None) -> int:
    """fp16: the loss scale a checkpoint's loop state holds (megatron-core keeps its grad
    scaler's state with the optimizer's), back into the optimizer; the steps skipped before
    it (0 for a new run, or without fp16)."""
    scale = run.optimizer.loss_scale
    if scale is None or not loop_state:
        return 0
    saved = loop_state.get("loss_scale")
    if saved is None or (saved.keys() == {"skipped"} and not scale.constant):
        # written by a run of another precision, or with a constant scale: megatron-core's
        # choice too (a dynamic scale then starts anew)
        if run.env.rank == 0:
            print(
                f"the checkpoint holds no dynamic fp16 loss scale (another training.precision "
                f"or a constant optimizer.loss_scale wrote it): the scale starts at "
                f"{float(scale.scale):g}",
                flush=True,
            )
        return 0
    scale.load_state_dict(saved)
    return int(saved["skipped"])


def train(recipe: GPTRecipe) -> dict[str, Any]:
    """Per-rank entry point: train ``recipe`` to ``training.steps``, resuming from the newest
    checkpoint (``checkpoint.load``). Returns the run summary (rank 0 also writes
    ``run_dir/summary.json``); raises :class:`TrainingDivergedError` on a non-finite loss and
    :class:`RunStopped` after saving when asked to stop early."""
    clock = StartupClock.start()  # from the launch command: what a user waits for
    clock.mark("imports")  # this process's start -> here: interpreter, imports, the recipe
    stop = StopPolicy.from_training(recipe.training)  # before setup: a signal during it counts
    run = setup(recipe)
    t, rank0 = recipe.training, run.env.rank == 0
    steps = run.schedule.steps  # training.steps, or the steps training.train_tokens takes
    written_by = recipe_hash(recipe_dict(recipe))  # in each checkpoint's manifest
    checkpointer = Checkpointer(run.run_dir / "checkpoints", recipe.checkpoint, written_by)
    evaluator = Evaluator(run.valid_data, t.eval_interval, t.eval_iters)
    loop_state = checkpointer.resume(run.chunks, run.optimizer)
    run.start_step = int(loop_state["step"]) if loop_state else 0
    skipped = resume_loss_scale(run, loop_state)  # fp16: the scale and its skipped steps
    if loop_state:  # the batch stages must reproduce the samples the checkpoint consumed
        run.schedule.check_resume(run.start_step, int(loop_state["consumed_samples"]))
    if run.start_step >= steps:
        if rank0:
            print(
                f"{run.run_dir}: already trained to step {run.start_step} of {steps}; "
                f"raise training.steps to continue, or delete {run.run_dir} to start over",
                flush=True,
            )
        stop.uninstall()
        return {}
    log = MetricsLogger(
        run.run_dir,
        echo=rank0,
        write=rank0,
        tensorboard=recipe.logging.tensorboard,
        log_interval=recipe.logging.log_interval,
        last_step=steps,
        start_step=run.start_step,
        progress_bar=recipe.logging.progress_bar,
    )
    log.info(
        f"megatron-ext gpt | world {run.env.world_size} ({run.env.backend}) | "
        f"params {sum(p.numel() for c in run.chunks for p in c.parameters()):,} | "
        f"optimizer {recipe.optimizer.name} | steps {run.start_step}->{steps}"
    )
    log.info(update_rms_note(recipe.optimizer))
    if run.start_step == 0 and checkpointer.should_save(0, steps):  # checkpoint.save_initial
        checkpointer.save(0, run.chunks, run.optimizer, {"step": 0, "consumed_samples": 0})
    clock.mark("setup")  # model, data, optimizer, resume
    stopping = None
    try:
        for step in range(run.start_step, steps):
            t0 = time.perf_counter()
            result = train_step(run, step, skipped)
            step_time, done = time.perf_counter() - t0, step + 1
            skipped += result.skipped
            if not math.isfinite(result.loss) or not (result.success or result.skipped):
                raise TrainingDivergedError(
                    f"step {done}: training loss is {result.loss} (grad norm {result.grad_norm}); "
                    f"stopping without checkpointing this state. Lower optimizer.lr, enable "
                    f"optimizer.clip_grad, or resume from {checkpointer.ckpt_dir}"
                )
            if step == run.start_step:
                clock.mark("first_step")
                run.startup_s = clock.phases()
                log.info(clock.report())
            record_step(log, run, done, result, step_time, skipped)
            if evaluator.should_evaluate(done, steps):
                record_validation(log, run, done, evaluator.evaluate(run))
            loop: dict[str, Any] = {
                "step": done,
                "consumed_samples": run.schedule.samples_before(done),
            }
            if run.optimizer.loss_scale is not None:
                loop["loss_scale"] = {**run.optimizer.loss_scale.state_dict(), "skipped": skipped}
            saved = None
            if checkpointer.should_save(done, steps):
                saved = checkpointer.save(done, run.chunks, run.optimizer, loop)
            # asked after the save, so that a signal during it stops the run right there
            stopping = stop.check(done, device=run.env.device) if done < steps else None
            if stopping:
                saved = saved or checkpointer.save(done, run.chunks, run.optimizer, loop)
                break
    finally:
        log.close()
        stop.uninstall()
    summary = summarize(run, log)
    if stopping:
        raise RunStopped(done, steps, stopping, saved)
    return summary
