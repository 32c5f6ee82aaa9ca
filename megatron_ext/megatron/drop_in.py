"""A drop-in for megatron-core's ``get_megatron_optimizer``: swap the optimizer of a Megatron-LM
(or Megatron-Bridge) training script by changing one import::

    # from megatron.core.optimizer import get_megatron_optimizer
    from megatron_ext.megatron.drop_in import get_megatron_optimizer

Same signature as megatron-core 0.19's (a test compares them). For ``config.optimizer`` in
``adam``/``sgd`` it returns what megatron-core returns (it calls it). For ``muon``,
``kl_soap`` (and Megatron-LM's ``soap``, the converter's reading too),
``mop`` and ``lion`` it returns megatron-ext's layer-wise distributed optimizer
(each matrix updated by the data-parallel rank that owns it; AdamW for the rest) behind
megatron-ext's ``MegatronOptimizer`` adapter
(:class:`~.optimizer.MegatronExtOptimizer`), so the script's loop — megatron-core's
forward/backward schedule, ``finalize_model_grads``, ``optimizer.step()``, its
``OptimizerParamScheduler``, ``dist_checkpointing`` — is unchanged.

megatron-core's ``OptimizerConfig`` maps onto megatron-ext's ``optimizer:`` section
(:func:`extension_config`): the shared fields (``lr``, ``min_lr``, ``weight_decay``,
``adam_beta1/2``, ``adam_eps``, ``clip_grad``), ``muon_*`` (for MOP too: MOP is Muon with the
exact polar factor), ``muon_tp_mode`` -> ``tp_mode``, ``lion_beta1/2``,
``soap_shampoo_beta`` -> ``kl_soap_shampoo_beta``, ``soap_precondition_frequency`` ->
``kl_soap_refresh_every``, ``soap_use_kl_shampoo`` True/False -> ``kl_soap_factor_update``
``kl``/``shampoo``. **Extra fields**: any attribute set on the config instance under a
megatron-ext field name (``config.kl_soap_factor_eps = 1e-10``, ``config.update_rms = 0.2``,
``config.muon_ns_method = "gram"``) is taken as is; any other extra attribute is an error.
**Megatron-LM's meaning by default** (:data:`MEGATRON_CORE_DEFAULTS`): megatron-core's routing
(the matrix optimizer for every 2-D parameter but the word embeddings and the output layer),
no update-RMS matching, plain Newton–Schulz; ``muon_split_qkv`` splits fused QKV weights per
query group; ``muon_fp32_matmul_prec`` is torch's matmul precision during Newton–Schulz, and
its ``medium`` (megatron-core's default) also runs the iteration in bf16, as megatron-core's
Muon (Emerging-Optimizers) does; under megatron-core's routing the gradient norm that clipping
divides by is megatron-core's own arithmetic and order (:mod:`.mcore_grad_norm`), so that
``muon`` gives megatron-core's Muon's losses bit for bit. An extra attribute of a megatron-ext
field name overrides any of these. Fields megatron-ext cannot honour (MOP's
``muon_fp32_matmul_prec``: its polar factor is an SVD) are named once in a warning on rank 0.

Requirements, each checked with a message naming the fix: bf16 or fp32 parameters (no fp16
loss scaling); the model chunks' DDP with ``use_distributed_optimizer=False`` (the optimizer
needs whole gradients; it shards by matrix itself); megatron-core's weight-decay convention
(``config_overrides`` None or megatron-core's standard ones, no ``decoupled_lr``); the
process groups of ``parallel_state`` (``pg_collection`` None).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import torch
from megatron.core.optimizer import OptimizerConfig as McOptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer as mc_get_megatron_optimizer
from megatron.core.optimizer import get_standard_config_overrides
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.optimizer.optimizer_config import ParamKey
from megatron.core.optimizer_param_scheduler import ParamGroupOverride
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import MegatronModule
from megatron.core.utils import get_model_config

from megatron_ext.config.load import recipe_from_dict
from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.from_megatron import translate
from megatron_ext.megatron.mcore_grad_norm import McoreGradNorm
from megatron_ext.megatron.megatron_flags import megatron_optimizers
from megatron_ext.megatron.optimizer import MegatronExtOptimizer
from megatron_ext.megatron.optimizer_factories import inner_factory, model_qkv_layout
from megatron_ext.optimizers.spec import BASE, optimizer_spec, registered_optimizers

__all__ = [
    "MEGATRON_CORE_DEFAULTS",
    "extension_config",
    "extension_optimizers",
    "get_megatron_optimizer",
    "mapped_fields",
]

logger = logging.getLogger(__name__)

_SHARED = ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
# megatron-core's meaning where the recipe's default differs: its routing (every 2-D parameter
# but the word embeddings and the output layer) and its raw update scale, and each optimizer's
# own (its spec's megatron.core_defaults); an extra attribute of the same name on the config
# (config.match_update_rms = True) asks for megatron-ext's
MEGATRON_CORE_DEFAULTS: dict[str, Any] = {
    "match_update_rms": False,
    "matrix_routing": "megatron_core",
}


def extension_optimizers() -> tuple[str, ...]:
    """The registered optimizers the drop-in serves: every one but AdamW (megatron-core's
    ``adam`` serves it)."""
    return tuple(name for name in registered_optimizers() if name != BASE)


def get_megatron_optimizer(
    config: McOptimizerConfig,
    model_chunks: list[MegatronModule],
    config_overrides: dict[ParamKey, ParamGroupOverride] | None = None,
    use_gloo_process_groups: bool = True,
    pg_collection: ProcessGroupCollection | None = None,
    dump_param_to_param_group_map: str | None = None,
) -> MegatronOptimizer:
    """megatron-core's optimizer for ``adam``/``sgd``; megatron-ext's layer-wise one for
    ``muon``/``kl_soap`` (Megatron-LM's ``soap`` too)/``mop``/``lion`` (see the module
    docstring)."""
    if extension_name(config.optimizer) is None:
        return mc_get_megatron_optimizer(
            config,
            model_chunks,
            config_overrides=config_overrides,
            use_gloo_process_groups=use_gloo_process_groups,
            pg_collection=pg_collection,
            dump_param_to_param_group_map=dump_param_to_param_group_map,
        )
    _check_supported(config, model_chunks, config_overrides, pg_collection)
    ext = extension_config(config)
    named = _named_parameters(model_chunks)
    layout = model_qkv_layout(get_model_config(model_chunks[0])) if ext.split_qkv else None
    optimizer = MegatronExtOptimizer(named, inner_factory(ext, layout), config)
    if ext.matrix_routing == "megatron_core":  # megatron-core's norm, to the last bit
        optimizer.grad_norm_fn = McoreGradNorm(config, model_chunks)
    _tag_param_groups(optimizer, config)
    if dump_param_to_param_group_map is not None:
        _dump_groups(ext.name, ext.matrix_routing, named, dump_param_to_param_group_map)
    return optimizer


def mapped_fields() -> set[str]:
    """The ``optimizer:`` fields the drop-in reads from megatron-core fields (each spec's
    ``megatron.fields`` and ``megatron.derived``)."""
    out: set[str] = set()
    for spec in registered_optimizers().values():
        out |= set(spec.megatron.fields.values()) | set(spec.megatron.derived)
    return out


def extension_name(optimizer: str) -> str | None:
    """megatron-ext's optimizer for megatron-core's ``config.optimizer`` (the converter's
    reading, :func:`~megatron_ext.megatron.megatron_flags.megatron_optimizers`: ``soap`` ->
    ``kl_soap``), or None when megatron-core's own serves it (``adam``, ``sgd``)."""
    name = megatron_optimizers().get(optimizer)
    return name if name in extension_optimizers() else None


