"""What ``megatron-ext launch --dry-run`` prints: the command as a shell snippet (stdout) and, for
the reader, what the validated recipe will run (stderr). Torch-free, like the whole launcher."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from pathlib import Path

from megatron_ext.config.moe_presets import describe_moe_preset
from megatron_ext.config.reads import describe_reads
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import get_trainer
from megatron_ext.schedules.table import describe_schedule

__all__ = ["describe_job", "format_dry_run"]


def format_dry_run(argv: list[str], env: Mapping[str, str]) -> str:
    """A shell snippet that does what the launcher would: the variables, then the command."""
    exports = [f"export {key}={shlex.quote(value)}" for key, value in sorted(env.items())]
    return "\n".join([*exports, shlex.join(argv)])


def describe_job(recipe: Recipe, world_size: int, schedule_png: Path | None = None) -> str:
    """The dry run's report of ``recipe`` (read and checked by the launcher) at ``world_size``
    ranks: the fields its trainer reads, the batch stages and LR on tokens (and their plot with
    ``schedule_png``; a trainer with the ``token_schedule`` capability), and an MoE preset's
    fields."""
    lines = [f"trainer={recipe.trainer} reads {describe_reads(get_trainer(recipe.trainer))}"]
    schedule = None  # the batch stages and LR on tokens: a trainer whose loop follows them
    if get_trainer(recipe.trainer).token_schedule:
        schedule = describe_schedule(
            recipe.training, recipe.optimizer, recipe.parallel, world_size, schedule_png
        )
    model = recipe.sections.get("model")  # MoE: what the preset set, what the recipe
    preset = describe_moe_preset(model) if model is not None else None
    return "\n".join([*lines, *(text for text in (schedule, preset) if text)])
