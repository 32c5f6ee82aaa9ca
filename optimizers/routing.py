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

megatron-core's rules (``rules="megatron_core"``, what its ``get_megatron_optimizer`` does for
``muon``: ``_is_nonlinear_or_embedding``): the matrix optimizer for every 2-D parameter except
the word embeddings and the output layer (the two it marks ``is_embedding_or_output_parameter``,
``embedding.word_embeddings.weight`` and ``output_layer.weight``), so learned position
embeddings and MoE routers are orthogonalised too; AdamW for everything else (1-D, 3-D).
The overrides come first under both.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from .options import MatrixRouting

if TYPE_CHECKING:  # route_parameter is torch-free: the planner and the launcher call it
    import torch

__all__ = ["chunk_of", "decays_weight", "route_parameter", "weight_decay_groups"]

#: the trainer's (and the drop-in's) name of a parameter of model chunk ``v`` when a pipeline
#: rank holds several (virtual pipeline stages): ``chunk<v>.`` before the model's own name
_CHUNK = re.compile(r"chunk(\d+)\.")


def chunk_of(name: str) -> tuple[int | None, str]:
    """``(v, the model's own name)`` of a ``chunk<v>.``-named parameter; ``(None, name)`` for
    any other name."""
    match = _CHUNK.match(name)
    return (int(match.group(1)), name[match.end() :]) if match else (None, name)


_ADAMW_NAME_PARTS = ("embedding", "output_layer", "conv1d", "norm", "router.weight")
# megatron-core's is_embedding_or_output_parameter (LanguageModule marks these two)
_MEGATRON_CORE_ADAM = ("embedding.word_embeddings.weight", "output_layer.weight")


def route_parameter(
    name: str,
    shape: Sequence[int],
    *,
    matrix_optimizer: str = "muon",
    overrides: Sequence[tuple[str, str]] = (),
    rules: MatrixRouting = "megatron_ext",
) -> str:
    """Registry name of the optimizer for parameter ``name`` of ``shape``.

    Args:
        name: full parameter name, e.g. ``decoder.layers.0.mlp.linear_fc1.weight``; a model
            chunk's ``chunk<v>.`` before it is left out (:func:`chunk_of`): a parameter routes
            the same way with and without virtual pipeline stages, overrides included.
        shape: its shape.
        matrix_optimizer: the registered optimizer for hidden matrices (``muon``, ``lion``, ...).
        overrides: ``(glob, optimizer)`` pairs tried first, in order.
        rules: ``megatron_ext`` (the default rules above) or ``megatron_core``.
    """
    name = chunk_of(name)[1]
    for pattern, optimizer in overrides:
        if fnmatch.fnmatchcase(name, pattern):
            return optimizer
    if rules == "megatron_core":
        if len(shape) != 2 or name.endswith(_MEGATRON_CORE_ADAM):
            return "adamw"
        return matrix_optimizer
    if rules != "megatron_ext":
        raise ValueError(f"rules={rules!r}: expected megatron_ext or megatron_core")
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
    decay: list[Any] = []
    no_decay: list[Any] = []
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
