"""The parameters one rank of a GPT run holds, without building the model (no torch).

:func:`gpt_parameters` lists them as megatron-core's ``GPTModel.named_parameters()`` does for the
model :func:`megatron_ext.megatron.model.build_gpt_model` builds on the local spec (what runs on
CPU): the same names, this rank's shard shapes, in the same order. ``tests/test_planner_params.py``
compares the list with real models, dense and MoE, at TP=2, EP=2 and PP=2.

What megatron-core does, and this module follows:

- ``named_parameters()`` yields a module's own parameters before its children's, children in
  the order they were assigned: attention assigns ``linear_proj`` before ``linear_qkv``, a shared
  expert its ``gate_weight`` before its linears, and ``GPTModel`` is embedding, decoder,
  output layer.
- Tensor parallelism (TP ranks ``tp``) splits the output rows of column-parallel linears (qkv,
  fc1, the word embedding and the output layer, biases too) and the input columns of
  row-parallel ones (proj, fc2; their bias is whole). Norms (OLMoE's projection q/k norms
  too), the router, a shared expert's gate and position embeddings are whole on every rank.
  Experts split over the expert tensor-parallel group, which megatron-core sizes like the TP
  group.
- An expert linear is marked ``allreduce=False`` only with expert parallelism (EP > 1); at
  EP=1 its gradients are all-reduced like any dense weight's.
- The router's expert bias (``moe_router_enable_expert_bias``) is a buffer, not a parameter.
- Pipeline stage ``r`` of ``pp`` holds layers ``r*L/pp .. (r+1)*L/pp - 1``, named from 0.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_ext.errors import ConfigError
from megatron_ext.gpt.recipe import check_model_layout, uneven_pipeline_split
from megatron_ext.gpt.sections import ModelConfig, ParallelConfig

__all__ = [
    "NotModelled",
    "PlannedParam",
    "check_plannable",
    "default_ffn_hidden_size",
    "gpt_parameters",
    "moe_layer_pattern",
    "padded_vocab_size",
    "stage_layers",
]


class NotModelled(ConfigError):
    """A recipe megatron-core trains that the plan has no model for (an uneven pipeline split,
    a recomputation form): ``megatron-ext plan`` refuses it; the launcher's fit check skips it
    and says why."""


@dataclass(frozen=True)
class PlannedParam:
    """One parameter of one rank."""

    name: str  # as GPTModel.named_parameters() names it on this rank
    shape: tuple[int, ...]  # this rank's shard, elements
    is_expert: bool  # megatron-core sets allreduce=False (expert-parallel weights)
    tensor_parallel: bool  # megatron-core's tensor_model_parallel attribute is True
    partition_dim: int | None = None  # the axis TP splits (0 column-, 1 row-parallel), if split
    #: a word embedding tied to the output layer over pipeline stages (its first- and last-stage
    #: copies; megatron-core's ``shared_embedding``): the element-sharded AdamW buckets it alone
    shared_embedding: bool = False

    def full_shape(self, tp: int) -> tuple[int, ...]:
        """The whole tensor's shape across the ``tp`` ranks of its TP group."""
        if self.partition_dim is None or tp == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.partition_dim] *= tp
        return tuple(shape)

    @property
    def numel(self) -> int:
        """Elements of this rank's shard."""
        count = 1
        for size in self.shape:
            count *= size
        return count


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by * tp``, so that
    every tensor-parallel shard of the embedding has a multiple of the divisor (the builder's
    rule)."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def default_ffn_hidden_size(model: ModelConfig) -> int:
    """The dense MLP width the builder gives megatron-core: ``model.ffn_hidden_size``, else
    8/3 hidden rounded up to a multiple of 64 (SwiGLU), else 4 hidden."""
    if model.ffn_hidden_size:
        return model.ffn_hidden_size
    if model.activation == "swiglu":
        return int(8 * model.hidden_size / 3 + 63) // 64 * 64
    return 4 * model.hidden_size


