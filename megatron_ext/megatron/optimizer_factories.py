"""What the optimizer adapter wraps, built from a recipe's ``optimizer`` section.

:func:`inner_factory` returns a factory over named parameters: AdamW element-sharded over the
data-parallel group (ZeRO-1, :class:`~megatron_ext.distributed.sharded_adam.ShardedAdamW`), or
the layer-wise distributed optimizer for the hidden matrices with the rest in element-sharded
AdamW (dense weights over the data-parallel group, expert weights over the
expert-data-parallel group).
:class:`~.optimizer.MegatronExtOptimizer` calls it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from megatron.core import parallel_state
from megatron.core.optimizer import OptimizerConfig as McOptimizerConfig

from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.errors import ConfigError
from megatron_ext.optimizers.qkv import QKVLayout
from megatron_ext.optimizers.routing import chunk_of
from megatron_ext.optimizers.spec import recipe_hyperparameters

__all__ = [
    "InnerFactory",
    "NamedParams",
    "adamw_factory",
    "chunk_named_parameters",
    "chunk_root",
    "chunked_factory",
    "hyperparameters",
    "inner_factory",
    "is_expert_param",
    "layerwise_factory",
    "megatron_optimizer_config",
    "model_qkv_layout",
]

NamedParams = list[tuple[str, torch.nn.Parameter]]
# Builds the wrapped optimizer over the trained model parameters. The optimizer keeps its own
# fp32 masters and answers ``master(name)``, ``set_grads``, ``reload_masters``, ``step``,
# ``param_groups``, ``state`` and the name-keyed state (``named_state``, ``load_named_state``,
# ``saves``): the layer-wise optimizer, or the replicated one for plain AdamW.
InnerFactory = Callable[[NamedParams], Any]


def chunk_root(modules: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One module over this rank's model chunks, naming their parameters as the optimizer
    does: the chunk itself, or a ``ModuleDict`` of ``chunk<v>`` for several (virtual pipeline
    stages; the drop-in names Megatron-LM's chunks the same way), so names stay unique."""
    if len(modules) == 1:
        return modules[0]
    return torch.nn.ModuleDict({f"chunk{v}": m for v, m in enumerate(modules)})


def chunk_named_parameters(modules: Sequence[torch.nn.Module]) -> NamedParams:
    """The ``(name, parameter)`` pairs of :func:`chunk_root`."""
    return list(chunk_root(modules).named_parameters())


def chunked_factory(factory: InnerFactory, chunks: int) -> InnerFactory:
    """``factory`` once per model chunk, its parts side by side behind one interface
    (:class:`~megatron_ext.distributed.domains.LayerwiseDomains`): each part's gradients then
    lie in one chunk's DDP buffer, which the layer-wise gradient sync lays out (one optimizer
    still, so one gradient norm, one clipping and one loss scale over every chunk). One chunk:
    ``factory`` itself."""
    if chunks == 1:
        return factory

    def build(named: NamedParams) -> Any:
        from megatron_ext.distributed.domains import LayerwiseDomains

        by_chunk: dict[int, NamedParams] = {}
        for n, p in named:
            v = chunk_of(n)[0]
            if v is None:
                raise ValueError(f"{n}: not a chunk<v>. name (chunk_named_parameters)")
            by_chunk.setdefault(v, []).append((n, p))
        parts: list[Any] = []
        for _, chunk in sorted(by_chunk.items()):
            inner = factory(chunk)
            parts += inner.parts if isinstance(inner, LayerwiseDomains) else [inner]
        return LayerwiseDomains(parts)

    return build


