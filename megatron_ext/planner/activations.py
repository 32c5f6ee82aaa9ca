"""Bytes one micro-batch keeps for backward on one rank of a GPT run.

Counted tensor by tensor from what autograd saves, with ``t`` tokens on the rank
(``seq·micro_batch / cp``), ``h`` the hidden size, ``q`` and ``kv`` the query and key/value
widths (heads × head size), ``f`` the MLP width, ``e`` the model dtype's bytes; with sequence
parallelism the ``t·h`` tensors (and the norms' per-token statistics) are split over TP, the
rest is per TP rank (``/tp``). Per transformer layer:

- **norms** (before attention, before the MLP; the final norm on the last stage): the local
  spec's torch norm saves its input and the normalised input in fp32 and an fp32 statistic per
  token; Transformer Engine's (fused into the next linear) its input in ``e`` and the statistic.
  The linear after it saves the norm's output (``e·t·h``), counted with that linear. q/k norms
  (``qk_layernorm``) are norms over the query and key widths whose output only RoPE reads (it
  saves no input);
- **RoPE**: the cos and sin tables, for the query and for the key (``4·s·head size``, ``e``);
- **attention**: the rotated query and the core attention's output (``t·q``, the output
  projection reads the same storage). The local spec's SDPA with grouped-query attention saves
  the key and value expanded to the query heads (``2·t·q``); otherwise (one group per head,
  Transformer Engine's fused attention, or selective recomputation, whose checkpoint saves the
  core attention's inputs) the rotated key (``t·kv``) and the value, a view that keeps the whole
  QKV output alive (``t·(q + 2kv)``). Without selective recomputation an fp32 log-sum-exp per
  head and token (flash-style kernels: CPU SDPA, TE): never the ``s²`` probabilities;
- **MLP**: its input (the norm's output), fc1's output, and for SwiGLU the activation of the
  gate half, the linear half (megatron-core adds ``glu_linear_offset``, a new tensor) and their
  product read by fc2: ``(2 + 3)·t·f``; for GELU fc1's output and the activation: ``2·t·f``;
- **MoE**: the router's fp32 logits, scores and routing map (``3·t·E``), its top-k indices and
  the dispatcher's permutation indices (int64), the ``t·topk`` token copies routed to this
  rank's experts (uniform routing: each EP rank receives ``t·topk/ep`` from each of the ``ep``
  ranks), each expert's MLP tensors on its tokens, their fp32 routing weight, and a shared
  expert as a dense MLP.

The first stage adds the token ids the embedding saves (int64), the last the final norm, the
output layer's input, the fp32 logits the cross-entropy keeps (a half model's logits are cast,
the cast saves nothing), its per-token target and mask, and the loss mask.

Recomputation: ``selective`` drops the attention's expanded key/value and log-sum-exp and
rebuilds them one layer at a time in backward; ``full`` keeps only each layer's input
(``e·t·h``) and rebuilds one whole layer at a time. :func:`activation_bytes` returns both.
Micro-batches in flight (1F1B: ``pp − stage``) multiply what is kept.

``tests/test_planner_measure.py`` checks these counts against the bytes a CPU run's autograd
graph actually saves (``torch.autograd.graph.saved_tensors_hooks``). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_ext.gpt.sections import ModelConfig
from megatron_ext.planner.params import default_ffn_hidden_size, moe_layer_pattern

__all__ = ["ActivationShape", "activation_bytes"]

FP32 = 4
INT64 = 8


@dataclass(frozen=True)
class ActivationShape:
    """What sizes a micro-batch's activations on one rank."""

    seq: int
    micro_batch: int
    tp: int = 1
    cp: int = 1
    ep: int = 1  # uniform routing: a rank's experts get t·topk token copies at any EP size
    sequence_parallel: bool = False
    element_bytes: int = 2  # the model dtype
    # Transformer Engine's layers (fused attention, norms fused into the next linear); False:
    # the local spec (torch norms, SDPA core attention), what a CPU host runs
    fused_attention: bool = True
    recompute: str = "none"  # parallel.recompute_granularity
    recompute_method: str = "uniform"  # full: parallel.recompute_method
    recompute_num_layers: int = 1  # full: parallel.recompute_num_layers

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on this rank."""
        return self.seq * self.micro_batch // self.cp


def _norm(a: ActivationShape, rows: int, width: int) -> int:
    """A norm over ``rows × width`` elements (the output is counted with its reader)."""
    if a.fused_attention:  # Transformer Engine: input in the model dtype, fp32 rsigma
        return a.element_bytes * rows * width + FP32 * rows
    return 2 * FP32 * rows * width + FP32 * rows  # torch: fp32 input and normalised input, rstd


def _mlp(a: ActivationShape, tokens: int, width: int, gated: bool) -> int:
    """An MLP's tensors past its input: fc1's output, the activation, fc2's input."""
    return a.element_bytes * tokens * width * (5 if gated else 2)


