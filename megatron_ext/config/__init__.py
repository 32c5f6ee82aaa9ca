"""Recipe schema, YAML loading, key=value overrides and validation (no torch import)."""

from megatron_ext.config.load import apply_overrides, load_recipe, recipe_from_dict, recipe_to_dict
from megatron_ext.config.schema import Recipe
from megatron_ext.errors import ConfigError

__all__ = [
    "ConfigError",
    "Recipe",
    "apply_overrides",
    "load_recipe",
    "recipe_from_dict",
    "recipe_to_dict",
]
