"""What each optimizer declares about itself: one :class:`OptimizerSpec`, registered by name.

No torch here, nor in the spec modules: the recipe schema, which the launcher validates before
any process starts, takes its ``optimizer:`` fields, their defaults, bounds and choices from the
specs. At run time the factories (keyword hyperparameters), the parameter routing and the
layer-wise optimizer (does the update couple a matrix's entries?), the ownership plan (flops and
state bytes per matrix) and the update-RMS matching read the same specs.

Adding an optimizer: its code (a ``torch.optim.Optimizer``), a ``<name>_spec.py`` module with a
``SPEC``, and that spec as an entry point of the group ``megatron_ext.optimizers`` (``muon =
megatron_ext.optimizers.muon_spec:SPEC`` in ``setup.py``; another distribution declares its own
the same way, :mod:`megatron_ext.registry`). In-process (a test, a script),
:func:`register_optimizer` before the optimizer is built.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from megatron_ext.registry import Registry

__all__ = [
    "BASE",
    "OPTIMIZERS",
    "SHARED_FIELDS",
    "Hyperparameter",
    "MegatronNames",
    "NoOptions",
    "OptimizerSpec",
    "optimizer_spec",
    "option",
    "recipe_hyperparameters",
    "register_optimizer",
    "registered_optimizers",
]


def option(
    default: bool | int | float | str,
    *,
    kwarg: str = "",
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    help: str = "",
    formerly: tuple[str, ...] = (),
) -> Any:
    """One field of an optimizer's options dataclass (:attr:`OptimizerSpec.options`).

    The field's annotation is its type (``float``, ``bool``, a ``Literal`` alias of
    :mod:`.options` for a closed set); ``kwarg``: the optimizer's keyword (default: the field's
    name); ``ge``/``gt``/``le``/``lt``: numeric bounds; ``help``: what it is, with its convention
    (which β weighs what, absolute or relative ε); ``formerly``: older recipe keys for it (a
    recipe using one is refused with the new name). The recipe loader reads the same metadata
    keys as every other recipe field's (:func:`megatron_ext.config.fields.spec`)."""
    meta = {
        "ge": ge,
        "gt": gt,
        "le": le,
        "lt": lt,
        "choices": None,
        "help": help,
        "kwarg": kwarg,
        "formerly": formerly,
    }
    return field(default=default, metadata=meta)


@dataclass(kw_only=True)
class NoOptions:
    """The options of an optimizer that has none of its own (AdamW: only the shared fields)."""


@dataclass(frozen=True, kw_only=True)
class Hyperparameter:
    """One optimizer option as the recipe field ``optimizer.<optimizer>_<key>``: a read-only
    view of a field of the optimizer's options dataclass (:meth:`OptimizerSpec.hyperparameters`).

    Attributes:
        key: the field's name, the recipe name after the optimizer's prefix (``muon_nesterov``
            -> ``nesterov``).
        default: the recipe default.
        type: the field's resolved annotation (``float``, ``bool``, a ``Literal``).
        kwarg: the optimizer's keyword (default: ``key``).
        ge, gt, le, lt: numeric bounds.
        help: what it is, with its convention.
        formerly: older recipe keys for it.
    """

    key: str
    default: bool | int | float | str
    type: Any
    kwarg: str = ""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    help: str = ""
    formerly: tuple[str, ...] = ()

    @property
    def keyword(self) -> str:
        return self.kwarg or self.key

    @property
    def options(self) -> tuple[Any, ...] | None:
        """The allowed values of a ``Literal`` option, else None."""
        return get_args(self.type) if typing.get_origin(self.type) is typing.Literal else None


@dataclass(frozen=True, kw_only=True)
class MegatronNames:
    """How megatron-core's ``OptimizerConfig`` and Megatron-LM's command line spell an optimizer:
    read by the drop-in ``get_megatron_optimizer`` (:mod:`megatron_ext.megatron.drop_in`), the
    converter of Megatron-LM flags (``recipe from-megatron-args``) and ``recipe check-megatron``.

    Attributes:
        optimizers: the ``--optimizer`` / ``OptimizerConfig.optimizer`` values that mean it
            (``soap`` for KL-SOAP); the drop-in also takes the optimizer's own name.
        fields: megatron-core ``OptimizerConfig`` field -> the recipe's optimizer key it sets
            (``muon_tp_mode`` -> ``tp_mode``), for the drop-in.
        choices: megatron-core field -> {its spelling: the recipe's} where they differ
            (``shape_scaling`` -> ``shape``); a value without one is refused.
        derived: recipe key -> (megatron-core field, its value -> the recipe's): a second
            recipe key read from a field already mapped (``muon_fp32_matmul_prec`` "medium"
            is bf16 Newton–Schulz).
        ignored: megatron-core fields the drop-in does not honour -> why (a warning).
        core_defaults: recipe keys whose default differs from megatron-core's meaning ->
            megatron-core's (``muon_ns_method`` "plain": it has no Gram variant).
        flags: Megatron-LM flag -> the recipe's optimizer key, for the flags the converter
            maps one to one (their values are the recipe's type; a ``bool`` one is a switch).
        flag_defaults: Megatron-LM's argparse defaults of its flags, where the recipe's
            defaults differ (recipe key -> value), written by the converter when not given.
    """

    optimizers: tuple[str, ...] = ()
    fields: Mapping[str, str] = field(default_factory=dict)
    choices: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    derived: Mapping[str, tuple[str, Callable[[Any], Any]]] = field(default_factory=dict)
    ignored: Mapping[str, str] = field(default_factory=dict)
    core_defaults: Mapping[str, Any] = field(default_factory=dict)
    flags: Mapping[str, str] = field(default_factory=dict)
    flag_defaults: Mapping[str, Any] = field(default_factory=dict)


