"""The one mapping from a recipe's ``training.precision`` to a torch dtype."""

from __future__ import annotations

import torch

from megatron_ext.config.schema import PRECISIONS
from megatron_ext.errors import ConfigError

__all__ = ["DTYPES", "precision_dtype"]

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}


def precision_dtype(precision: str) -> torch.dtype:
    """The parameter dtype of ``precision`` (one of the schema's ``PRECISIONS``)."""
    if precision not in DTYPES:
        raise ConfigError(
            f"training.precision={precision!r} has no dtype; use one of {', '.join(PRECISIONS)}"
        )
    return DTYPES[precision]
