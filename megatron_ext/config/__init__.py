"""Recipe schema, YAML loading, key=value overrides and validation (no torch import)."""

from megatron_ext.config.load import load_recipe, read_recipe
from megatron_ext.config.schema import Recipe
from megatron_ext.errors import ConfigError

__all__ = ["ConfigError", "Recipe", "load_recipe", "read_recipe"]