#: Recipe fields shared by several optimizers -> the keyword hyperparameters they set.
SHARED_FIELDS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "lr": lambda c: {"lr": c.lr},
    "weight_decay": lambda c: {"weight_decay": c.weight_decay},
    "adam": lambda c: {"betas": (c.adam_beta1, c.adam_beta2), "eps": c.adam_eps},
    "tp_mode": lambda c: {"tp_mode": c.tp_mode},
}


def _no_check(section: Any) -> None:
    return None


def _no_own_factor(section: Any) -> float | None:
    return None


@dataclass(frozen=True, kw_only=True)
class OptimizerSpec:
    """Everything outside an optimizer's code needs to know about it.

    Attributes:
        name: registry and recipe name (``optimizer.name``).
        target: ``"module:Class"`` of the ``torch.optim.Optimizer``, imported when built.
        summary: one line for help texts.
        couples_matrix_entries: its update of a matrix depends on the whole matrix (Muon, MOP,
            KL-SOAP): tensor-parallel shards are gathered or handled in ``tp_modes``, and the
            layer-wise optimizer gives each matrix to one rank. Element-wise ones (AdamW, Lion)
            take any tensor, shards included.
        tp_modes: tensor-parallel modes it implements (matrix optimizers).
        full_state_tp_modes: the ``tp_modes`` in which a rank keeps the whole matrix's state
            for its shard (KL-SOAP's ``duplicated``: factors and bases of the full matrix);
            in the others ``state_bytes`` is of the shard's shape.
        uses: shared recipe fields it takes (keys of :data:`SHARED_FIELDS`).
        options: its own options, a ``kw_only`` dataclass whose fields are made by
            :func:`option` (each the recipe field ``optimizer.<name>_<field>``); the recipe's
            optimizer section holds one instance per registered optimizer
            (``section.options[name]``).
        fixed: keyword arguments always passed (not recipe options).
        pack: turns the per-field keywords into the optimizer's signature where they differ
            (e.g. Lion's ``beta1``, ``beta2`` fields into its ``betas`` tuple).
        update_rms_kwarg: keyword that multiplies its update; with
            ``optimizer.match_update_rms`` it is multiplied by ``optimizer.update_rms`` so the
            update's RMS is AdamW's (the update must then have RMS 1 with that keyword at 1:
            the sign update of Lion, the √max(m, n)-scaled polar factor of Muon and MOP).
            None: the update already has AdamW's RMS (AdamW, KL-SOAP's Adam in the eigenbasis).
        own_update_rms: for a recipe's optimizer section, the matching factor the optimizer
            applies itself
            (then ``optimizer.update_rms`` is not applied to ``update_rms_kwarg``), or None
            (Muon's and MOP's ``rms_match=beta``: √((1 − β)/(1 + β)) from their momentum).
        flops: ``(rows, cols, kwargs) -> FLOPs`` of one step of one ``rows×cols`` matrix (2 per
            multiply-add), given the optimizer's keyword hyperparameters.
        state_bytes: ``(rows, cols) -> bytes`` of fp32 optimizer state for one matrix.
        check: cross-field rule on a recipe's optimizer section; raises ``ValueError``.
        label: its name in tables and plots (``KL-SOAP``; default: ``name``).
        megatron: how megatron-core and Megatron-LM spell it (:class:`MegatronNames`; none:
            the drop-in takes it by its own name, ``--megatron-ext-optimizer NAME``).

    The callables that take a recipe's optimizer ``section`` read the shared fields as its
    attributes and this optimizer's options as :meth:`options_of` ``(section)``.
    """

    name: str
    target: str
    summary: str
    couples_matrix_entries: bool
    flops: Callable[[int, int, Mapping[str, Any]], float]
    state_bytes: Callable[[int, int], int]
    tp_modes: tuple[str, ...] = ()
    full_state_tp_modes: tuple[str, ...] = ()
    uses: tuple[str, ...] = ("lr", "weight_decay")
    options: type = NoOptions
    fixed: Mapping[str, Any] = field(default_factory=dict)
    pack: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    update_rms_kwarg: str | None = None
    own_update_rms: Callable[[Any], float | None] = _no_own_factor
    check: Callable[[Any], None] = _no_check
    label: str = ""
    megatron: MegatronNames = field(default_factory=MegatronNames)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.uses) - set(SHARED_FIELDS))
        if unknown:
            raise ValueError(f"optimizer {self.name!r}: unknown shared fields {unknown}")
        if self.couples_matrix_entries and not self.tp_modes:
            raise ValueError(f"matrix optimizer {self.name!r} must declare its tp_modes")
        if not (dataclasses.is_dataclass(self.options) and isinstance(self.options, type)):
            raise ValueError(f"optimizer {self.name!r}: options must be a dataclass type")

    @property
    def hyperparameters(self) -> tuple[Hyperparameter, ...]:
        """Its options, one :class:`Hyperparameter` per field of :attr:`options`."""
        hints = typing.get_type_hints(self.options)
        out = []
        for f in dataclasses.fields(self.options):
            meta = f.metadata
            out.append(
                Hyperparameter(
                    key=f.name,
                    default=f.default,  # type: ignore[arg-type]  # option() always sets one
                    type=hints[f.name],
                    kwarg=meta.get("kwarg", ""),
                    ge=meta.get("ge"),
                    gt=meta.get("gt"),
                    le=meta.get("le"),
                    lt=meta.get("lt"),
                    help=meta.get("help", ""),
                    formerly=tuple(meta.get("formerly", ())),
                )
            )
        return tuple(out)

    @property
    def display(self) -> str:
        """Its name in tables and plots."""
        return self.label or self.name

    def field_name(self, hp: Hyperparameter) -> str:
        """The recipe field of ``hp``: ``<optimizer>_<key>``."""
        return f"{self.name}_{hp.key}"

    def options_of(self, section: Any) -> Any:
        """This optimizer's options (an :attr:`options` instance) in a recipe's optimizer
        section."""
        return section.options[self.name]

    def update_rms_factor(self, section: Any) -> float:
        """The update-RMS matching factor for a recipe section (1 if none): ``update_rms``, or
        the one the optimizer applies itself (:attr:`own_update_rms`)."""
        if self.update_rms_kwarg is None or not section.match_update_rms:
            return 1.0
        own = self.own_update_rms(section)
        return float(section.update_rms) if own is None else own

    def _spec_rms_factor(self, section: Any) -> float:
        """The part of :meth:`update_rms_factor` that :meth:`kwargs` multiplies in."""
        if self.update_rms_kwarg is not None and self.own_update_rms(section) is not None:
            return 1.0
        return self.update_rms_factor(section)

    def kwargs(self, section: Any) -> dict[str, Any]:
        """Keyword hyperparameters from a recipe's optimizer section (any object carrying the
        recipe fields as attributes), with the update-RMS matching applied."""
        out: dict[str, Any] = {}
        for shared in self.uses:
            out.update(SHARED_FIELDS[shared](section))
        own = self.options_of(section)
        for hp in self.hyperparameters:
            out[hp.keyword] = getattr(own, hp.key)
        out.update(self.fixed)
        if self.pack is not None:
            out = self.pack(out)
        if self.update_rms_kwarg is not None:
            base = out.get(self.update_rms_kwarg, 1.0)
            out[self.update_rms_kwarg] = base * self._spec_rms_factor(section)
        return out

    def optimizer_class(self) -> type:
        """The optimizer class (imports torch)."""
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


