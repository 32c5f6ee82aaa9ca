"""The one mapping from a recipe's ``training.precision`` to torch dtypes and megatron-core fields.

Each precision is one :class:`PrecisionSpec`: the dtype the parameters are held in and, for the
FP8/FP4 precisions, megatron-core 0.19's ``TransformerConfig`` fields (``fp8`` format,
``fp8_recipe``, ``fp4``, ``fp4_recipe``), as Megatron-LM's ``--bf16 --fp8-format ...
--fp8-recipe ...`` set them:

=================  ============  ========  ============  ====  ==========
precision          parameters    fp8       fp8_recipe    fp4   fp4_recipe
=================  ============  ========  ============  ====  ==========
fp32               float32       –         –             –     –
bf16               bfloat16      –         –             –     –
fp8_tensorwise     bfloat16      hybrid    tensorwise    –     –
fp8_delayed        bfloat16      hybrid    delayed       –     –
fp8_blockwise      bfloat16      e4m3      blockwise     –     –
mxfp8              bfloat16      e4m3      mxfp8         –     –
nvfp4              bfloat16      –         –             e2m1  nvfp4
fp16               float16       –         –             –     –
=================  ============  ========  ============  ====  ==========

``fp16`` is Megatron-LM's ``--fp16``: float16 parameters (megatron-core's ``TransformerConfig``
gets ``fp16=True`` and float16 dtypes) with loss scaling: the optimizer section's
``loss_scale`` … ``hysteresis`` (megatron-core's ``OptimizerConfig`` fields) build the scale
(:mod:`megatron_ext.megatron.loss_scale`, megatron-core's rule on any device), the loss is
multiplied by it before backward, a step whose gradients overflow is skipped and the scale
lowered, as Megatron-LM's training loop does.

Every precision but fp32 runs the model as Megatron-LM runs ``--bf16`` (``--fp16``): megatron-core's
``Float16Module`` casts the whole model to bf16 (fp16), norms included, and the optimizer keeps fp32
masters; the FP8/FP4 ones then run Transformer Engine's GEMMs under its autocast (per-tensor scales
from the current or a delayed amax, 1×128/128×128 blocks, MX 1×32 blocks with E8M0 scales, NVFP4
1×16 blocks). ``HYBRID`` is E4M3 forward and E5M2 for gradients (TE's and Megatron-LM's choice for
per-tensor scaling); the block-scaled recipes use E4M3 throughout (TE's defaults for
``Float8BlockScaling`` and ``MXFP8BlockScaling``). ``fp8_param`` (FP8 weights kept between steps,
``--fp8-param-gather``) stays off: the masters live in megatron-ext's optimizer and TE quantizes the
bf16 weights at each forward.

``training.num_layers_at_start_in_bf16`` / ``num_layers_at_end_in_bf16`` keep the first/last
transformer layers out of FP8/FP4 (megatron-core's ``first_last_layers_bf16`` with its counts).

Which machine can run which precision is :mod:`megatron_ext.run.hardware`'s table. This module
imports no torch at its top (the schema and the launcher read it); :func:`precision_dtype`
imports it when asked for a dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args

from megatron_ext.errors import ConfigError

if TYPE_CHECKING:
    import torch


__all__ = [
    "PRECISIONS",
    "SPECS",
    "Precision",
    "PrecisionSpec",
    "check_precision_fields",
    "half_parameters",
    "params_dtype_name",
    "precision_dtype",
    "precision_spec",
    "transformer_config_fields",
]

Precision = Literal[
    "fp32", "bf16", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4", "fp16"
]
PRECISIONS: tuple[Precision, ...] = get_args(Precision)


@dataclass(frozen=True)
class PrecisionSpec:
    """One precision: parameter dtype and megatron-core's quantization fields (None = off)."""

    name: Precision
    params_dtype: Literal["float32", "bfloat16", "float16"]
    fp8: Literal["e4m3", "hybrid"] | None = None
    fp8_recipe: Literal["tensorwise", "delayed", "blockwise", "mxfp8"] | None = None
    fp4: Literal["e2m1"] | None = None
    fp4_recipe: Literal["nvfp4"] | None = None

    @property
    def half(self) -> bool:
        """bf16 (or fp16) parameters: the model runs inside megatron-core's ``Float16Module``."""
        return self.params_dtype != "float32"

    @property
    def quantized(self) -> bool:
        """FP8 or FP4 GEMMs (Transformer Engine)."""
        return self.fp8 is not None or self.fp4 is not None


SPECS: dict[str, PrecisionSpec] = {
    s.name: s
    for s in (
        PrecisionSpec("fp32", "float32"),
        PrecisionSpec("bf16", "bfloat16"),
        PrecisionSpec("fp8_tensorwise", "bfloat16", fp8="hybrid", fp8_recipe="tensorwise"),
        PrecisionSpec("fp8_delayed", "bfloat16", fp8="hybrid", fp8_recipe="delayed"),
        PrecisionSpec("fp8_blockwise", "bfloat16", fp8="e4m3", fp8_recipe="blockwise"),
        PrecisionSpec("mxfp8", "bfloat16", fp8="e4m3", fp8_recipe="mxfp8"),
        PrecisionSpec("nvfp4", "bfloat16", fp4="e2m1", fp4_recipe="nvfp4"),
        PrecisionSpec("fp16", "float16"),
    )
}
assert tuple(SPECS) == PRECISIONS, "one spec per precision, in the Literal's order"


