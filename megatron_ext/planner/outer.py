"""DiPaCo's outer round in bytes, from the recipe alone (torch-free): what one phase moves
through the run's store (:mod:`megatron_ext.dipaco.run.store`), per shared module and in total.

Phase t >= 1 is the tasks ``train/t/*`` and ``outer/t/*`` (:mod:`megatron_ext.dipaco.run.plan`).
For module m = (l, e), S_m bytes as stored, used by the P_m = P / K_l paths:

- **workers write** each path's trained copy: ``train/t/p`` writes ``l{l}.pt``, P_m · S_m;
- **the outer executor** (``outer/t/m``) reads the global module and its outer momentum
  (``module.pt`` of ``outer/t-1/m``, 2 · S_m) and the P_m path copies (P_m · S_m), and writes
  the new module and momentum (``module.pt``, 2 · S_m: the momentum is kept in the module's
  dtypes, :func:`megatron_ext.dipaco.steps.outer.apply_outer_step`);
- **workers read** the versions they start from: ``train/t/p`` loads ``module.pt`` of
  ``outer/t-1/m`` whole for each of its modules (:meth:`RunFiles.module
  <megatron_ext.dipaco.run.store.RunFiles.module>`), the momentum it does not use included:
  P_m · 2 · S_m.

Phase 0 writes the same, reads the same path copies, but its versions are the base model's
(``model.pt`` of the base task, loaded whole once per worker process and kept): no
``module.pt`` and no momentum is read. Not counted in the store totals: ``state.pt``, which
each train task writes and the path's next one reads (the path's own: its path-specific
parameters, their outer
momentum -- the train task applies the outer step to them itself, P = 1, paper Sec. 2.6.1 --
and the inner optimizer state); ``path_specific_bytes`` says how big the parameters in it are,
``path_specific_momentum_bytes`` their momentum (the same size, kept in the parameters'
dtypes), and they move 0 bytes to an outer executor.

Sizes: the elements are :func:`megatron_ext.planner.params.gpt_parameters` (megatron-core's
``GPTModel.named_parameters()`` as the worker builds it) split into modules by the layout's own
:meth:`~megatron_ext.dipaco.model.layout.PathLayout.param_level`. Bytes per element: the
worker's model is a ``GPTModel`` *not* wrapped in ``Float16Module``
(:class:`megatron_ext.dipaco.model.path_model.PathModel`), so linears and embeddings have the
precision's parameter dtype, and norms too on Transformer Engine's layers; megatron-core's
local-spec norms (torch's, Apex's) ignore ``params_dtype`` and stay float32 (what a CPU worker
builds: ``model.transformer_impl=local``, or ``auto`` without TE). ``auto`` is planned as
Transformer Engine, as the GPT plan does.

DiLoCo: this trainer's DiLoCo is ``dipaco.modules_per_level: [1]``, one module holding every
shared part and one path (P = prod K_l = 1): its outer step reads one path copy. The paper's
DiLoCo baseline, P workers on P shards sharing every parameter, is not a configuration of this
trainer's layouts with parts at every level; it is a level of no parts (``dipaco.level_parts:
["", ...]``, :mod:`megatron_ext.dipaco.model.layout`): K_0 empty modules that move 0 bytes, and one
module holding every part read by all P = K_0 paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_ext.config.load import read_recipe
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import get_trainer
from megatron_ext.dipaco.model.layout import ModuleId, PathLayout
from megatron_ext.dipaco.recipe import DipacoConfig, path_layout
from megatron_ext.errors import ConfigError
from megatron_ext.planner.inputs import fused_attention, plan_vocab_size, planned_model
from megatron_ext.planner.params import PlannedParam, gpt_parameters
from megatron_ext.run.precision import precision_spec

__all__ = [
    "ModuleTraffic",
    "OuterFigures",
    "WorkerTraffic",
    "dipaco_vocab_size",
    "format_outer",
    "outer_figures",
    "plan_outer",
    "stored_dtype",
]

_BYTES = {"float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ModuleTraffic:
    """One shared module's bytes in one phase t >= 1 (see the module docstring)."""

    module: ModuleId
    paths: tuple[int, ...]  # the P_m paths that use it, ascending
    elements: dict[str, int]  # elements by stored dtype name ("bfloat16", "float32")
    module_bytes: int  # S_m: one copy of its parameters as stored

    @property
    def numel(self) -> int:
        return sum(self.elements.values())

    @property
    def workers_write(self) -> int:
        """Each path's trained copy (``l{l}.pt`` of ``train/t/p``): P_m · S_m."""
        return len(self.paths) * self.module_bytes

    @property
    def outer_read_paths(self) -> int:
        """The path copies the outer executor loads: P_m · S_m."""
        return len(self.paths) * self.module_bytes

    @property
    def outer_read_global(self) -> int:
        return self.module_bytes

    @property
    def outer_read_momentum(self) -> int:
        return self.module_bytes

    @property
    def outer_read(self) -> int:
        return self.outer_read_paths + self.outer_read_global + self.outer_read_momentum

    @property
    def outer_write(self) -> int:
        """The new module and its momentum (``module.pt``): 2 · S_m."""
        return 2 * self.module_bytes

    @property
    def workers_read(self) -> int:
        """The version each user path starts the phase from, ``module.pt`` whole (parameters and
        the unused momentum): P_m · 2 · S_m."""
        return len(self.paths) * 2 * self.module_bytes

    def as_dict(self) -> dict[str, Any]:
        return {
            "module": self.module.name,
            "level": self.module.level,
            "index": self.module.index,
            "paths": list(self.paths),
            "numel": self.numel,
            "elements_by_dtype": dict(self.elements),
            "module_bytes": self.module_bytes,
            "workers_write": self.workers_write,
            "outer_read": {
                "paths": self.outer_read_paths,
                "global": self.outer_read_global,
                "momentum": self.outer_read_momentum,
                "total": self.outer_read,
            },
            "outer_write": self.outer_write,
            "workers_read": self.workers_read,
        }


