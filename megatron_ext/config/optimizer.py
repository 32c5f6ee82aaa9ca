"""The recipe's ``optimizer:`` section: the shared fields, and every registered optimizer's options.

Shared fields (megatron-core ``OptimizerConfig`` names) are declared here. Each optimizer's own
options are a dataclass its spec declares (:attr:`~megatron_ext.optimizers.spec.OptimizerSpec.
options`: ``MuonOptions``), validated there; the section holds one instance per registered
optimizer in ``options``, and a recipe writes them flat as ``<optimizer>_<field>`` —
megatron-core's own ``muon_*``/``lion_*`` naming. So swapping ``optimizer.name`` in a recipe
reaches every option of the new optimizer, and a new optimizer's options appear without an edit
here.

One learning rate: with ``match_update_rms`` (default) every optimizer's update is scaled to
AdamW's update RMS (``update_rms``, 0.2), as the Muon/SOAP literature matches Muon to AdamW
(Liu et al., 2025, "Muon is scalable"): Muon and MOP multiply their spectrally scaled polar
factor (RMS 1) by it, Lion its sign update (RMS 1); AdamW and KL-SOAP (Adam in a rotated basis)
have that RMS already. ``muon_rms_match=beta`` (``mop_rms_match``) takes the paper's
√((1 − β)/(1 + β)) from the momentum β instead of ``update_rms`` (paper: Sec. 5.2).

No torch import (the launcher validates recipes before any process starts).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.config.fields import spec
from megatron_ext.errors import ConfigError
from megatron_ext.optimizers.options import MatrixRouting, TPMode
from megatron_ext.optimizers.spec import OptimizerSpec, optimizer_spec, registered_optimizers

__all__ = [
    "LOSS_SCALE_FIELDS",
    "OptimizerConfig",
    "option_field",
    "option_keys",
    "renamed_keys",
    "section_fields",
    "split_options",
    "update_rms_note",
]

#: fp16's loss-scale fields of the section (read with training.precision=fp16 only)
LOSS_SCALE_FIELDS = (
    "loss_scale",
    "initial_loss_scale",
    "min_loss_scale",
    "loss_scale_window",
    "hysteresis",
)


def _registered_options() -> dict[str, Any]:
    """Every registered optimizer's options at their defaults: name -> its options instance."""
    return {name: opt.options() for name, opt in registered_optimizers().items()}


