"""OLMoE's q/k RMSNorm over the whole projection (all heads together), not per head.

megatron-core calls a spec's ``q_layernorm``/``k_layernorm`` on [sq, b, heads, head_dim] (heads
on this tensor-parallel rank). These modules normalise over (heads, head_dim) with one weight of
``heads * head_dim`` per rank; under tensor parallelism the mean square is summed over every TP
shard (an all-reduce), so a TP=2 run computes what TP=1 does. The weight is split on dim 0 in
checkpoints, like the projection it follows.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint


class _ProjectionRMSNorm(MegatronModule):
    """RMSNorm over the last two dims of [sq, b, heads, head_dim]; ``heads`` per TP rank."""

    total_heads_field = ""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(config=config)
        total = getattr(config, self.total_heads_field) or config.num_attention_heads
        tp = config.tensor_model_parallel_size
        self.local_width = total // tp * hidden_size
        self.full_width = total * hidden_size
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(self.local_width))
        self.weight.sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], -1).float()
        square_sum = flat.pow(2).sum(-1, keepdim=True)
        if self.config.tensor_model_parallel_size > 1:
            square_sum = square_sum.clone()
            dist.all_reduce(square_sum, group=parallel_state.get_tensor_model_parallel_group())
        normed = flat * torch.rsqrt(square_sum / self.full_width + self.eps)
        return (normed.to(x.dtype) * self.weight).reshape(shape)

    def sharded_state_dict(
        self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None
    ) -> dict:
        """The weight split on dim 0 across tensor-parallel ranks."""
        state = self.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, {"weight": 0}, sharded_offsets)


class ProjectionQNorm(_ProjectionRMSNorm):
    """Query norm over all ``num_attention_heads * head_dim`` channels."""

    total_heads_field = "num_attention_heads"


class ProjectionKNorm(_ProjectionRMSNorm):
    """Key norm over all ``num_query_groups * head_dim`` channels."""

    total_heads_field = "num_query_groups"
