"""OLMoE's q/k RMSNorm over the whole projection (all heads together), not per head.

megatron-core calls a spec's ``q_layernorm``/``k_layernorm`` on [sq, b, heads, head_dim] (heads
on this tensor-parallel rank). These modules normalise over (heads, head_dim) of the whole
projection: under tensor parallelism the mean square is summed over every TP shard with an
all-reduce whose backward is an all-reduce too (each rank's partial sum reaches every rank's
output), so a TP=2 run computes what TP=1 does, forward and backward.

The weight is the whole vector (``heads * head_dim`` of the whole projection) on every TP rank,
a TP duplicate like megatron-core's own q/k norms, and each rank applies the slice of its heads.
That is the layout megatron-core assumes for a parameter named ``q_layernorm``/``k_layernorm``:
its ``finalize_model_grads`` sums their gradients over the TP group (by name, whatever the
parameter's tensor-parallel marks), which for a whole vector gives every rank the whole gradient
(each rank contributes the slice of its heads, zeros elsewhere), and its gradient norm, clipping
and checkpoints then count the weight once, as a replicated parameter. A weight split over TP
ranks would instead get its halves added together by that sum.
"""

from __future__ import annotations

import torch
import torch.distributed.nn.functional as dist_fn
from megatron.core import parallel_state
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


class _ProjectionRMSNorm(MegatronModule):
    """RMSNorm over the last two dims of [sq, b, heads, head_dim]; ``heads`` per TP rank."""

    total_heads_field = ""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(config=config)
        total = getattr(config, self.total_heads_field) or config.num_attention_heads
        tp = config.tensor_model_parallel_size
        self.local_width = total // tp * hidden_size  # channels of this rank's heads
        self.full_width = total * hidden_size  # channels of the whole projection
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(self.full_width))
        self.weight.sequence_parallel = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` [sq, b, heads/tp, head_dim] -> the same shape, normalised over the projection."""
        shape = x.shape
        flat = x.reshape(*shape[:-2], -1).float()
        square_sum = flat.pow(2).sum(-1, keepdim=True)
        weight = self.weight
        if self.config.tensor_model_parallel_size > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            square_sum = dist_fn.all_reduce(square_sum, group=group)
            start = parallel_state.get_tensor_model_parallel_rank() * self.local_width
            weight = weight[start : start + self.local_width]
        normed = flat * torch.rsqrt(square_sum / self.full_width + self.eps)
        return (normed.to(x.dtype) * weight).reshape(shape)


class ProjectionQNorm(_ProjectionRMSNorm):
    """Query norm over all ``num_attention_heads * head_dim`` channels."""

    total_heads_field = "num_attention_heads"


class ProjectionKNorm(_ProjectionRMSNorm):
    """Key norm over all ``num_query_groups * head_dim`` channels."""

    total_heads_field = "num_query_groups"