@dataclass(kw_only=True)
class OptimizerConfig:
    """The recipe's ``optimizer:`` section: the shared fields (megatron-core ``OptimizerConfig``
    names) and, in ``options``, every registered optimizer's own options (each an instance of
    its spec's :attr:`~megatron_ext.optimizers.spec.OptimizerSpec.options` dataclass; a recipe
    writes them flat, ``muon_momentum: 0.9``, :func:`split_options`)."""

    name: str = spec("adamw", help="a registered optimizer (megatron_ext.optimizers.spec)")
    lr: float = spec(3e-4, gt=0.0)
    min_lr: float = spec(0.0, ge=0.0)
    weight_decay: float = spec(0.1, ge=0.0)
    adam_beta1: float = spec(0.9, ge=0.0, le=1.0, help="weight of the old first moment")
    adam_beta2: float = spec(0.95, ge=0.0, le=1.0, help="weight of the old second moment")
    adam_eps: float = spec(1e-8, gt=0.0, help="added to sqrt(v_hat) (absolute)")
    clip_grad: float = spec(1.0, ge=0.0, help="global grad-norm clip; 0 = off")
    decoupled_lr: float | None = spec(
        None,
        gt=0.0,
        help="peak LR of the word embeddings and the output layer (megatron-core's "
        "decoupled_lr: the parameters it marks is_embedding_or_output_parameter, always "
        "in AdamW); their schedule is the run's, from the same warmup start; none = "
        "optimizer.lr",
    )
    decoupled_min_lr: float | None = spec(
        None,
        ge=0.0,
        help="the decoupled LR's floor (megatron-core's decoupled_min_lr); none = optimizer.min_lr",
    )
    tp_mode: TPMode = spec(
        "duplicated",
        help="matrix optimizers under tensor parallelism: duplicated = gather the shards, "
        "TP=1 update; distributed = Muon's NS with all-reduced Gram products; blockwise = "
        "each shard alone (not TP=1-equivalent)",
    )
    match_update_rms: bool = spec(
        True,
        help="scale every optimizer's update to AdamW's update RMS (optimizer.update_rms), "
        "so that one optimizer.lr serves the matrix optimizer and the AdamW part",
    )
    update_rms: float = spec(0.2, gt=0.0, help="AdamW's update RMS, the matching target")
    matrix_routing: MatrixRouting = spec(
        "megatron_ext",
        help="which parameters the matrix optimizer takes: megatron_ext = hidden matrices "
        "(AdamW for every embedding, the output layer, norms, biases, MoE routers); "
        "megatron_core = every 2-D parameter but the word embeddings and the output layer, "
        "as megatron-core's get_megatron_optimizer routes Muon",
    )
    split_qkv: bool = spec(
        False,
        help="Muon/MOP: orthogonalise Q, K and V of a fused linear_qkv.weight separately "
        "(megatron-core's muon_split_qkv, its default there)",
    )
    # fp16's loss scale (megatron-core OptimizerConfig's fields, Megatron-LM's --loss-scale,
    # --initial-loss-scale, ...; megatron_ext.megatron.loss_scale): read with
    # training.precision=fp16 only
    loss_scale: float | None = spec(
        None, gt=0.0, help="fp16: a constant loss scale; none = the dynamic scale below"
    )
    initial_loss_scale: float = spec(
        2.0**32, gt=0.0, help="fp16: the dynamic loss scale's start (megatron-core: 2**32)"
    )
    min_loss_scale: float = spec(1.0, gt=0.0, help="fp16: the dynamic loss scale's floor")
    loss_scale_window: int = spec(
        1000, ge=1, help="fp16: steps without an overflow before the scale doubles"
    )
    hysteresis: int = spec(
        2, ge=1, help="fp16: overflowing steps before the scale halves (megatron-core's rule)"
    )
    options: dict[str, Any] = field(
        default_factory=_registered_options, metadata={"optimizer_options": True}
    )

    def __post_init__(self) -> None:
        optimizer_spec(self.name)  # an unknown name: UnknownName (a ConfigError), did-you-mean
        for name, opt in registered_optimizers().items():
            self.options.setdefault(name, opt.options())

    @property
    def spec(self) -> OptimizerSpec:
        """The spec of ``name``."""
        return optimizer_spec(self.name)

    def of[T](self, kind: type[T]) -> T:
        """The options of type ``kind`` (``cfg.of(MuonOptions).momentum``)."""
        for value in self.options.values():
            if type(value) is kind:
                return value
        raise KeyError(f"no registered optimizer has options of type {kind.__name__}")

    def check(self) -> None:
        """Cross-field rules of the section (the chosen optimizer's, and its TP modes)."""
        _check(self)

    def flat(self) -> dict[str, Any]:
        """The section as a recipe writes it: the shared fields, then every registered
        optimizer's options as ``<optimizer>_<field>``."""
        out = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"
        }
        for name, own in self.options.items():
            out.update({f"{name}_{k}": v for k, v in dataclasses.asdict(own).items()})
        return out


