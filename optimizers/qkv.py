"""megatron-core's fused ``linear_qkv.weight`` layout, and views of its Q, K and V blocks.

megatron-core stores the fused projection with the query groups outermost: for each of the
``num_query_groups`` groups the rows are

    [q of the group's heads (heads_per_group·kv_channels rows), k (kv_channels), v (kv_channels)]

so Q, K and V are each spread over all groups. Orthogonalising them separately means gathering
those rows; :func:`qkv_views` returns strided views (no copy) that a caller can read from and
write to.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .routing import weight_decay_groups
from .validation import check_range

__all__ = ["QKVLayout", "qkv_views", "qkv_weight_decay_groups"]


@dataclass(frozen=True)
class QKVLayout:
    """Shape of megatron-core's fused QKV weight.

    Attributes:
        num_query_groups: number of K/V heads (``num_query_groups`` in TransformerConfig; equals
            the number of attention heads without GQA).
        heads_per_group: query heads per group (``num_attention_heads // num_query_groups``).
        kv_channels: channels per head (``kv_channels``; ``hidden_size // num_attention_heads``
            by default).
    """

    num_query_groups: int
    heads_per_group: int
    kv_channels: int

    def __post_init__(self) -> None:
        for name in ("num_query_groups", "heads_per_group", "kv_channels"):
            check_range(name, getattr(self, name), low=1)

    @classmethod
    def from_heads(
        cls, num_attention_heads: int, num_query_groups: int, kv_channels: int
    ) -> QKVLayout:
        """Layout from the TransformerConfig fields of the same names."""
        if num_attention_heads % num_query_groups:
            raise ValueError(
                f"num_attention_heads={num_attention_heads} is not a multiple of "
                f"num_query_groups={num_query_groups}"
            )
        return cls(num_query_groups, num_attention_heads // num_query_groups, kv_channels)

    @property
    def rows(self) -> int:
        """Rows of the fused weight: ``num_query_groups·(heads_per_group + 2)·kv_channels``."""
        return self.num_query_groups * (self.heads_per_group + 2) * self.kv_channels

    def shapes(self, hidden: int) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        """Matrix shapes of Q, K and V for input width ``hidden``."""
        q_rows = self.num_query_groups * self.heads_per_group * self.kv_channels
        kv_rows = self.num_query_groups * self.kv_channels
        return (q_rows, hidden), (kv_rows, hidden), (kv_rows, hidden)


def qkv_views(weight: torch.Tensor, layout: QKVLayout) -> tuple[torch.Tensor, ...]:
    """Q, K and V blocks of a fused ``(rows, hidden)`` tensor as strided views.

    Returns three views of shape ``(num_query_groups, r, hidden)`` with ``r`` equal to
    ``heads_per_group·kv_channels`` for Q and ``kv_channels`` for K and V. Row-major flattening
    of a view's first two dims gives the matrix of :meth:`QKVLayout.shapes` (query heads in head
    order, since megatron numbers heads group by group).
    """
    if weight.ndim != 2 or weight.shape[0] != layout.rows:
        raise ValueError(
            f"fused QKV weight of shape {tuple(weight.shape)} does not match {layout} "
            f"(expected {layout.rows} rows)"
        )
    groups = weight.view(layout.num_query_groups, -1, weight.shape[1])
    q_rows = layout.heads_per_group * layout.kv_channels
    kv = layout.kv_channels
    return groups[:, :q_rows], groups[:, q_rows : q_rows + kv], groups[:, q_rows + kv :]


def qkv_weight_decay_groups(
    named: Sequence[tuple[str, torch.Tensor]], layout: QKVLayout
) -> list[dict[str, object]]:
    """megatron-core's weight-decay groups (:func:`~.routing.weight_decay_groups`), with each
    fused ``linear_qkv.weight`` moved to a group of its own whose ``qkv_layout`` makes Muon/MOP
    orthogonalise its Q, K and V separately (megatron-core's ``muon_split_qkv``).

    ``layout`` is the whole model's; a tensor-parallel shard holds whole query groups, so its
    rows give its own number of groups. Weight decay stays at the optimizer's default in the
    QKV groups (they are matrices).
    """
    per_group = (layout.heads_per_group + 2) * layout.kv_channels
    fused = {
        n: p
        for n, p in named
        if n.endswith("linear_qkv.weight") and p.ndim == 2 and p.shape[0] % per_group == 0
    }
    groups = weight_decay_groups([(n, p) for n, p in named if n not in fused])
    by_rows: dict[int, list[torch.Tensor]] = {}
    for p in fused.values():
        by_rows.setdefault(p.shape[0], []).append(p)
    for rows, params in by_rows.items():
        local = QKVLayout(rows // per_group, layout.heads_per_group, layout.kv_channels)
        groups.append({"params": params, "qkv_layout": local})
    return groups
