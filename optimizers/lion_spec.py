"""Lion (:class:`~.lion.Lion`): ``sign(β1·m + (1 − β1)·g)``, then ``m ← β2·m + (1 − β2)·g``.

Recipe fields ``optimizer.lion_beta1`` (0.95) and ``lion_beta2`` (0.98), megatron-core's
defaults. Its sign update has RMS 1, so with ``optimizer.match_update_rms`` it is scaled by
``optimizer.update_rms`` (AdamW's update RMS): one LR then serves Lion's matrices and the
AdamW part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .adamw_spec import elementwise_flops
from .spec import MegatronNames, OptimizerSpec, option


@dataclass(kw_only=True)
class LionOptions:
    """Lion's recipe options (``optimizer.lion_<field>``)."""

    beta1: float = option(0.95, ge=0.0, lt=1.0, help="weight of m in the sign's argument")
    beta2: float = option(0.98, ge=0.0, lt=1.0, help="weight of the old m")


def _betas(kwargs: dict[str, Any]) -> dict[str, Any]:
    kwargs["betas"] = (kwargs.pop("beta1"), kwargs.pop("beta2"))
    return kwargs


SPEC = OptimizerSpec(
    name="lion",
    target="megatron_ext.optimizers.lion:Lion",
    summary="Lion (sign of an interpolated momentum) on the hidden matrices, AdamW on the rest",
    couples_matrix_entries=False,
    options=LionOptions,
    pack=_betas,
    update_rms_kwarg="update_scale",
    flops=elementwise_flops,
    state_bytes=lambda rows, cols: 4 * rows * cols,  # exp_avg
    label="Lion",
    megatron=MegatronNames(
        optimizers=("lion",),
        fields={"lion_beta1": "lion_beta1", "lion_beta2": "lion_beta2"},
        flags={"lion-beta1": "lion_beta1", "lion-beta2": "lion_beta2"},
    ),
)