def moe_layer_pattern(model: ModelConfig) -> list[bool]:
    """Per global layer, whether its MLP is a MoE layer (``model.moe_layer_freq``: [] every
    layer, [N] one in N from the first, or a 0/1 pattern); all False for a dense model."""
    freq = model.moe_layer_freq
    n = model.num_layers
    if not model.num_moe_experts:
        return [False] * n
    if not freq:
        return [True] * n
    if len(freq) == 1:
        return [i % freq[0] == 0 for i in range(n)]
    return [bool(x) for x in freq]


@dataclass(frozen=True)
class _Dims:
    """The resolved sizes one rank's shapes are cut from (elements)."""

    model: ModelConfig
    tp: int
    ep: int
    kv_channels: int
    query_groups: int
    ffn: int  # dense MLP width
    moe_ffn: int  # one routed expert's width
    vocab: int  # padded, whole

    @property
    def gated(self) -> bool:
        return self.model.activation == "swiglu"

    @property
    def bias(self) -> bool:
        return self.model.add_bias_linear


def _norm(prefix: str, width: int, layer_norm: bool) -> list[PlannedParam]:
    """A norm over ``width`` channels: weight, and bias for LayerNorm; whole on every rank."""
    names = ("weight", "bias") if layer_norm else ("weight",)
    return [PlannedParam(f"{prefix}.{n}", (width,), False, False) for n in names]


def _column(
    prefix: str, out: int, inp: int, d: _Dims, *, bias: bool, expert: bool = False
) -> list[PlannedParam]:
    """Column-parallel linear ``inp -> out``: weight [out/tp, inp], bias [out/tp]."""
    local = out // d.tp
    marked = expert and d.ep > 1
    params = [PlannedParam(f"{prefix}.weight", (local, inp), marked, True, 0)]
    if bias:
        params.append(PlannedParam(f"{prefix}.bias", (local,), marked, True, 0))
    return params


