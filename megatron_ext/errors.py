"""The one exception type for bad recipes, overrides and launch settings."""


class ConfigError(ValueError):
    """A user mistake in a recipe or on the command line; the CLI prints it and exits 2."""