def _attention(m: ModelConfig, a: ActivationShape) -> int:
    """Self-attention of one layer, from the q/k norms to the output projection's input."""
    e, tp, t = a.element_bytes, a.tp, a.tokens
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    head = m.kv_channels or m.hidden_size // heads
    q, kv = heads * head // tp, groups * head // tp  # widths on this rank
    total = 0
    if m.qk_layernorm:
        if m.qk_layernorm_scope == "head":  # over each head
            total += _norm(a, t * heads // tp, head) + _norm(a, t * groups // tp, head)
        else:  # over this rank's whole projection
            total += _norm(a, t, q) + _norm(a, t, kv)
    if m.position_embedding_type == "rope":
        total += 4 * e * (a.seq // a.cp) * head  # cos and sin, for the query and for the key
    total += e * t * q  # the rotated query
    if a.recompute == "selective":  # the checkpoint's inputs, and the output it returns
        return total + e * t * kv + e * t * (q + 2 * kv) + e * t * q
    if _expands_key_value(m, a):
        return total + _core_attention(m, a)
    return total + e * t * kv + e * t * (q + 2 * kv) + _core_attention(m, a)


def _expands_key_value(m: ModelConfig, a: ActivationShape) -> bool:
    """The local spec's SDPA repeats grouped keys and values to the query heads."""
    groups = m.num_query_groups or m.num_attention_heads
    return not a.fused_attention and groups != m.num_attention_heads


def _core_attention(m: ModelConfig, a: ActivationShape) -> int:
    """What the core attention itself saves beyond its inputs: the expanded key and value
    (local SDPA with grouped queries), its output (the projection's input too) and an fp32
    log-sum-exp per head and token -- what selective recomputation rebuilds in backward."""
    e, t, heads = a.element_bytes, a.tokens, m.num_attention_heads // a.tp
    q = heads * (m.kv_channels or m.hidden_size // m.num_attention_heads)
    expanded = 2 * e * t * q if _expands_key_value(m, a) else 0
    return expanded + e * t * q + FP32 * t * heads


def _moe(m: ModelConfig, a: ActivationShape) -> int:
    """A MoE MLP past its input: router, dispatch, this rank's experts, the shared expert."""
    e, t = a.element_bytes, a.tokens
    experts, topk = m.num_moe_experts, m.moe_router_topk
    gated = m.activation == "swiglu"
    f = m.moe_ffn_hidden_size or default_ffn_hidden_size(m)
    routed = t * topk  # token copies this rank's experts receive (uniform routing)
    total = 3 * FP32 * t * experts + 2 * INT64 * t * topk  # router: logits, scores, map; top-k
    total += INT64 * (t * experts + routed)  # the dispatcher's permutation indices
    total += e * routed * m.hidden_size + _mlp(a, routed, f, gated) + FP32 * routed
    shared = m.moe_shared_expert_intermediate_size or 0
    return total + _mlp(a, t, shared // a.tp, gated)


def _layer_bytes(m: ModelConfig, a: ActivationShape, moe: bool) -> int:
    """One transformer layer's saved bytes for one micro-batch (see the module docstring)."""
    sp = a.tp if a.sequence_parallel else 1
    rows, h = a.tokens // sp, m.hidden_size
    norm_and_reader = _norm(a, rows, h) + a.element_bytes * rows * h  # + the next linear's input
    total = norm_and_reader + _attention(m, a) + norm_and_reader
    if moe:
        return total + _moe(m, a)
    gated = m.activation == "swiglu"
    return total + _mlp(a, a.tokens, default_ffn_hidden_size(m) // a.tp, gated)


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
    bytes recomputation rebuilds at a time in backward: under ``full`` a chunk of
    ``recompute_num_layers`` layers (``uniform``) or one of the stage's first
    ``recompute_num_layers`` layers (``block``, each checkpointed alone; the rest kept whole),
    one layer's core attention under ``selective``, 0 without). ``vocab`` is padded."""
    pattern = moe_layer_pattern(m)
    t, e = a.tokens, a.element_bytes
    sp = a.tp if a.sequence_parallel else 1
    per_layer = [_layer_bytes(m, a, pattern[i]) for i in layers]
    if a.recompute == "full":
        inputs = e * t * m.hidden_size // sp  # what a checkpoint keeps: its input
        n = a.recompute_num_layers
        if a.recompute_method == "block":
            n = min(n, len(per_layer))
            kept = inputs * n + sum(per_layer[n:])
            rebuild = max(per_layer[:n], default=0)  # a layer rebuilt, as saved without
        else:  # uniform: chunks of n layers, each rebuilt whole in backward
            chunks = [per_layer[i : i + n] for i in range(0, len(per_layer), n)]
            kept = inputs * len(chunks)
            rebuild = max((sum(c) for c in chunks), default=0)
    elif a.recompute == "selective":
        kept = sum(per_layer)
        rebuild = _core_attention(m, a) if layers else 0
    else:
        kept, rebuild = sum(per_layer), 0
    if first_stage:
        kept += INT64 * t  # the token ids
    if last_stage:
        kept += _norm(a, t // sp, m.hidden_size) + e * t * m.hidden_size // sp  # final norm
        kept += FP32 * t * vocab // a.tp  # the logits, fp32, for the cross-entropy
        kept += (1 + INT64 + FP32) * t  # its target mask and target; the loss mask
    return kept, rebuild