@dataclass(frozen=True)
class WorkerTraffic:
    """What the worker training one path moves in one phase: its modules, one per level (the
    same for every path: a level's modules hold the same parts)."""

    level_bytes: tuple[int, ...]  # S of its module at each level
    path_specific_bytes: int  # its own parameters (in state.pt, never sent to an executor)

    @property
    def path_specific_momentum_bytes(self) -> int:
        """The outer momentum of its own parameters (in state.pt beside them, same dtypes)."""
        return self.path_specific_bytes

    @property
    def writes(self) -> int:
        """Its trained copy of each of its modules (``l{l}.pt``)."""
        return sum(self.level_bytes)

    @property
    def reads(self) -> int:
        """The version of each of its modules it starts from (``module.pt`` whole)."""
        return 2 * sum(self.level_bytes)

    def as_dict(self) -> dict[str, Any]:
        return {
            "level_bytes": list(self.level_bytes),
            "writes": self.writes,
            "reads": self.reads,
            "path_specific_bytes": self.path_specific_bytes,
            "path_specific_momentum_bytes": self.path_specific_momentum_bytes,
        }


@dataclass(frozen=True)
class OuterFigures:
    """One DiPaCo phase's store bytes (see the module docstring)."""

    recipe: str
    modules_per_level: tuple[int, ...]
    num_paths: int
    tau: int
    phases: int
    precision: str
    transformer_engine: bool  # norms stored in the parameter dtype (else float32)
    vocab: int  # before padding
    vocab_source: str
    modules: tuple[ModuleTraffic, ...]
    worker: WorkerTraffic
    path_specific_numel: int
    notes: tuple[str, ...] = ()

    @property
    def diloco(self) -> bool:
        """The trainer's DiLoCo: one module, one path (``modules_per_level: [1]``)."""
        return self.num_paths == 1

    @property
    def workers_write(self) -> int:
        return sum(m.workers_write for m in self.modules)

    @property
    def outer_read(self) -> int:
        return sum(m.outer_read for m in self.modules)

    @property
    def outer_write(self) -> int:
        return sum(m.outer_write for m in self.modules)

    @property
    def workers_read(self) -> int:
        return sum(m.workers_read for m in self.modules)

    @property
    def store_bytes(self) -> int:
        """Everything the phase's train and outer tasks move through the store for the outer
        step: written and read, both sides."""
        return self.workers_write + self.outer_read + self.outer_write + self.workers_read

    @property
    def shared_bytes(self) -> int:
        """One path's shared parameters (its modules), S summed over the levels."""
        return self.worker.writes

    def as_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "phase": "t >= 1 (train/t/* and outer/t/*)",
            "modules_per_level": list(self.modules_per_level),
            "num_paths": self.num_paths,
            "diloco": self.diloco,
            "tau": self.tau,
            "phases": self.phases,
            "precision": self.precision,
            "norms_in_param_dtype": self.transformer_engine,
            "vocab_size": self.vocab,
            "vocab_source": self.vocab_source,
            "modules": [m.as_dict() for m in self.modules],
            "per_worker": self.worker.as_dict(),
            "path_specific_numel": self.path_specific_numel,
            "totals": {
                "workers_write": self.workers_write,
                "outer_read": self.outer_read,
                "outer_write": self.outer_write,
                "workers_read": self.workers_read,
                "store_bytes": self.store_bytes,
            },
            "notes": list(self.notes),
        }


