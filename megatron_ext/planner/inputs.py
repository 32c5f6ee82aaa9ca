"""What a GPT run's plan is computed from: the cluster, the run's parallel layout and batch at
a world size, the vocabulary the model is built with, and the model section as the parameters
are listed (:mod:`.plan` computes the plan from them). Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from megatron_ext.config.schema import Recipe
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.recipe import microbatch_group
from megatron_ext.planner.gpus import DEFAULT_RESERVE_BYTES, GpuSpec
from megatron_ext.planner.params import NotModelled

__all__ = [
    "BYTE_VOCAB",
    "Cluster",
    "RunLayout",
    "fused_attention",
    "plan_vocab_size",
    "planned_model",
    "run_layout",
]

#: the byte tokenizer's vocabulary (megatron_ext.data.tokenizers.ByteTokenizer.vocab_size)
BYTE_VOCAB = 258


@dataclass(frozen=True)
class Cluster:
    """The machines: ``nodes × gpus_per_node`` GPUs of one kind."""

    gpu: GpuSpec
    nodes: int
    gpus_per_node: int
    reserve_bytes: int = DEFAULT_RESERVE_BYTES

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True)
class RunLayout:
    """The parallel layout and batch of the run (sizes in ranks, sequences and tokens)."""

    tp: int
    pp: int
    cp: int
    ep: int
    dp: int
    edp: int  # expert data parallel: dp·cp/ep (expert TP = TP)
    sequence_parallel: bool
    recompute: str
    micro_batch: int
    global_batch: int
    seq: int
    recompute_method: str = "uniform"  # full recomputation's method and layer count
    recompute_num_layers: int = 1
    vp: int = 1  # model chunks per pipeline rank (virtual pipeline stages)
    vp_group: int = 1  # the interleaved schedule's micro-batch group (default: pp)

    def recomputed_layers(self, layers: int) -> int:
        """How many of a stage's ``layers`` run their forward twice."""
        if self.recompute != "full":
            return 0
        if self.recompute_method == "block":
            return min(self.recompute_num_layers, layers)
        return layers

    @property
    def micro_batches(self) -> int:
        """Micro-batches per rank per step (the gradient-accumulation count)."""
        return self.global_batch // (self.micro_batch * self.dp)

    def as_dict(self) -> dict[str, Any]:
        return {**vars(self), "micro_batches": self.micro_batches}


def plan_vocab_size(recipe: Recipe) -> int:
    """The vocabulary the model is built with (before padding): ``model.vocab_size``, else the
    tokenizer's, read without torch; a tokenizer file that cannot be read is refused."""
    m, data = recipe.model, recipe.data
    if m.vocab_size:
        return int(m.vocab_size)
    if data.tokenizer == "byte":
        return BYTE_VOCAB
    path = Path(data.tokenizer_model)
    if data.tokenizer == "sentencepiece" and path.is_file():
        import sentencepiece

        return int(sentencepiece.SentencePieceProcessor(model_file=str(path)).vocab_size())
    raise ConfigError(
        f"model.vocab_size is unset and the {data.tokenizer} tokenizer at "
        f"data.tokenizer_model={str(path)!r} cannot be read here: pass model.vocab_size=N "
        "(the tokenizer's vocabulary, e.g. 128256 for Llama-3's)"
    )


def _check_recompute_modelled(p: Any) -> None:
    """The activation model (:mod:`.activations`) knows selective recomputation of core
    attention and every form of full recomputation; selective recomputation of other modules
    is refused rather than planned as core attention's."""
    if p.recompute_granularity == "selective" and p.recompute_modules != ["core_attn"]:
        raise NotModelled(
            f"parallel.recompute_modules={p.recompute_modules}: the planner models selective "
            "recomputation of core_attn only (and full recomputation, uniform or block); plan "
            "the recipe with one of those"
        )


def run_layout(recipe: Recipe, world: int) -> RunLayout:
    """The layout at ``world`` ranks, after the recipe's own checks at that size."""
    recipe.check(world_size=world)
    p, t = recipe.parallel, recipe.training
    _check_recompute_modelled(p)
    tp, pp, cp, ep = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.context_parallel_size,
        p.expert_model_parallel_size,
    )
    dp = world // (tp * pp * cp)
    return RunLayout(
        tp=tp,
        pp=pp,
        cp=cp,
        ep=ep,
        dp=dp,
        edp=dp * cp // ep,
        sequence_parallel=p.sequence_parallel,
        recompute=p.recompute_granularity,
        recompute_method=p.recompute_method,
        recompute_num_layers=p.recompute_num_layers,
        micro_batch=t.micro_batch_size,
        global_batch=t.global_batch_size,
        seq=t.seq_length,
        vp=p.virtual_pipeline_model_parallel_size or 1,
        vp_group=microbatch_group(recipe.model, p),
    )


def planned_model(recipe: Recipe) -> Any:
    """The model section the parameters are listed for: a ``transformer_engine`` model is
    listed with the local spec's names (Transformer Engine moves each norm's weight into the
    following linear, ``linear_qkv.layer_norm_weight``: the same elements, the same routes)."""
    m = recipe.model
    return replace(m, transformer_impl="local") if m.transformer_impl == "transformer_engine" else m


def fused_attention(recipe: Recipe) -> bool:
    """Whether the cluster run's layers are Transformer Engine's (fused attention, norms fused
    into the next linear): ``auto`` and ``transformer_engine`` use TE (the NGC container has
    it); ``local`` is megatron-core's local spec with SDPA core attention (what a CPU runs)."""
    return recipe.model.transformer_impl != "local"
