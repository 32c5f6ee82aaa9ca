"""Levels x modules -> paths, and which GPTModel parameter belongs to which module.

The GPTModel's *parts* are ``embedding``, ``block0`` ... ``block{N-1}`` (its transformer layers),
``final_layernorm`` and ``output_layer`` (absent when the output layer is tied to the
embedding). A recipe assigns every part exactly once: to one of L levels, or to the
path-specific set (each path keeps its own copy, never averaged, never communicated).

Level l has K_l modules; module (l, e) holds level l's parts. A path picks one module per level,
so there are P = K_0·...·K_{L-1} paths; path p's modules are the mixed-radix digits of p (level 0
most significant): with K = (2, 3), path 4 = (1, 1). Module (l, e) is used by P / K_l paths.

A part list is text: whitespace/comma separated tokens, each a block index (``3``), an inclusive
block range (``1-4``) or a part name (``embedding``, ``final_layernorm``, ``output_layer``).

A level may hold no parts (``dipaco.level_parts: ["", "embedding 0-3 ..."]``): its K_l modules
are empty and only split the data, so with every part in a K = 1 level the P = K_0 paths share
all parameters -- DiLoCo with P workers on P shards (the paper's Table 1 baseline).

No torch import: the recipe check builds a layout before any process starts.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

from megatron_ext.errors import ConfigError

__all__ = ["EMBEDDING", "FINAL_NORM", "OUTPUT", "ModuleId", "PathLayout", "parse_parts"]

EMBEDDING, FINAL_NORM, OUTPUT = "embedding", "final_layernorm", "output_layer"
NAMED_PARTS = (EMBEDDING, FINAL_NORM, OUTPUT)
_RANGE = re.compile(r"^(\d+)-(\d+)$")
_BLOCK = re.compile(r"^decoder\.layers\.(\d+)\.")


def block(i: int) -> str:
    """The part name of transformer layer ``i``."""
    return f"block{i}"


def model_parts(num_layers: int, tied_output: bool) -> tuple[str, ...]:
    """Every part of a GPTModel with ``num_layers`` layers, in forward order."""
    tail = (FINAL_NORM,) if tied_output else (FINAL_NORM, OUTPUT)
    return (EMBEDDING, *(block(i) for i in range(num_layers)), *tail)


def parse_parts(text: str, num_layers: int, where: str) -> tuple[str, ...]:
    """The parts named by ``text`` (see the module docstring), in the order given; ``where`` is
    the recipe key quoted in errors. Raises ``ConfigError`` for an unknown token, a block outside
    0..num_layers-1, or a part named twice."""
    parts: list[str] = []
    for token in text.replace(",", " ").split():
        if token in NAMED_PARTS:
            new = [token]
        elif token.isdigit() or _RANGE.match(token):
            first, last = (
                (int(token), int(token)) if token.isdigit() else map(int, token.split("-"))
            )
            if first > last:
                raise ConfigError(f"{where}: block range {token!r} is empty (write low-high)")
            if last >= num_layers:
                raise ConfigError(
                    f"{where}: block {last} does not exist: model.num_layers={num_layers} has "
                    f"blocks 0-{num_layers - 1}"
                )
            new = [block(i) for i in range(first, last + 1)]
        else:
            raise ConfigError(
                f"{where}: {token!r} is not a block index, a block range (1-4) or one of "
                f"{', '.join(NAMED_PARTS)}"
            )
        for part in new:
            if part in parts:
                raise ConfigError(f"{where}: {part} is named twice")
            parts.append(part)
    return tuple(parts)


@dataclass(frozen=True, order=True)
class ModuleId:
    """Module ``index`` of level ``level``; ``name`` is its file stem (``l0_e3``)."""

    level: int
    index: int

    @property
    def name(self) -> str:
        return f"l{self.level}_e{self.index}"


@dataclass(frozen=True)
class PathLayout:
    """Which parts each level holds, K_l per level, and the path-specific parts.

    ``level_parts[l]``: the parts of every module of level l; ``modules_per_level[l]``: K_l.
    """

    modules_per_level: tuple[int, ...]
    level_parts: tuple[tuple[str, ...], ...]
    path_specific: tuple[str, ...] = ()

    @classmethod
    def from_recipe(
        cls,
        modules_per_level: Sequence[int],
        level_parts: Sequence[str],
        path_specific: str,
        num_layers: int,
        tied_output: bool,
    ) -> PathLayout:
        """Parse and check the recipe's ``dipaco.modules_per_level``, ``dipaco.level_parts``
        (empty: the blocks split evenly over the levels, the embedding in the first and the
        final norm and output layer in the last) and ``dipaco.path_specific``."""
        n_levels = len(modules_per_level)
        if n_levels == 0:
            raise ConfigError("dipaco.modules_per_level is empty: give K per level, e.g. [2, 2]")
        if any(k < 1 for k in modules_per_level):
            raise ConfigError(
                f"dipaco.modules_per_level={list(modules_per_level)}: every level needs at least "
                f"one module"
            )
        specific = parse_parts(path_specific, num_layers, "dipaco.path_specific")
        if level_parts:
            if len(level_parts) != n_levels:
                raise ConfigError(
                    f"dipaco.level_parts has {len(level_parts)} entries but "
                    f"dipaco.modules_per_level={list(modules_per_level)} has {n_levels} levels: "
                    f"give one part list per level"
                )
            levels = tuple(
                parse_parts(text, num_layers, f"dipaco.level_parts[{i}]")
                for i, text in enumerate(level_parts)
            )
        else:
            levels = _even_levels(n_levels, num_layers, tied_output, set(specific))
        layout = cls(tuple(modules_per_level), levels, specific)
        layout.check(num_layers, tied_output)
        return layout

    def check(self, num_layers: int, tied_output: bool) -> None:
        """Every part of the model exactly once, no empty level; ``ConfigError`` otherwise."""
        expected = model_parts(num_layers, tied_output)
        where: dict[str, str] = {}
        owners = [(f"dipaco.level_parts[{i}]", p) for i, p in enumerate(self.level_parts)]
        for owner, parts in [*owners, ("dipaco.path_specific", self.path_specific)]:
            for part in parts:
                if part == OUTPUT and tied_output:
                    raise ConfigError(
                        f"{owner}: output_layer is tied to the embedding "
                        f"(model.untie_embeddings_and_output_weights=false): name only embedding"
                    )
                if part in where:
                    raise ConfigError(
                        f"{part} is in both {where[part]} and {owner}: assign each part once"
                    )
                where[part] = owner
        missing = [p for p in expected if p not in where]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)} of the model (num_layers={num_layers}) is in no level and "
                f"not path-specific: add it to dipaco.level_parts or dipaco.path_specific"
            )
        if not any(self.level_parts):
            raise ConfigError("every dipaco.level_parts entry is empty: a level needs parts")

    @property
    def num_levels(self) -> int:
        return len(self.modules_per_level)

    @property
    def num_paths(self) -> int:
        """P = K_0 · ... · K_{L-1}."""
        return math.prod(self.modules_per_level)

    @cached_property
    def modules(self) -> tuple[ModuleId, ...]:
        """Every shared module, level by level."""
        return tuple(
            ModuleId(level, e) for level, k in enumerate(self.modules_per_level) for e in range(k)
        )

    def path_modules(self, path: int) -> tuple[ModuleId, ...]:
        """Path ``path``'s module at each level (mixed-radix digits, level 0 most significant)."""
        if not 0 <= path < self.num_paths:
            raise ValueError(f"path {path} is not in 0..{self.num_paths - 1}")
        digits = []
        for k in reversed(self.modules_per_level):
            path, digit = divmod(path, k)
            digits.append(digit)
        return tuple(ModuleId(level, e) for level, e in enumerate(reversed(digits)))

    def paths_of(self, module: ModuleId) -> tuple[int, ...]:
        """The paths that use ``module``, ascending (P / K_l of them)."""
        return tuple(
            p for p in range(self.num_paths) if self.path_modules(p)[module.level] == module
        )

    def part_level(self, part: str) -> int | None:
        """The level holding ``part``; None for a path-specific part."""
        for level, parts in enumerate(self.level_parts):
            if part in parts:
                return level
        if part in self.path_specific:
            return None
        raise KeyError(f"part {part!r} is in no level of this layout")

    def param_level(self, name: str) -> int | None:
        """The level of GPTModel parameter ``name`` (None: path-specific)."""
        return self.part_level(part_of(name))