def extension_config(config: McOptimizerConfig) -> OptimizerConfig:
    """megatron-ext's ``optimizer:`` section for megatron-core's ``config`` (validated as a
    recipe section: a bad value is one ConfigError naming the field)."""
    name = extension_name(config.optimizer)
    if name is None:
        raise ConfigError(
            f"optimizer={config.optimizer!r} is megatron-core's own; megatron-ext's are "
            f"{', '.join(extension_optimizers())} (and soap, as kl_soap)"
        )
    names = optimizer_spec(name).megatron
    raw: dict[str, Any] = {"name": name, **MEGATRON_CORE_DEFAULTS, **names.core_defaults}
    for f in _SHARED:  # megatron-core leaves min_lr None by default: the section's 0 then
        if getattr(config, f) is not None or f == "lr":
            raw[f] = getattr(config, f)
    for theirs, ours in names.fields.items():
        value = getattr(config, theirs)
        table = names.choices.get(theirs)
        raw[ours] = value if table is None else translate(dict(table), value, theirs)
    for ours, (theirs, derive) in names.derived.items():
        raw[ours] = derive(getattr(config, theirs))
    if name == "muon" and config.muon_scalar_optimizer != "adam":
        raise ConfigError(
            f"muon_scalar_optimizer={config.muon_scalar_optimizer!r}: megatron-ext trains the "
            f"non-matrix parameters with AdamW; set muon_scalar_optimizer='adam'"
        )
    ours = set(OptimizerConfig().flat())  # the recipe's optimizer.* keys
    # megatron-core's fields, and the attributes its __post_init__ adds
    known = {f.name for f in dataclasses.fields(McOptimizerConfig)} | set(vars(McOptimizerConfig()))
    for key, value in vars(config).items():
        if key in known or key.startswith("_"):
            continue
        if key not in ours:
            raise ConfigError(
                f"OptimizerConfig has an extra attribute {key!r} that is no megatron-ext "
                f"optimizer field (those are the recipe's optimizer.* names, e.g. "
                f"kl_soap_factor_eps, update_rms, muon_ns_method)"
            )
        raw[key] = value
    ignored = [f"{k}={getattr(config, k)!r} ({why})" for k, why in names.ignored.items()]
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if ignored and rank0:
        logger.warning("megatron-ext %s does not use: %s", name, "; ".join(ignored))
    section = recipe_from_dict({"optimizer": raw}).optimizer
    section.check()
    return section