def precision_spec(precision: str) -> PrecisionSpec:
    """The spec of ``precision``; an unknown name is a ``ConfigError`` listing the known ones."""
    if precision not in SPECS:
        raise ConfigError(
            f"training.precision={precision!r} is not a precision; use one of "
            f"{', '.join(PRECISIONS)}"
        )
    return SPECS[precision]


def precision_dtype(precision: str, params_dtype: str | None = None) -> torch.dtype:
    """The parameter dtype of ``precision`` (float32 for fp32, float16 for fp16, bfloat16 for
    every other), or ``params_dtype`` (``training.params_dtype``) where given."""
    import torch

    return getattr(torch, params_dtype_name(precision, params_dtype))


def params_dtype_name(precision: str, params_dtype: str | None = None) -> str:
    """The parameters' dtype name: ``params_dtype`` (``training.params_dtype``, FP8/FP4 only)
    where given, else the precision's."""
    return params_dtype or precision_spec(precision).params_dtype


def half_parameters(training: Any) -> bool:
    """Whether the ``training`` section's run holds its parameters in bf16/fp16 (megatron-core's
    ``Float16Module``), ``training.params_dtype`` included."""
    return params_dtype_name(training.precision, training.params_dtype) != "float32"


def transformer_config_fields(
    precision: str,
    start: int = 0,
    end: int = 0,
    fp8_format: str | None = None,
    params_dtype: str | None = None,
) -> dict[str, Any]:
    """megatron-core ``TransformerConfig`` keyword arguments for ``precision`` (the model's
    dtypes, FP8/FP4 format and recipe) keeping the first ``start`` and last ``end`` layers in
    BF16 (``training.num_layers_at_start_in_bf16``/``_end_in_bf16``); ``fp8_format``
    (``training.fp8_format``): the FP8 format instead of the precision's; ``params_dtype``
    (``training.params_dtype``): the parameters' dtype instead of the precision's."""
    import torch

    spec = precision_spec(precision)
    dtype = precision_dtype(precision, params_dtype)
    fields: dict[str, Any] = {
        "bf16": dtype == torch.bfloat16,
        "fp16": dtype == torch.float16,
        "params_dtype": dtype,
        "pipeline_dtype": dtype,
        "fp8": fp8_format or spec.fp8,
        "fp8_param": False,
        "fp4": spec.fp4,
        "first_last_layers_bf16": bool(start or end),
        "num_layers_at_start_in_bf16": start,
        "num_layers_at_end_in_bf16": end,
    }
    if spec.fp8_recipe is not None:
        fields["fp8_recipe"] = spec.fp8_recipe
    if spec.fp4_recipe is not None:
        fields["fp4_recipe"] = spec.fp4_recipe
    return fields


def check_precision_fields(t: Any, m: Any, pipeline_stages: int) -> None:
    """The precision's rules that need no hardware (the GPT sections' check calls this): the
    first/last BF16 layer counts, and FP8/FP4 only on Transformer Engine's layers (the local
    spec's linears ignore ``fp8``/``fp4`` and would silently train in BF16). ``t``, ``m``: the
    ``training`` and ``model`` sections; ``pipeline_stages``:
    ``parallel.pipeline_model_parallel_size``."""
    spec = precision_spec(t.precision)
    if t.params_dtype is not None and not spec.quantized:
        raise ConfigError(
            f"training.params_dtype={t.params_dtype} sets the parameters' dtype of an FP8/FP4 "
            f"precision; training.precision={t.precision} holds them in "
            f"{spec.params_dtype}: remove it (fp32 = training.precision=fp32)"
        )
    if t.fp8_format is not None and spec.fp8 is None:
        raise ConfigError(
            f"training.fp8_format={t.fp8_format} sets the format of an FP8 precision, and "
            f"training.precision={t.precision} has none: remove it, or choose an FP8 precision"
        )
    start, end = t.num_layers_at_start_in_bf16, t.num_layers_at_end_in_bf16
    counts = (
        f"training.num_layers_at_start_in_bf16={start}, training.num_layers_at_end_in_bf16={end}"
    )
    if (start or end) and not spec.quantized:
        raise ConfigError(
            f"{counts} keep layers out of FP8/FP4, but training.precision={t.precision} has "
            "none: set them to 0, or choose an FP8/FP4 precision"
        )
    if (start or end) and spec.fp8_recipe == "delayed":
        raise ConfigError(
            f"{counts}: megatron-core's delayed scaling cannot keep first/last layers in BF16 "
            "(one amax reduction per autocast); use fp8_tensorwise, or set both to 0"
        )
    if (start or end) and start + end >= m.num_layers:
        raise ConfigError(
            f"{counts} leave no FP8/FP4 layer of model.num_layers={m.num_layers}: "
            f"keep their sum below {m.num_layers}"
        )
    per_stage = m.num_layers // pipeline_stages
    if max(start, end) > per_stage:
        raise ConfigError(
            f"{counts}: each may be at most the {per_stage} layer(s) of one pipeline stage "
            "(megatron-core's rule)"
        )
    if spec.quantized and m.transformer_impl == "local":
        raise ConfigError(
            f"training.precision={t.precision} runs in Transformer Engine's layers; "
            "model.transformer_impl=local would train in BF16: use auto or transformer_engine"
        )
