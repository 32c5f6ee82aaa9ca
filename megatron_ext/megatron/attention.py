"""Core attention for megatron-core layer specs built on ``F.scaled_dot_product_attention``.

megatron-core's local ``DotProductAttention`` materialises the [b·h, s, s] score matrix through
a global CUDA memory buffer and a fused-softmax module; Transformer Engine's attention needs TE.
``SdpaAttention`` drops into the ``core_attention`` slot of a ``SelfAttentionSubmodules`` spec and
lets PyTorch pick the kernel (flash / memory-efficient on GPU, the math kernel on CPU).
It supports causal masking and grouped-query attention; anything else is refused up front.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide


class SdpaAttention(MegatronModule):
    """Causal (optionally grouped-query) attention via ``scaled_dot_product_attention``.

    Inputs follow megatron-core's layout: query [sq, b, np, hn], key/value [sk, b, ng, hn]
    (np = heads and ng = query groups on this tensor-parallel rank, hn = head dim).
    Output: [sq, b, np·hn].
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ) -> None:
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError(
                "SdpaAttention does not implement context parallelism; "
                "use Transformer Engine attention (model.transformer_impl)"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(f"SdpaAttention supports causal or no mask, got {attn_mask_type}")
        if config.softmax_type != "vanilla":
            raise ValueError(
                f"SdpaAttention supports softmax_type='vanilla' only, got {config.softmax_type!r}"
            )
        if config.window_size is not None:
            raise ValueError("SdpaAttention does not implement sliding-window attention")
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp"])
        tp = pg_collection.tp.size()
        self.attn_mask_type = attn_mask_type
        self.heads = divide(config.num_attention_heads, tp)
        self.groups = divide(config.num_query_groups, tp)
        self.head_dim = config.kv_channels
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = (
            config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: object | None = None,
    ) -> torch.Tensor:
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaAttention does not support packed sequences or attention bias")
        mask_type = attn_mask_type or self.attn_mask_type
        sq, b = query.shape[0], query.shape[1]
        # [s, b, h, d] -> [b, h, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if self.groups != self.heads:
            # GQA: each key/value group serves heads/groups consecutive query heads.
            rep = self.heads // self.groups
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            is_causal=mask_type == AttnMaskType.causal,
            dropout_p=self.dropout_p if self.training else 0.0,
            scale=self.scale,
        )
        # [b, h, sq, d] -> [sq, b, h·d]
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.heads * self.head_dim)
