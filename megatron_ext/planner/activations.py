"""Bytes one micro-batch keeps for backward on one rank of a GPT run.

Counted per transformer layer from the tensors autograd saves, with ``t`` tokens on the rank
(``seq·micro_batch / cp``), ``h`` the hidden size, ``q`` and ``kv`` the query and key/value
widths, ``f`` the MLP width, ``e`` the model dtype's bytes:

- norms: each saves its input (``t·h``) and an fp32 statistic per token;
- attention: the QKV input (``t·h``), its output (``t·(q + 2kv)/tp``), the rotated query and
  key, the output projection's input (``t·q/tp``). Fused attention (Transformer Engine, the
  cluster's case) keeps its output and an fp32 log-sum-exp per head and token; megatron-core's
  local attention (``transformer_impl=local``, CPU) keeps the key and value expanded to the query
  heads and the ``b·heads/tp·s²`` probabilities (fp32 softmax output, plus their cast to ``e``
  for a half model) — the term that selective recomputation removes;
- MLP: the fc1 input (``t·h``), its output (``t·f·(2 if gated)/tp``) and the activation's
  output (``t·f/tp``); a MoE layer: router logits and probabilities (fp32 ``t·E``), the
  ``t·topk/ep`` routed tokens' copies, fc1 outputs and activations on each EP rank, and any
  shared expert as an MLP;
- with sequence parallelism the ``t·h`` tensors are split over TP;
- full recomputation keeps only each layer's input (``t·h``) and rebuilds one layer at a time in
  backward (one layer's activations on top, :func:`activation_bytes`' ``recompute_peak``).

The first stage adds the embedding's output, the last the logits (``t·V/tp`` in ``e`` and in
fp32 for the cross-entropy). Micro-batches in flight (1F1B: ``pp − stage``) multiply it.

``tests/test_planner_memory.py`` checks these counts against the bytes a CPU run's autograd
graph actually saves (``torch.autograd.graph.saved_tensors_hooks``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.gpt.sections import ModelConfig
from megatron_ext.planner.params import default_ffn_hidden_size, moe_layer_pattern

__all__ = ["ActivationShape", "activation_bytes"]

FP32 = 4


@dataclass(frozen=True)
class ActivationShape:
    """What sizes a micro-batch's activations on one rank."""

    seq: int
    micro_batch: int
    tp: int = 1
    cp: int = 1
    ep: int = 1
    sequence_parallel: bool = False
    element_bytes: int = 2  # the model dtype
    fused_attention: bool = True  # Transformer Engine's; False: megatron-core's local attention
    recompute: str = "none"  # parallel.recompute_granularity


def _layer_bytes(m: ModelConfig, a: ActivationShape, moe: bool) -> int:
    """One transformer layer's saved bytes for one micro-batch (see the module docstring)."""
    e, tp = a.element_bytes, a.tp
    t = a.seq * a.micro_batch // a.cp
    h = m.hidden_size
    heads = m.num_attention_heads
    kv_ch = m.kv_channels or h // heads
    q, kv = heads * kv_ch, (m.num_query_groups or heads) * kv_ch
    gated = m.activation == "swiglu"
    ht = t * h // (tp if a.sequence_parallel else 1)  # one hidden-size tensor
    norms = 2 * (3 * e * ht + FP32 * t)  # input, output read by the next linear, statistic
    attention = e * t * (q + 2 * kv) // tp + e * 2 * t * q // tp  # QKV out, rotated q and k
    attention += e * t * q // tp  # the projection's input
    if a.fused_attention:
        attention += FP32 * t * heads // tp
    elif a.recompute != "selective":
        s_local = a.seq // a.cp
        probs = a.micro_batch * heads // tp * s_local * a.seq
        attention += e * 2 * t * q // tp  # key and value expanded to the query heads
        attention += FP32 * probs + (e * probs if e != FP32 else 0)
    if moe:
        experts, topk = m.num_moe_experts, m.moe_router_topk
        f = m.moe_ffn_hidden_size or default_ffn_hidden_size(m)
        routed = t * topk // a.ep
        mlp = 2 * FP32 * t * experts + e * routed * (h + f * (3 if gated else 2))
        shared = m.moe_shared_expert_intermediate_size or 0
        mlp += e * t * shared * (3 if gated else 2) // tp
    else:
        f = default_ffn_hidden_size(m)
        mlp = e * t * f * (3 if gated else 2) // tp
    return norms + attention + mlp


def activation_bytes(
    m: ModelConfig,
    a: ActivationShape,
    layers: range,
    *,
    first_stage: bool,
    last_stage: bool,
    vocab: int,
) -> tuple[int, int]:
    """(bytes kept for backward by one micro-batch on the stage holding ``layers``, the extra
    bytes of the one layer full recomputation rebuilds at a time). ``vocab`` is padded."""
    pattern = moe_layer_pattern(m)
    t = a.seq * a.micro_batch // a.cp
    per_layer = [_layer_bytes(m, a, pattern[i]) for i in layers]
    if a.recompute == "full":
        ht = t * m.hidden_size // (a.tp if a.sequence_parallel else 1)
        kept = a.element_bytes * ht * len(per_layer)
        peak = max(per_layer, default=0)
    else:
        kept, peak = sum(per_layer), 0
    if first_stage:
        kept += a.element_bytes * t * m.hidden_size // (a.tp if a.sequence_parallel else 1)
    if last_stage:
        kept += (a.element_bytes + FP32) * t * vocab // a.tp
    return kept, peak