def stored_dtype(name: str, precision: str, transformer_engine: bool) -> str:
    """The dtype a worker stores GPTModel parameter ``name`` in (see the module docstring)."""
    dtype = precision_spec(precision).params_dtype
    norm = name.rsplit(".", 1)[0].endswith("layernorm")
    return "float32" if norm and not transformer_engine else dtype


def dipaco_vocab_size(recipe: Recipe) -> tuple[int, str]:
    """(vocabulary before padding, where it comes from): ``model.vocab_size``, else the
    tokenizer's (:func:`megatron_ext.planner.inputs.plan_vocab_size`), else -- a SentencePiece
    model that does not exist yet -- the ``dipaco.tokenizer_vocab_size`` pieces the prepare
    task trains on ``data.source``."""
    m, data = recipe.model, recipe.data
    if m.vocab_size:
        return int(m.vocab_size), "model.vocab_size"
    missing = not Path(data.tokenizer_model).is_file()
    if data.tokenizer == "sentencepiece" and missing and data.source:
        size = recipe.section(DipacoConfig).tokenizer_vocab_size
        return size, (
            "dipaco.tokenizer_vocab_size: the prepare task trains data.tokenizer_model, missing "
            "here, on data.source (pass model.vocab_size=N for another tokenizer)"
        )
    return plan_vocab_size(recipe), f"the {data.tokenizer} tokenizer"


def outer_figures(recipe: Recipe, name: str = "", vocab_size: int | None = None) -> OuterFigures:
    """One phase's store bytes for a ``trainer: dipaco`` recipe (checked first: its layout,
    sizes and parallel sizes). ``vocab_size`` overrides :func:`dipaco_vocab_size`."""
    if get_trainer(recipe.trainer).plan != "outer":
        raise ConfigError(
            f"outer-step bytes are DiPaCo's: a trainer={recipe.trainer} recipe has no outer "
            "step (use a trainer: dipaco recipe)"
        )
    recipe.check()
    d, layout = recipe.section(DipacoConfig), path_layout(recipe)
    vocab, source = (vocab_size, "given") if vocab_size else dipaco_vocab_size(recipe)
    te = fused_attention(recipe)
    params = gpt_parameters(
        planned_model(recipe),
        recipe.parallel,
        vocab_size=vocab,
        seq_length=recipe.training.seq_length,
    )
    by_level = _elements_by_level(params, layout, recipe.training.precision, te)
    level_bytes = {level: _bytes(elements) for level, elements in by_level.items()}
    modules = tuple(
        ModuleTraffic(m, layout.paths_of(m), dict(by_level[m.level]), level_bytes[m.level])
        for m in layout.modules
    )
    specific = by_level.get(None, {})
    worker = WorkerTraffic(
        tuple(level_bytes[level] for level in range(layout.num_levels)), _bytes(specific)
    )
    notes = [
        "phase 0 writes the same and reads the same path copies; its versions come from the "
        "base model (read whole once per worker process), so it reads no module.pt and no "
        "momentum",
        "state.pt (path-specific parameters, their outer momentum -- the train task takes "
        "their outer step, P = 1 -- and the inner optimizer state) is written and read by "
        "the path's own train tasks every phase, not counted",
    ]
    if layout.num_paths == 1:
        notes.append(
            "DiLoCo as this trainer runs it: one module, one path (modules_per_level all 1); "
            "the paper's P-worker DiLoCo is not a configuration here"
        )
    return OuterFigures(
        recipe=name,
        modules_per_level=layout.modules_per_level,
        num_paths=layout.num_paths,
        tau=d.tau,
        phases=d.phases,
        precision=recipe.training.precision,
        transformer_engine=te,
        vocab=vocab,
        vocab_source=source,
        modules=modules,
        worker=worker,
        path_specific_numel=sum(specific.values()),
        notes=tuple(notes),
    )