#: The optimizer of every parameter a matrix optimizer does not take (embeddings, norms, biases).
BASE = "adamw"

#: ``optimizer.name`` -> its spec; the group ``megatron_ext.optimizers``.
OPTIMIZERS: Registry[OptimizerSpec] = Registry(
    "optimizer",
    "megatron_ext.optimizers",
    of=OptimizerSpec,
    key="optimizer.name",
    shipped={
        name: f"megatron_ext.optimizers.{name}_spec:SPEC"
        for name in ("adamw", "kl_soap", "lion", "mop", "muon")
    },
)


def register_optimizer(spec: OptimizerSpec) -> OptimizerSpec:
    """Add ``spec`` in-process (a name may be registered once); returns it."""
    return OPTIMIZERS.register(spec)


def registered_optimizers() -> dict[str, OptimizerSpec]:
    """Every registered spec by name, the shipped ones first."""
    return dict(OPTIMIZERS.items())


def optimizer_spec(name: str) -> OptimizerSpec:
    """The spec registered as ``name``; ``ConfigError`` (a ``ValueError``) listing the
    registered names if none."""
    return OPTIMIZERS.get(name)


def recipe_hyperparameters(section: Any) -> dict[str, dict[str, Any]]:
    """Keyword hyperparameters of a recipe's optimizer (``section.name``) and of AdamW (the
    non-matrix part), from their specs, with the update-RMS matching applied."""
    names = dict.fromkeys((section.name, BASE))
    return {name: optimizer_spec(name).kwargs(section) for name in names}
