"""``model.transformer_config``: any megatron-core ``TransformerConfig`` field, by its own name.

The model section's named fields (``num_layers``, ``activation``, MoE, ...) and the recipe's
other sections (parallel sizes, precision, recomputation) derive most of the config
(:func:`megatron_ext.megatron.model.transformer_kwargs`); ``model.transformer_config`` carries
every other field of megatron-core's dataclass -- partial rotary's and zero-centred gamma's,
multi-latent attention's, multi-token prediction's, a pipeline layout -- as the converter
writes them from Megatron-LM's own ``TransformerConfig``. Names are checked against
megatron-core's dataclass (``MLATransformerConfig`` with ``multi_latent_attention: true``);
the host's kernel choices (:data:`HOST_FIELDS`) apply on CUDA only.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.errors import ConfigError

__all__ = [
    "HOST_FIELDS",
    "NOT_BUILT",
    "SECTION_FIELDS",
    "activation_function",
    "config_class",
    "resolve",
]

#: kernel fusions and where weights are created: what the host can run, not the model's math.
#: Without CUDA the trainer turns them off (weights on the CPU); with CUDA a value given here
#: (Megatron-LM's) is used.
HOST_FIELDS = (
    "use_cpu_initialization",
    "bias_activation_fusion",
    "bias_dropout_fusion",
    "masked_softmax_fusion",
    "persist_layer_norm",
    "apply_rope_fusion",
    "gradient_accumulation_fusion",
)
#: fields another recipe section owns (parallel.*, training.precision and its BF16 layers,
#: parallel.recompute_granularity): refused here, so each has one place
SECTION_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "sequence_parallel",
    "fp16",
    "bf16",
    "params_dtype",
    "pipeline_dtype",
    "fp8",
    "fp8_recipe",
    "fp4",
    "fp4_recipe",
    "num_layers_at_start_in_bf16",
    "num_layers_at_end_in_bf16",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "recompute_modules",
)
#: fields megatron-core reads but the GPT trainer does not build for: refused at launch
NOT_BUILT = {
    "is_hybrid_model": "the GPT trainer builds GPTModel, not megatron-core's hybrid model",
    # Megatron-LM's --fp8-param-gather / --fp4-param-gather: Transformer Engine's quantized
    # weights as the parameters, which megatron-core's distributed optimizer keeps masters for
    "fp8_param": "FP8 parameters (Megatron-LM's --fp8-param-gather) are not built: the GPT "
    "trainer keeps bf16/fp32 weights with fp32 masters and Transformer Engine quantizes them "
    "at each GEMM; remove it",
    "fp4_param": "FP4 parameters (Megatron-LM's --fp4-param-gather) are not built: the GPT "
    "trainer keeps bf16 weights with fp32 masters and Transformer Engine quantizes them at "
    "each GEMM; remove it",
}
#: fields whose value is a torch dtype, written by name ("bfloat16")
_DTYPE_FIELDS = ("params_dtype", "pipeline_dtype", "autocast_dtype")


def activation_function(name: str) -> Any:
    """megatron-core's / torch's activation by its ``__name__`` (what the converter writes)."""
    from megatron.core import activations
    from megatron.core.fusions import fused_bias_geglu

    for module in (activations, fused_bias_geglu, F):
        fn = getattr(module, name, None)
        if callable(fn):
            return fn
    raise ConfigError(
        f"model.transformer_config.activation_func={name!r}: not an activation of megatron-core "
        "or torch.nn.functional (e.g. squared_relu, gelu, silu, quick_gelu)"
    )


def config_class(fields: dict[str, Any]) -> type:
    """``MLATransformerConfig`` for multi-latent attention, else ``TransformerConfig``."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    return MLATransformerConfig if fields.get("multi_latent_attention") else TransformerConfig


def resolve(fields: dict[str, Any], named: tuple[str, ...]) -> dict[str, Any]:
    """``model.transformer_config`` as ``TransformerConfig`` keyword arguments: names checked
    (a field of megatron-core's dataclass, not one of the model section's ``named`` fields nor
    :data:`SECTION_FIELDS`), functions and dtypes from their names; host fields dropped
    without CUDA."""
    cls = config_class(fields)
    valid = {f.name for f in dataclasses.fields(cls) if f.init}
    out: dict[str, Any] = {}
    for name, value in fields.items():
        where = f"model.transformer_config.{name}"
        if name in named:
            raise ConfigError(f"{where}: the model section has it as model.{name}: set it there")
        if name in SECTION_FIELDS:
            raise ConfigError(
                f"{where}: set by the recipe's parallel or training section (parallel sizes, "
                "training.precision, parallel.recompute_granularity): set it there"
            )
        if name not in valid:
            close = difflib.get_close_matches(name, sorted(valid), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{where}: not a field of megatron-core's {cls.__name__}{hint}")
        if name in NOT_BUILT and value:
            raise ConfigError(f"{where}={value!r}: {NOT_BUILT[name]}")
        if name in HOST_FIELDS and not torch.cuda.is_available():
            continue  # the trainer's CPU choice stands (fused kernels need CUDA)
        if name == "activation_func" and isinstance(value, str):
            value = activation_function(value)
        elif name in _DTYPE_FIELDS and isinstance(value, str):
            value = getattr(torch, value)
        out[name] = value
    return out
