"""AdamW (``torch.optim.AdamW``): the optimizer of every parameter the matrix optimizers do not
take (embeddings, output layer, norms, biases), and of all of them with ``optimizer.name=adamw``.

Conventions (torch's): β1, β2 weigh the old moments, bias-corrected, ε added to √v̂ (absolute),
decoupled weight decay ``W ← (1 − ηλ)W``. Its update RMS is the reference the other optimizers'
updates are matched to (``optimizer.update_rms``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .spec import MegatronNames, OptimizerSpec

#: AdamW/Lion: moments, bias correction, decay, update (FLOPs per element).
ELEMENTWISE_FLOPS = 12


def elementwise_flops(rows: int, cols: int, kwargs: Mapping[str, Any]) -> float:
    return ELEMENTWISE_FLOPS * rows * cols


SPEC = OptimizerSpec(
    name="adamw",
    target="torch.optim:AdamW",
    summary="AdamW (torch), the optimizer of the non-matrix parameters",
    couples_matrix_entries=False,
    uses=("lr", "weight_decay", "adam"),
    fixed={"foreach": True},
    flops=elementwise_flops,
    state_bytes=lambda rows, cols: 2 * 4 * rows * cols,  # exp_avg, exp_avg_sq
    label="AdamW",
    megatron=MegatronNames(optimizers=("adam",)),
)
