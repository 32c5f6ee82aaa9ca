"""Load a recipe: YAML -> nested dict -> ``key=value`` overrides -> typed, validated ``Recipe``.

Every mistake becomes one :class:`ConfigError` naming the key, what is wrong and the fix
(with a "did you mean" for misspelt keys). The run sections are ``Recipe``'s fields; the
trainers' sections (``model:``, ``soma:``) come from the trainer registry.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from megatron_ext.config.fields import literal_options
from megatron_ext.config.moe_presets import expand_moe_preset
from megatron_ext.config.optimizer import option_keys, renamed_keys, split_options
from megatron_ext.config.reads import check_reads
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import get_trainer, recipe_sections, trainer_sections
from megatron_ext.errors import ConfigError
from megatron_ext.optimizers.spec import registered_optimizers


def load_recipe(
    path: str | Path, overrides: Sequence[str] = (), world_size: int | None = None
) -> Recipe:
    """Read ``path`` (a file, or the name of a shipped recipe), apply overrides, validate
    (:meth:`Recipe.check`, with the layout rules when ``world_size`` is given)."""
    recipe = read_recipe(path, overrides)
    recipe.check(world_size)
    return recipe


def read_recipe(path: str | Path, overrides: Sequence[str] = ()) -> Recipe:
    """Like :func:`load_recipe` but field checks only (keys, types, ranges): for a caller that
    runs ``Recipe.check`` itself once it knows the world size (the launcher)."""
    return recipe_from_dict(apply_overrides(read_yaml(resolve_recipe_path(path)), overrides))


def shipped_recipes_dir() -> Path:
    """Folder of the recipes shipped as package data (``megatron_ext.recipes``)."""
    import megatron_ext.recipes as shipped

    return Path(shipped.__file__).parent


def resolve_recipe_path(path: str | Path) -> Path:
    """A path as given, else a shipped recipe by name (``tiny_cpu_gpt``, ``tiny_cpu_gpt.yaml``)."""
    p = Path(path)
    if p.is_file():
        return p
    name = p.name if p.suffix in (".yaml", ".yml") else p.name + ".yaml"
    candidate = shipped_recipes_dir() / name
    if candidate.is_file():
        return candidate
    available = sorted(q.stem for q in shipped_recipes_dir().glob("*.yaml"))
    raise ConfigError(
        f"recipe file {str(path)!r} not found; shipped recipes: {', '.join(available)}"
    )


def read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a recipe is YAML text)") from None
    if data is None:
        raise ConfigError(
            f"{path}: the recipe is empty; start from a shipped one (e.g. tiny_cpu_gpt.yaml)"
        )
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a recipe must be a mapping of sections, got {type(data).__name__}"
        )
    return data


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` strings to the nested dict (values parsed as YAML scalars)."""
    out = _deepcopy(raw)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. optimizer.lr=3e-4)")
        key, value = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise ConfigError(f"override {item!r} has an empty key")
        node = out
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        try:
            node[parts[-1]] = yaml.safe_load(value) if value.strip() else ""
        except yaml.YAMLError:
            node[parts[-1]] = value
    return out


def recipe_from_dict(raw: dict[str, Any]) -> Recipe:
    """Build the typed recipe of the trainer ``raw`` names (its registered ``recipe`` class);
    unknown keys, wrong types, out-of-range values and keys the recipe's trainer does not read
    (:func:`megatron_ext.config.reads.check_reads`) raise.

    Every registered section given is built, so that a misspelt key is named as such; the
    recipe's sections not given take their defaults."""
    every = trainer_sections()
    expanded = expand_moe_preset(raw)
    core = {k: v for k, v in expanded.items() if k not in every}
    kwargs = _kwargs(Recipe, core, prefix="", more_keys=tuple(every))
    spec = get_trainer(kwargs.get("trainer", "gpt"))
    given = {
        name: _build(every[name], value, prefix=f"{name}.")
        for name, value in expanded.items()
        if name in every
    }
    check_reads(expanded, spec)  # after the fields: a misspelt key is named as misspelt
    sections = {name: given[name] for name in recipe_sections(spec) if name in given}
    return spec.recipe(**kwargs, **sections)