def megatron_optimizer_config(
    cfg: OptimizerConfig, bf16: bool, fp16: bool = False
) -> McOptimizerConfig:
    """The recipe's optimizer section as megatron-core's ``OptimizerConfig`` (``fp16``: with
    the section's loss scale, which the adapter then applies)."""
    if bf16 and fp16:
        raise ValueError("bf16 and fp16 are exclusive (megatron-core's OptimizerConfig)")
    return McOptimizerConfig(
        optimizer="adam",
        lr=cfg.lr,
        min_lr=cfg.min_lr,
        weight_decay=cfg.weight_decay,
        adam_beta1=cfg.adam_beta1,
        adam_beta2=cfg.adam_beta2,
        adam_eps=cfg.adam_eps,
        clip_grad=cfg.clip_grad,
        bf16=bf16,
        fp16=fp16,
        params_dtype=torch.bfloat16 if bf16 else torch.float16 if fp16 else torch.float32,
        loss_scale=cfg.loss_scale,
        initial_loss_scale=cfg.initial_loss_scale,
        min_loss_scale=cfg.min_loss_scale,
        loss_scale_window=cfg.loss_scale_window,
        hysteresis=cfg.hysteresis,
        use_distributed_optimizer=False,
    )


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """megatron-core marks expert-parallel parameters with ``allreduce=False``."""
    return not getattr(param, "allreduce", True)


def hyperparameters(cfg: OptimizerConfig) -> dict[str, dict[str, Any]]:
    """Keyword hyperparameters of the recipe's optimizer and of AdamW (the non-matrix part)."""
    return recipe_hyperparameters(cfg)


def _groups() -> tuple[Any, Any]:
    """The data-parallel and expert-data-parallel groups (``None`` outside a distributed run)."""
    if not parallel_state.model_parallel_is_initialized():
        return None, None
    return (
        parallel_state.get_data_parallel_group(),
        parallel_state.get_expert_data_parallel_group(),
    )


def _sharded_adamw(named: NamedParams, group: Any, hp: dict[str, Any], cfg: OptimizerConfig) -> Any:
    """AdamW over ``named``, element-sharded over ``group`` (ZeRO-1: :mod:`~megatron_ext.
    distributed.sharded_adam`); the embedding and output layer in their own parameter group
    with ``cfg.decoupled_lr``."""
    from megatron_ext.distributed.allgather_v import make_allgather_v
    from megatron_ext.distributed.sharded_adam import ShardedAdamW
    from megatron_ext.optimizers.registry import build_optimizer

    gather = make_allgather_v(group) if group is not None else None
    return ShardedAdamW(
        named,
        lambda groups: build_optimizer("adamw", groups, hp),
        gather,
        decoupled_lr=cfg.decoupled_lr is not None,
    )


def _combine(parts: list[Any]) -> Any:
    from megatron_ext.distributed.domains import LayerwiseDomains

    parts = [p for p in parts if p.named_params]
    return parts[0] if len(parts) == 1 else LayerwiseDomains(parts)


def adamw_factory(cfg: OptimizerConfig) -> InnerFactory:
    """Plain AdamW with ZeRO-1 semantics, as megatron-core's distributed optimizer: fp32 masters
    and moments element-sharded over the data-parallel group (MoE experts: the
    expert-data-parallel group), gradients reduce-scattered, updated ranges all-gathered
    (:class:`~megatron_ext.distributed.sharded_adam.ShardedAdamW`)."""

    def build(named: NamedParams) -> Any:
        dp_group, edp_group = _groups()
        hp = hyperparameters(cfg)["adamw"]
        dense = [(n, p) for n, p in named if not is_expert_param(p)]
        expert = [(n, p) for n, p in named if is_expert_param(p)]
        parts = [_sharded_adamw(dense, dp_group, hp, cfg)]
        if expert:
            parts.append(_sharded_adamw(expert, edp_group, hp, cfg))
        return _combine(parts)

    return build