def part_of(name: str) -> str:
    """The part of a GPTModel parameter name (``decoder.layers.3.mlp...`` -> ``block3``)."""
    if name.startswith("embedding."):
        return EMBEDDING
    if name.startswith("output_layer."):
        return OUTPUT
    if name.startswith("decoder.final_layernorm."):
        return FINAL_NORM
    match = _BLOCK.match(name)
    if match:
        return block(int(match.group(1)))
    raise KeyError(f"parameter {name!r} belongs to no GPTModel part")


def _even_levels(
    n_levels: int, num_layers: int, tied_output: bool, specific: set[str]
) -> tuple[tuple[str, ...], ...]:
    """The blocks that are not path-specific in n_levels contiguous runs (the first runs one
    longer when they do not divide), the embedding first, the final norm and output last."""
    blocks = [block(i) for i in range(num_layers) if block(i) not in specific]
    if len(blocks) < n_levels:
        raise ConfigError(
            f"{n_levels} levels need at least {n_levels} shared blocks, the model has "
            f"{len(blocks)}: lower len(dipaco.modules_per_level) or give dipaco.level_parts"
        )
    size, extra = divmod(len(blocks), n_levels)
    levels, start = [], 0
    for level in range(n_levels):
        end = start + size + (level < extra)
        levels.append(list(blocks[start:end]))
        start = end
    head = [EMBEDDING] if EMBEDDING not in specific else []
    tail = [p for p in (FINAL_NORM, *(() if tied_output else (OUTPUT,))) if p not in specific]
    levels[0][:0] = head
    levels[-1].extend(tail)
    return tuple(tuple(parts) for parts in levels)