def _deepcopy(d: Any) -> Any:
    if isinstance(d, dict):
        return {k: _deepcopy(v) for k, v in d.items()}
    if isinstance(d, list):
        return [_deepcopy(v) for v in d]
    return d


def _build(cls: type, raw: Any, prefix: str, more_keys: tuple[str, ...] = ()) -> Any:
    """``cls`` from the mapping ``raw``. ``more_keys``: other valid keys at this level (the
    trainers' sections, built by the caller), named in the unknown-key message."""
    return cls(**_kwargs(cls, raw, prefix, more_keys))


def _kwargs(cls: type, raw: Any, prefix: str, more_keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """The keyword arguments of ``cls`` read from the mapping ``raw`` (see :func:`_build`)."""
    where = prefix.rstrip(".") or "recipe"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(raw).__name__} {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    options = [name for name, f in fields.items() if f.metadata.get("optimizer_options")]
    renamed: dict[str, list[str]] = getattr(cls, "RENAMED", {})
    if options:  # the optimizer section: its options are written flat (muon_momentum)
        raw, own = split_options(raw)
        fields.pop(options[0])
        more_keys = (*more_keys, *option_keys())
        renamed = {**renamed, **renamed_keys()}
    hints = typing.get_type_hints(cls)
    valid = [*fields, *more_keys]
    moved = getattr(cls, "MOVED", {})
    for key in raw:
        if key not in fields and key in moved:
            raise ConfigError(
                f"{prefix}{key} moved to the recipe's {moved[key]!r}: write it there "
                f"({moved[key]}: {raw[key]!r} in the YAML, {moved[key]}={raw[key]!r} on the "
                "command line)"
            )
        if key not in fields and key in renamed:
            new = " or ".join(f"{prefix}{n}" for n in renamed[key])
            raise ConfigError(f"{prefix}{key} was renamed: use {new}")
        if key not in fields:
            close = difflib.get_close_matches(str(key), valid, n=1, cutoff=0.6)
            hint = (
                f"; did you mean {prefix}{close[0]!r}?"
                if close
                else (f"; valid keys: {', '.join(valid)}")
            )
            raise ConfigError(f"unknown key {prefix}{key!r}{hint}")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        if name not in raw:
            continue
        tp = hints[name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, raw[name], prefix=f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(f"{prefix}{name}", raw[name], tp, f.metadata)
    if options:
        specs = registered_optimizers()
        kwargs[options[0]] = {
            name: _build(specs[name].options, given, prefix=f"{prefix}{name}_")
            for name, given in own.items()
        }
    return kwargs


def _coerce(key: str, value: Any, tp: Any, meta: Any) -> Any:
    args = typing.get_args(tp)
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args
    if optional:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        tp = next(a for a in args if a is not type(None))
    options = literal_options(tp)
    if options is not None:  # Literal["a", "b"]: a value of the options' type, one of them
        tp, meta = type(options[0]), {**meta, "choices": options}
    value = _convert(key, value, tp)
    _check_range(key, value, meta)
    return value


def _convert(key: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is dict:  # a mapping of names to YAML values (model.transformer_config)
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise ConfigError(f"{key} must be a mapping of names to values, got {value!r}")
        return _deepcopy(value)
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        return [_convert(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{key} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key} must be a string, got {value!r}")
    raise ConfigError(f"{key}: unsupported type {tp}")  # a schema bug, not a user error


def _check_range(key: str, value: Any, meta: Any) -> None:
    if not meta:
        return
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of {', '.join(map(str, choices))}{hint}")
    for bound, ok, word in (
        ("ge", lambda v, b: v >= b, ">="),
        ("gt", lambda v, b: v > b, ">"),
        ("le", lambda v, b: v <= b, "<="),
        ("lt", lambda v, b: v < b, "<"),
    ):
        b = meta.get(bound)
        if b is not None and isinstance(value, (int, float)) and not ok(value, b):
            raise ConfigError(f"{key}={value!r} is out of range: it must be {word} {b}")
