"""A trainer with its own recipe section (``countdown:``) that reads the recipe's ``seed``.

Each rank writes ``<run_dir>/rank<r>.json``: what it was given."""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.config.fields import spec
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import TrainerSpec
from megatron_ext.errors import ConfigError


@dataclass
class CountdownConfig:
    start: int = spec(3, ge=1, help="the number counted down from")


@dataclass(kw_only=True)
class CountdownRecipe(Recipe):
    """The countdown trainer's typed recipe: the core fields and its own section."""

    trainer: str = "countdown"
    countdown: CountdownConfig = field(default_factory=CountdownConfig)


def check(recipe, world_size):
    if world_size is not None and recipe.countdown.start < world_size:
        raise ConfigError(f"countdown.start={recipe.countdown.start} < {world_size} ranks")


def train(recipe):
    rank = int(os.environ["RANK"])
    numbers = list(range(recipe.countdown.start, 0, -1))[rank :: int(os.environ["WORLD_SIZE"])]
    out = {"trainer": recipe.trainer, "seed": recipe.seed, "numbers": numbers}
    Path(recipe.run_dir, f"rank{rank}.json").write_text(json.dumps(out))


TRAINER = TrainerSpec(
    name="countdown",
    train="mx_plugin.countdown:train",
    check=check,
    recipe=CountdownRecipe,
)