def _check_supported(
    config: McOptimizerConfig,
    model_chunks: list[MegatronModule],
    config_overrides: dict[ParamKey, ParamGroupOverride] | None,
    pg_collection: ProcessGroupCollection | None,
) -> None:
    name = config.optimizer
    if config.fp16:
        raise ConfigError(f"optimizer={name}: fp16 (loss scaling) is not supported; use bf16")
    for chunk in model_chunks:
        ddp = getattr(chunk, "ddp_config", None)
        if ddp is not None and ddp.use_distributed_optimizer:
            raise ConfigError(
                f"optimizer={name}: the model's DDP has use_distributed_optimizer=True, which "
                f"leaves each rank a gradient shard; megatron-ext's layer-wise optimizer needs "
                f"whole gradients (it shards by matrix itself): build DDP with "
                f"use_distributed_optimizer=False"
            )
    if config.decoupled_lr is not None or config.apply_wd_to_qk_layernorm:
        raise ConfigError(
            f"optimizer={name}: decoupled_lr and apply_wd_to_qk_layernorm are not supported "
            f"(megatron-ext: one LR; no weight decay on biases and 1-D tensors)"
        )
    if config_overrides is not None and config_overrides != get_standard_config_overrides(config):
        raise ConfigError(
            f"optimizer={name}: only megatron-core's standard config_overrides (no weight "
            f"decay on biases and 1-D tensors) are supported; pass config_overrides=None"
        )
    if pg_collection is not None:
        raise ConfigError(
            f"optimizer={name}: pg_collection is not supported; megatron-ext's layer-wise "
            f"optimizer uses megatron-core's parallel_state groups (pass pg_collection=None)"
        )


def _named_parameters(model_chunks: list[MegatronModule]) -> list[tuple[str, torch.nn.Parameter]]:
    """The chunks' parameters, named as in the model inside DDP and ``Float16Module``
    (``chunk<i>.`` first when there are several chunks, i.e. virtual pipeline stages)."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer.module import Float16Module

    named = []
    for i, chunk in enumerate(model_chunks):
        module = chunk
        while isinstance(module, (DistributedDataParallel, Float16Module)):
            module = module.module  # the GPTModel's own names, as the GPT trainer uses
        prefix = f"chunk{i}." if len(model_chunks) > 1 else ""
        named += [(prefix + n, p) for n, p in module.named_parameters()]
    return named


def _tag_param_groups(optimizer: MegatronExtOptimizer, config: McOptimizerConfig) -> None:
    """The keys megatron-core's ``OptimizerParamScheduler`` and Megatron-LM's logging read on
    each group: ``wd_mult`` (0 on the no-decay groups), ``lr_mult``, ``max_lr``/``min_lr``,
    ``default_config`` (the group whose LR is logged)."""
    for group in optimizer.param_groups:
        group.setdefault("wd_mult", 1.0 if group.get("weight_decay", 0.0) > 0 else 0.0)
        group.setdefault("lr_mult", 1.0)
        group.setdefault("is_decoupled_lr", False)
        group.setdefault("max_lr", config.lr)
        group.setdefault("min_lr", config.min_lr)
        group.setdefault("default_config", True)


def _dump_groups(
    name: str, rules: str, named: list[tuple[str, torch.nn.Parameter]], path: str
) -> None:
    """``{parameter name: optimizer}`` as JSON on rank 0 (megatron-core's option writes group
    indices; here a parameter's group is the optimizer the router gives it)."""
    from megatron_ext.optimizers.routing import route_parameter

    routes = {
        n: route_parameter(n, tuple(p.shape), matrix_optimizer=name, rules=rules) for n, p in named
    }
    if torch.distributed.get_rank() == 0:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(routes, f, indent=1)