def layerwise_factory(cfg: OptimizerConfig, qkv_layout: QKVLayout | None = None) -> InnerFactory:
    """The layer-wise distributed optimizer over the data-parallel group: ``cfg.name`` for the
    matrices ``cfg.matrix_routing`` gives it, each matrix updated by the rank that owns it;
    the parameters routed to AdamW (embeddings, output layer, norms, biases) element-sharded
    beside it (ZeRO-1, :class:`~megatron_ext.distributed.sharded_adam.ShardedAdamW`). With
    ``cfg.split_qkv`` the fused QKV weights are orthogonalised as Q, K and V (``qkv_layout``:
    the model's, required then)."""
    if cfg.split_qkv and qkv_layout is None:
        raise ConfigError(
            "optimizer.split_qkv=true needs the model's attention layout (num_attention_heads, "
            "num_query_groups, kv_channels), which this caller did not pass"
        )
    layout = qkv_layout if cfg.split_qkv else None
    common = dict(routing=cfg.matrix_routing, qkv_layout=layout)

    def build(named: NamedParams) -> Any:
        from megatron_ext.distributed.allgather_v import make_allgather_v
        from megatron_ext.distributed.layerwise import LayerwiseOptimizer
        from megatron_ext.distributed.tensor_parallel import shard_infos_from_attributes
        from megatron_ext.optimizers.routing import route_parameter

        # Dense weights are planned over the data-parallel group, expert weights over the
        # expert-data-parallel group (the ranks holding the same experts); TP shards are updated
        # in optimizer.tp_mode (the plan depends only on names and shard shapes, so every rank of
        # a TP group owns the same shards and joins the same TP collectives).
        def adamw(n: str, p: torch.nn.Parameter) -> bool:
            if cfg.decoupled_lr is not None and getattr(
                p, "is_embedding_or_output_parameter", False
            ):
                return True  # its own LR: an AdamW group (both routings put it there anyway)
            return (
                route_parameter(
                    n,
                    tuple(p.shape),
                    matrix_optimizer=cfg.name,
                    rules=cfg.matrix_routing,
                )
                == "adamw"
            )

        hp = hyperparameters(cfg)
        dp_group, edp_group = _groups()
        parts: list[Any] = []
        for expert, group, tp_group in (
            (False, dp_group, parallel_state.get_tensor_model_parallel_group),
            (True, edp_group, parallel_state.get_expert_tensor_parallel_group),
        ):
            domain = [(n, p) for n, p in named if is_expert_param(p) == expert]
            if not domain:
                continue
            matrices = [(n, p) for n, p in domain if not adamw(n, p)]
            tied = [n for n, p in matrices if getattr(p, "shared_embedding", False)]
            if tied:
                raise ConfigError(
                    f"optimizer.matrix_routing gives {tied[0]} to {cfg.name}: a word embedding "
                    "tied to the output layer over pipeline stages is updated on two stages, "
                    "which must own it alike; route it to adamw (megatron-core's routing does), "
                    "or set model.untie_embeddings_and_output_weights=true"
                )
            if matrices:
                tp_shards = shard_infos_from_attributes([p for _, p in matrices], tp_group())
                gather = make_allgather_v(group)
                parts.append(
                    LayerwiseOptimizer(
                        matrices, cfg.name, gather, hp, tp_shards=tp_shards, **common
                    )
                )
            parts.append(
                _sharded_adamw([(n, p) for n, p in domain if adamw(n, p)], group, hp["adamw"], cfg)
            )
        return _combine(parts)

    return build


def inner_factory(cfg: OptimizerConfig, qkv_layout: QKVLayout | None = None) -> InnerFactory:
    """AdamW replicated (``cfg.name == "adamw"``) or the layer-wise optimizer; ``qkv_layout``
    is the model's, read with ``cfg.split_qkv``."""
    return adamw_factory(cfg) if cfg.name == "adamw" else layerwise_factory(cfg, qkv_layout)


def model_qkv_layout(config: Any) -> QKVLayout:
    """The fused-QKV layout of a megatron-core ``TransformerConfig``."""
    groups = config.num_query_groups or config.num_attention_heads
    return QKVLayout.from_heads(config.num_attention_heads, groups, config.kv_channels)
