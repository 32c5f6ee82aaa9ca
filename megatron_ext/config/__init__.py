"""Recipe schema, YAML loading, key=value overrides and validation (no torch import).

The public API (what a user's script, and ``megatron-ext bench``, may call) is ``__all__``."""

from megatron_ext.config.load import load_recipe, read_recipe
from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.config.schema import Recipe, recipe_dict
from megatron_ext.config.trainers import TrainerSpec, get_trainer, register_trainer
from megatron_ext.errors import ConfigError

__all__ = [
    "ConfigError",
    "OptimizerConfig",
    "Recipe",
    "TrainerSpec",
    "get_trainer",
    "load_recipe",
    "read_recipe",
    "recipe_dict",
    "register_trainer",
]