def plan_outer(
    recipe: str | Path, overrides: Sequence[str] = (), vocab_size: int | None = None
) -> OuterFigures:
    """:func:`outer_figures` of a recipe file or shipped recipe name, read with
    :func:`megatron_ext.config.load.read_recipe` and ``key=value`` overrides."""
    return outer_figures(read_recipe(recipe, overrides), Path(recipe).stem, vocab_size)


def _elements_by_level(
    params: Sequence[PlannedParam], layout: PathLayout, precision: str, te: bool
) -> dict[int | None, dict[str, int]]:
    """Elements by stored dtype of each level's module (None: the path-specific parts)."""
    out: dict[int | None, dict[str, int]] = {level: {} for level in range(layout.num_levels)}
    for p in params:
        level = out.setdefault(layout.param_level(p.name), {})
        dtype = stored_dtype(p.name, precision, te)
        level[dtype] = level.get(dtype, 0) + p.numel
    return out


def _bytes(elements: dict[str, int]) -> int:
    return sum(_BYTES[dtype] * n for dtype, n in elements.items())


# --------------------------------------------------------------------------- text


def _size(n: int) -> str:
    """Bytes in decimal units, 4 significant digits."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} B"


def format_outer(figures: OuterFigures) -> str:
    """The figures as text: the layout, one row per level (a level's modules are alike: the
    same parts, P / K_l paths each), the phase's totals and one worker's."""
    f = figures
    norms = "in the parameter dtype" if f.transformer_engine else "float32 (local spec)"
    columns = (
        "level", "modules", "paths", "elements", "one copy", "workers write",
        "outer reads", "outer writes", "workers read",
    )  # fmt: skip
    rows = [columns]
    for level, k in enumerate(f.modules_per_level):
        m = next(x for x in f.modules if x.module.level == level)
        sizes = (m.module_bytes, m.workers_write, m.outer_read, m.outer_write, m.workers_read)
        rows.append(
            (str(level), str(k), str(len(m.paths)), f"{m.numel:,}", *(_size(b) for b in sizes))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    table = ["    " + "  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    w = f.worker
    name = f" of {f.recipe}" if f.recipe else ""
    return "\n".join(
        [
            f"DiPaCo outer round{name}: one phase (t >= 1), bytes through the run's store",
            f"  layout: modules_per_level {list(f.modules_per_level)}, P = {f.num_paths} paths, "
            f"tau = {f.tau} inner steps per phase, {f.phases} phases",
            f"  stored: {f.precision}, norms {norms}; vocabulary {f.vocab} ({f.vocab_source})",
            "  per module (outer reads = the path copies + the global module + its momentum;"
            " outer writes = module + momentum; workers read module.pt whole):",
            *table,
            f"  per phase: workers write {_size(f.workers_write)}, outer executors read "
            f"{_size(f.outer_read)} and write {_size(f.outer_write)}, workers read "
            f"{_size(f.workers_read)}: {_size(f.store_bytes)} ({f.store_bytes:,} B)",
            f"  per worker (one path, {len(w.level_bytes)} module(s)): writes {_size(w.writes)}, "
            f"reads {_size(w.reads)}; its {f.path_specific_numel:,} path-specific elements "
            f"({_size(w.path_specific_bytes)}, + {_size(w.path_specific_momentum_bytes)} of "
            f"outer momentum: the worker takes their outer step) stay with it",
            *(f"  note: {n}" for n in f.notes),
        ]
    )
