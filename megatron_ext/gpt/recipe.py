"""The GPT trainer's part of a recipe: its cross-field rules and its registration.

The GPT trainer owns no section of its own: it reads the shared ones (``model``, ``optimizer``,
``data``, ``training``, ``parallel``, ...). No torch import: the launcher validates recipes
before any process starts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_ext.errors import ConfigError
from megatron_ext.run.trainers import TrainerSpec, register_trainer
from megatron_ext.schedules.batch import ConstantBatch
from megatron_ext.schedules.plan import TrainingSchedule, batch_rule, training_schedule

if TYPE_CHECKING:
    from megatron_ext.config.schema import Recipe

__all__ = ["check_gpt"]


def check_gpt(recipe: Recipe, world_size: int | None) -> None:
    """A dataset to read, a consistent LR schedule and (given) a layout that fits the job."""
    if not recipe.data.path:
        raise ConfigError(
            "data.path is empty: set it to an indexed-dataset prefix "
            "(build one with `megatron-ext data build`)"
        )
    # The schedule checks its own consistency (e.g. the WSD window must fit after the warmup):
    # build it once here so a bad schedule fails before any process starts; then the batch
    # stages and the LR positions on consumed tokens.
    recipe.lr_schedule()
    schedule = training_schedule(recipe)
    if world_size is not None:
        _check_layout(recipe, world_size)
        _check_stages(recipe, schedule, world_size)


def _check_layout(recipe: Recipe, world_size: int) -> None:
    """World size against the parallel layout (the batches: :func:`_check_stages`)."""
    p = recipe.parallel
    # ranks holding one copy of the model; data parallel is the rest (megatron-core's rule)
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if world_size % mp:
        raise ConfigError(
            f"world size {world_size} is not divisible by tp*pp*cp = "
            f"{p.tensor_model_parallel_size}*{p.pipeline_model_parallel_size}*"
            f"{p.context_parallel_size} = {mp}: change the rank count or the parallel sizes"
        )
    dp = world_size // mp
    if recipe.model.num_moe_experts:
        edp = dp * p.context_parallel_size
        if edp % p.expert_model_parallel_size:
            raise ConfigError(
                f"data-parallel size {dp} (x cp) is not divisible by "
                f"parallel.expert_model_parallel_size={p.expert_model_parallel_size}"
            )


def _check_stages(recipe: Recipe, schedule: TrainingSchedule, world_size: int) -> None:
    """Every stage's global batch splits into micro-batches x data-parallel ranks."""
    p, t = recipe.parallel, recipe.training
    mbs = t.micro_batch_size
    dp = world_size // (
        p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    )
    if isinstance(batch_rule(recipe), ConstantBatch):
        if t.global_batch_size % (mbs * dp):
            raise ConfigError(
                f"training.global_batch_size={t.global_batch_size} is not divisible by "
                f"micro_batch_size*dp = {mbs}*{dp} = {mbs * dp}: use a multiple of {mbs * dp}"
            )
        return
    for index, stage in enumerate(schedule.run_stages()):
        if stage.global_batch % (mbs * dp):
            raise ConfigError(
                f"batch stage {index} (from step {stage.first_step}, token "
                f"{stage.first_sample * schedule.seq_length:,}): global batch "
                f"{stage.global_batch} is not divisible by micro_batch_size*dp = {mbs}*{dp} = "
                f"{mbs * dp}: make every stage's batch a multiple of {mbs * dp}, or lower "
                f"training.micro_batch_size"
            )


register_trainer(
    TrainerSpec(
        name="gpt",
        train="megatron_ext.gpt.trainer:train",
        check=check_gpt,
        reads=dict.fromkeys(("model", "optimizer", "data", "training", "parallel")),
    )
)