def split_options(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Split a recipe's flat ``optimizer:`` mapping into the shared keys and, per registered
    optimizer, its options (``muon_momentum`` -> ``{"muon": {"momentum": ...}}``). A key that
    names no option stays with the shared keys (the loader names it as unknown)."""
    shared: dict[str, Any] = {}
    own: dict[str, dict[str, Any]] = {}
    specs = registered_optimizers()
    fields = {
        name: {f.name for f in dataclasses.fields(opt.options)} for name, opt in specs.items()
    }
    for key, value in raw.items():
        owner = next(
            (
                n
                for n in fields
                if str(key).startswith(f"{n}_") and str(key)[len(n) + 1 :] in fields[n]
            ),
            None,
        )
        if owner is None:
            shared[key] = value
        else:
            own.setdefault(owner, {})[str(key)[len(owner) + 1 :]] = value
    return shared, own


def section_fields() -> dict[str, tuple[Any, Any]]:
    """Every key of the ``optimizer:`` section as a recipe writes it -> its dataclass field and
    resolved type: the shared fields, then each registered optimizer's options
    (``muon_momentum``)."""
    hints = typing.get_type_hints(OptimizerConfig)
    out = {
        f.name: (f, hints[f.name])
        for f in dataclasses.fields(OptimizerConfig)
        if f.name != "options"
    }
    for name, opt in registered_optimizers().items():
        own = typing.get_type_hints(opt.options)
        out.update({f"{name}_{f.name}": (f, own[f.name]) for f in dataclasses.fields(opt.options)})
    return out


def option_field(key: str) -> tuple[Any, Any] | None:
    """The field of an optimizer's options dataclass a flat recipe key names
    (``muon_momentum``) and its resolved type, or None."""
    _, own = split_options({key: None})
    for name, given in own.items():
        kind = registered_optimizers()[name].options
        (leaf,) = given
        found = {f.name: f for f in dataclasses.fields(kind)}[leaf]
        return found, typing.get_type_hints(kind)[leaf]
    return None


def option_keys() -> list[str]:
    """Every registered optimizer's options as recipe keys (``muon_momentum``, ...)."""
    return [
        f"{name}_{f.name}"
        for name, opt in registered_optimizers().items()
        for f in dataclasses.fields(opt.options)
    ]


def renamed_keys() -> dict[str, list[str]]:
    """Older recipe keys of the options -> the keys that replaced them."""
    renamed: dict[str, list[str]] = {}
    for opt in registered_optimizers().values():
        for hp in opt.hyperparameters:
            for old in hp.formerly:
                renamed.setdefault(old, []).append(opt.field_name(hp))
    return renamed


def _check(cfg: Any) -> None:
    """Cross-field rules of the section (the chosen optimizer's, and its TP modes)."""
    opt = optimizer_spec(cfg.name)
    _check_decoupled(cfg)
    if cfg.loss_scale is None and cfg.min_loss_scale > cfg.initial_loss_scale:
        raise ConfigError(
            f"optimizer.min_loss_scale={cfg.min_loss_scale:g} exceeds optimizer."
            f"initial_loss_scale={cfg.initial_loss_scale:g}: lower the floor"
        )
    if cfg.split_qkv and cfg.name not in ("muon", "mop"):
        raise ConfigError(
            f"optimizer.split_qkv=true orthogonalises Q, K and V separately, which only Muon "
            f"and MOP do; optimizer.name={cfg.name}: set optimizer.split_qkv=false"
        )
    if opt.couples_matrix_entries and cfg.tp_mode not in opt.tp_modes:
        raise ConfigError(
            f"optimizer.tp_mode={cfg.tp_mode} is not supported by optimizer.name={cfg.name}; "
            f"it supports tp_mode={' or '.join(opt.tp_modes)}"
        )
    try:
        opt.check(cfg)
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_decoupled(cfg: Any) -> None:
    """The decoupled LR's floor needs the decoupled LR, and lies below it (megatron-core's
    scheduler would otherwise raise the embedding's LR while the rest decays)."""
    if cfg.decoupled_lr is None:
        if cfg.decoupled_min_lr is not None:
            raise ConfigError(
                f"optimizer.decoupled_min_lr={cfg.decoupled_min_lr} is the floor of "
                "optimizer.decoupled_lr, which is not set: set optimizer.decoupled_lr or "
                "remove optimizer.decoupled_min_lr"
            )
        return
    floor = cfg.min_lr if cfg.decoupled_min_lr is None else cfg.decoupled_min_lr
    if floor > cfg.decoupled_lr:
        named = "optimizer.min_lr" if cfg.decoupled_min_lr is None else "optimizer.decoupled_min_lr"
        raise ConfigError(
            f"the decoupled LR's floor {named}={floor} exceeds optimizer.decoupled_lr="
            f"{cfg.decoupled_lr}: set optimizer.decoupled_min_lr <= optimizer.decoupled_lr"
        )


def update_rms_note(cfg: Any) -> str:
    """One line saying how each optimizer's update is scaled (printed when training starts)."""
    parts = []
    for name in dict.fromkeys((cfg.name, "adamw")):
        opt = optimizer_spec(name)
        factor = opt.update_rms_factor(cfg)
        if opt.update_rms_kwarg is None:
            parts.append(f"{name} unscaled (its update already has AdamW's RMS)")
        elif cfg.match_update_rms and opt.own_update_rms(cfg) is not None:
            total = opt.kwargs(cfg)[opt.update_rms_kwarg] * factor  # the optimizer applies it
            parts.append(
                f"{name} update x {total:g} (RMS-match factor {factor:.4g} = √((1 − β)/(1 + β)) "
                "of its momentum β)"
            )
        else:
            total = opt.kwargs(cfg)[opt.update_rms_kwarg]
            parts.append(f"{name} update x {total:g} (RMS-match factor {factor:g})")
    state = "on" if cfg.match_update_rms else "off"
    return f"update-RMS matching {state} (target {cfg.update_rms:g}): " + "; ".join(parts)