def _row(
    prefix: str, out: int, inp: int, d: _Dims, *, bias: bool, expert: bool = False
) -> list[PlannedParam]:
    """Row-parallel linear ``inp -> out``: weight [out, inp/tp], bias [out] (whole)."""
    marked = expert and d.ep > 1
    params = [PlannedParam(f"{prefix}.weight", (out, inp // d.tp), marked, True, 1)]
    if bias:
        params.append(PlannedParam(f"{prefix}.bias", (out,), marked, False))
    return params


def _attention(prefix: str, d: _Dims) -> list[PlannedParam]:
    """Self-attention: proj, fused qkv ([q heads + 2 groups] x kv_channels rows), q/k norms."""
    m, kv = d.model, d.kv_channels
    q_width, kv_width = m.num_attention_heads * kv, d.query_groups * kv
    params = _row(f"{prefix}.linear_proj", m.hidden_size, q_width, d, bias=d.bias)
    params += _column(f"{prefix}.linear_qkv", q_width + 2 * kv_width, m.hidden_size, d, bias=d.bias)
    if m.qk_layernorm and m.qk_layernorm_scope == "head":
        layer_norm = m.normalization == "LayerNorm"
        params += _norm(f"{prefix}.q_layernorm", kv, layer_norm)
        params += _norm(f"{prefix}.k_layernorm", kv, layer_norm)
    elif m.qk_layernorm:  # megatron_ext.megatron.qk_norm: RMSNorm, whole projection per rank
        params += _norm(f"{prefix}.q_layernorm", q_width, False)
        params += _norm(f"{prefix}.k_layernorm", kv_width, False)
    return params


def _mlp(prefix: str, width: int, d: _Dims, *, expert: bool = False) -> list[PlannedParam]:
    """fc1 (gate and up rows for SwiGLU) and fc2 of an MLP ``width`` wide."""
    hidden = d.model.hidden_size
    rows = 2 * width if d.gated else width
    params = _column(f"{prefix}.linear_fc1", rows, hidden, d, bias=d.bias, expert=expert)
    return params + _row(f"{prefix}.linear_fc2", hidden, width, d, bias=d.bias, expert=expert)


def _moe(prefix: str, d: _Dims) -> list[PlannedParam]:
    """Router (whole), this rank's E/ep experts (local indices), then the shared expert."""
    m = d.model
    experts, hidden = m.num_moe_experts, m.hidden_size
    params = [PlannedParam(f"{prefix}.router.weight", (experts, hidden), False, False)]
    if d.bias:
        params.append(PlannedParam(f"{prefix}.router.bias", (experts,), False, False))
    for i in range(experts // d.ep):
        params += _mlp(f"{prefix}.experts.local_experts.{i}", d.moe_ffn, d, expert=True)
    shared = m.moe_shared_expert_intermediate_size
    if shared:
        if m.moe_shared_expert_gate:
            gate = PlannedParam(f"{prefix}.shared_experts.gate_weight", (1, hidden), False, False)
            params.append(gate)
        params += _mlp(f"{prefix}.shared_experts", shared, d)
    return params


def _layer(prefix: str, d: _Dims, moe: bool) -> list[PlannedParam]:
    """One transformer layer: norm, attention, norm, MLP or MoE."""
    hidden, layer_norm = d.model.hidden_size, d.model.normalization == "LayerNorm"
    params = _norm(f"{prefix}.input_layernorm", hidden, layer_norm)
    params += _attention(f"{prefix}.self_attention", d)
    params += _norm(f"{prefix}.pre_mlp_layernorm", hidden, layer_norm)
    mlp = _moe(f"{prefix}.mlp", d) if moe else _mlp(f"{prefix}.mlp", d.ffn, d)
    return params + mlp


def stage_layers(
    model: ModelConfig, pp: int, pp_rank: int, vp_stage: int = 0, vp: int = 1
) -> range:
    """The global layer indices of pipeline stage ``pp_rank`` (its virtual stage ``vp_stage``
    of ``vp``), as megatron-core 0.19 splits them (``get_num_layers_to_build``,
    ``get_transformer_layer_offset``): evenly over the ``pp·vp`` model stages, chunk ``v`` of
    rank ``r`` being stage ``v·pp + r``; without virtual stages also with
    ``num_layers_in_first/last_pipeline_stage`` (in ``model.transformer_config``), those counts
    on the first / last stage and the rest evenly between; with
    ``account_for_embedding/loss_in_pipeline_split`` the embedding / loss counted as a layer of
    the first / last model stage. A pipeline layout, and first/last counts with virtual
    stages, are :class:`NotModelled` (:func:`check_plannable`)."""
    counts = _stage_counts(model, pp * vp)
    stage = vp_stage * pp + pp_rank
    start = sum(counts[:stage])
    return range(start, start + counts[stage])


def _stage_counts(model: ModelConfig, pp: int) -> list[int]:
    """Transformer layers per pipeline stage (:func:`stage_layers`)."""
    fields = model.transformer_config
    first, last = (fields.get(f"num_layers_in_{e}_pipeline_stage") for e in ("first", "last"))
    if pp == 1:
        return [model.num_layers]
    if first is not None or last is not None:
        rest = model.num_layers - (first or 0) - (last or 0)
        middle = pp - (first is not None) - (last is not None)
        each = rest // middle if middle else 0
        counts = [each] * pp
        if first is not None:
            counts[0] = first
        if last is not None:
            counts[-1] = last
        return counts
    embedding = int(bool(fields.get("account_for_embedding_in_pipeline_split")))
    loss = int(bool(fields.get("account_for_loss_in_pipeline_split")))
    counts = [(model.num_layers + embedding + loss) // pp] * pp
    counts[0] -= embedding
    counts[-1] -= loss
    return counts


def gpt_parameters(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    vocab_size: int,
    pp_rank: int = 0,
    seq_length: int | None = None,
) -> list[PlannedParam]:
    """Pipeline rank ``pp_rank``'s parameters: its chunks' (:func:`chunk_parameters`) in
    order."""
    chunks = chunk_parameters(
        model, parallel, vocab_size=vocab_size, pp_rank=pp_rank, seq_length=seq_length
    )
    return [p for chunk in chunks for p in chunk]


def chunk_parameters(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    vocab_size: int,
    pp_rank: int = 0,
    seq_length: int | None = None,
) -> list[list[PlannedParam]]:
    """Per model chunk of pipeline rank pp_rank (one without virtual stages), in
    named_parameters() order (embedding on the first stage's first chunk, final norm + output
    layer on the last stage's last chunk; layers split as megatron-core splits them; with
    virtual stages each name starts with ``chunk<v>.``, as the trainer names them).

    ``model`` is resolved (a ``moe_preset`` already expanded, as the recipe loader does);
    ``vocab_size`` is the tokenizer's (``model.vocab_size`` wins), padded as the builder pads
    it; ``seq_length`` (tokens) sizes learned absolute position embeddings. A configuration the
    builder or the recipe refuses raises ``ValueError`` naming the field."""
    check_plannable(model, parallel, pp_rank=pp_rank, seq_length=seq_length)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    ffn = default_ffn_hidden_size(model)
    d = _Dims(
        model=model,
        tp=tp,
        ep=parallel.expert_model_parallel_size,
        kv_channels=model.kv_channels or model.hidden_size // model.num_attention_heads,
        query_groups=model.num_query_groups or model.num_attention_heads,
        ffn=ffn,
        moe_ffn=model.moe_ffn_hidden_size or ffn,
        vocab=padded_vocab_size(
            model.vocab_size or vocab_size, model.make_vocab_size_divisible_by, tp
        ),
    )
    vp = parallel.virtual_pipeline_model_parallel_size or 1
    tied_over_stages = not model.untie_embeddings_and_output_weights and pp > 1
    chunks = []
    for v in range(vp):
        first, last = pp_rank == 0 and v == 0, pp_rank == pp - 1 and v == vp - 1
        params = _chunk(d, stage_layers(model, pp, pp_rank, v, vp), first, last, seq_length)
        chunks.append(
            [  # named as the trainer names several chunks; a tied embedding's copies marked
                replace(
                    p,
                    name=f"chunk{v}.{p.name}" if vp > 1 else p.name,
                    shared_embedding=tied_over_stages and p.name in (_WORD, _OUTPUT),
                )
                for p in params
            ]
        )
    return chunks


_WORD, _OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"


def _chunk(
    d: _Dims, layers: range, first: bool, last: bool, seq_length: int | None
) -> list[PlannedParam]:
    """One model chunk's parameters (``layers``: its global layer indices; ``first``/``last``:
    whether it holds the embedding / the final norm and output layer)."""
    model, tp, hidden = d.model, d.tp, d.model.hidden_size
    params: list[PlannedParam] = []
    if first:
        params.append(PlannedParam(_WORD, (d.vocab // tp, hidden), False, True, 0))
        if model.position_embedding_type == "learned_absolute":
            assert seq_length is not None  # check_plannable
            position = PlannedParam(
                "embedding.position_embeddings.weight", (seq_length, hidden), False, False
            )
            params.append(position)
    pattern = moe_layer_pattern(model)
    for local, layer in enumerate(layers):
        params += _layer(f"decoder.layers.{local}", d, pattern[layer])
    if last:
        params += _norm("decoder.final_layernorm", hidden, model.normalization == "LayerNorm")
        # tied weights on one stage: the output layer reads the embedding's, it holds none
        if model.untie_embeddings_and_output_weights or not first:
            params.append(PlannedParam(_OUTPUT, (d.vocab // tp, hidden), False, True, 0))
    return params


def check_plannable(
    model: ModelConfig, parallel: ParallelConfig, *, pp_rank: int = 0, seq_length: int | None
) -> None:
    """Refuse, naming the field, what the builder, megatron-core's ``TransformerConfig`` or the
    recipe's rules refuse, and what the plan cannot spell (Transformer Engine's layers)."""
    m, p = model, parallel
    tp, pp, ep = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size,
    )
    if m.transformer_impl == "transformer_engine":
        raise ValueError(
            "model.transformer_impl=transformer_engine: the plan spells the local spec's "
            "parameters (Transformer Engine fuses the norms into linear_qkv/linear_fc1); "
            "plan with 'local' or 'auto'"
        )
    if m.moe_preset and not m.num_moe_experts:
        raise ValueError(
            f"model.moe_preset={m.moe_preset!r} is not expanded: build the ModelConfig as the "
            "recipe loader does (megatron_ext.config.moe_presets.expand_moe_preset)"
        )
    if m.position_embedding_type == "learned_absolute" and seq_length is None:
        raise ValueError(
            "model.position_embedding_type=learned_absolute needs seq_length "
            "(the position embedding has one row per position)"
        )
    check_model_layout(m, p)  # the recipe check's rules: heads, groups, MoE, TP, PP
    if pp > 1 and m.transformer_config.get("pipeline_model_parallel_layout"):
        raise NotModelled(
            "model.transformer_config.pipeline_model_parallel_layout: the planner splits the "
            "layers by megatron-core's counts (even, first/last stage counts, embedding and "
            "loss counted as layers), not by a layout (plan the recipe without it)"
        )
    first_last = [
        f
        for f in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")
        if m.transformer_config.get(f) is not None
    ]
    if p.virtual_pipeline_model_parallel_size and first_last:
        raise NotModelled(
            f"model.transformer_config.{first_last[0]} with virtual pipeline stages: the "
            "planner splits the first/last stage's counts over one chunk per rank only (plan "
            "the recipe without virtual stages, or with an even split)"
        )
    stages = pp * (p.virtual_pipeline_model_parallel_size or 1)
    if pp > 1 and uneven_pipeline_split(m) and sum(_stage_counts(m, stages)) != m.num_layers:
        raise ConfigError(
            f"model.num_layers={m.num_layers} do not split over {stages} pipeline stages by "
            f"model.transformer_config's {', '.join(uneven_pipeline_split(m))}: megatron-core "
            "needs the remaining layers divisible by the remaining stages"
        )
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank={pp_rank} is not a stage of pipeline_model_parallel_size={pp}")
    ffn = default_ffn_hidden_size(m)
    if ffn % tp:
        raise ValueError(f"model.ffn_hidden_size={ffn} is not divisible by TP size {tp}")
    if ep > 1 and not m.num_moe_experts:
        raise ValueError(
            f"parallel.expert_model_parallel_size={ep} needs model.num_moe_experts > 0"
        )
    if m.num_moe_experts:
        _check_moe(m, tp, ep, ffn)


def _check_moe(m: ModelConfig, tp: int, ep: int, ffn: int) -> None:
    """The recipe's MoE rules, then megatron-core's that shape or refuse a MoE model."""
    # softmax over one score has a zero gradient
    softmax_one = m.moe_router_topk == 1 and m.moe_router_score_function == "softmax"
    if softmax_one and not m.moe_router_pre_softmax:
        raise ValueError("model.moe_router_topk=1 with softmax needs model.moe_router_pre_softmax")
    if m.add_bias_linear and tp > 1:
        raise ValueError(
            "model.add_bias_linear with experts needs expert tensor parallelism 1 "
            f"(parallel.tensor_model_parallel_size={tp})"
        )
    if m.add_bias_linear and m.moe_shared_expert_intermediate_size:
        raise ValueError(
            "model.add_bias_linear is not supported in the shared expert "
            "(model.moe_shared_expert_intermediate_size); megatron-core refuses it"
        )
    if m.moe_shared_expert_overlap and m.moe_token_dispatcher_type == "allgather":
        raise ValueError(
            "model.moe_shared_expert_overlap needs model.moe_token_dispatcher_type=alltoall"
        )
    moe_ffn = m.moe_ffn_hidden_size or ffn
    if moe_ffn % tp:
        raise ValueError(f"model.moe_ffn_hidden_size={moe_ffn} is not divisible by TP size {tp}")
    shared = m.moe_shared_expert_intermediate_size
    if shared and shared % tp:
        raise ValueError(
            f"model.moe_shared_expert_intermediate_size={shared} is not divisible by TP size {tp}"
        )
