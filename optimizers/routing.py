"""Which optimizer each parameter gets, from its name and shape.

Default rules (megatron-core parameter names; the first rule that applies wins):

1. a recipe override: ``(pattern, optimizer)`` pairs, ``fnmatch`` globs on the full name, in order;
2. AdamW for embeddings (``embedding``), the output layer (``output_layer``), Mamba ``conv1d``
   weights, norms (``norm`` in the name, e.g. ``layer_norm_weight``, ``q_layernorm``), biases,
   and every tensor that is not 2-D or 3-D;
3. AdamW for the MoE router (``router.weight``, E×d): its rows are per-expert logit directions
   whose norms set the routing temperature, which orthogonalising would flatten;
4. the matrix optimizer for the remaining 2-D hidden weights (attention projections, MLP) and
   3-D stacked expert weights.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # route_parameter is torch-free: the planner and the launcher call it
    import torch

__all__ = ["decays_weight", "route_parameter", "weight_decay_groups"]

_ADAMW_NAME_PARTS = ("embedding", "output_layer", "conv1d", "norm", "router.weight")


def route_parameter(
    name: str,
    shape: Sequence[int],
    *,
    matrix_optimizer: str = "muon",
    overrides: Sequence[tuple[str, str]] = (),
) -> str:
    """Registry name of the optimizer for parameter ``name`` of ``shape``.

    Args:
        name: full parameter name, e.g. ``decoder.layers.0.mlp.linear_fc1.weight``.
        shape: its shape.
        matrix_optimizer: the registered optimizer for hidden matrices (``muon``, ``lion``, ...).
        overrides: ``(glob, optimizer)`` pairs tried first, in order.
    """
    for pattern, optimizer in overrides:
        if fnmatch.fnmatchcase(name, pattern):
            return optimizer
    leaf = name.rsplit(".", 1)[-1]
    if len(shape) not in (2, 3) or leaf == "bias" or leaf.endswith("_bias"):
        return "adamw"
    if any(part in name for part in _ADAMW_NAME_PARTS):
        return "adamw"
    return matrix_optimizer


def decays_weight(name: str, shape: Sequence[int]) -> bool:
    """megatron-core's convention: weight decay on matrices, none on biases and 1-D tensors
    (norm weights). Torch-free: the planner groups parameters by it."""
    return len(shape) >= 2 and not name.endswith("bias")


def weight_decay_groups(
    named_params: Iterable[tuple[str, torch.Tensor]], weight_decay: float | None = None
) -> list[dict[str, Any]]:
    """Parameter groups with megatron-core's convention: weight decay on matrices, none on
    biases and 1-D tensors (norm weights). ``weight_decay=None`` leaves the decayed group at
    the optimizer's own default. Empty groups are left out."""
    decay, no_decay = [], []
    for name, p in named_params:
        (decay if decays_weight(name, p.shape) else no_decay).append(p)
    groups: list[dict[str, Any]] = []
    if decay:
        groups.append(
            {"params": decay}
            if weight_decay is None
            else {"params": decay, "weight_decay": weight_decay}
        )
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups
