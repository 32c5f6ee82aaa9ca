"""The recipe sections of a megatron-core GPT run, in megatron-core's names: ``model`` (GPT
architecture, ``TransformerConfig`` names), ``parallel`` (model-parallel sizes), ``data`` (where
tokens come from) and ``training`` (batch, length, LR schedule, precision, stopping, in
Megatron-LM's argument names).

The GPT trainer owns them (its ``GPTRecipe``; :mod:`megatron_ext.gpt.sections` re-exports them);
they live here, beside the builder that reads them (:mod:`.model`, :mod:`.parallel`) and the
converter of Megatron-LM's flags that writes them (:mod:`.from_megatron`), so that megatron/
never imports the trainer above it. SOMA, DiPaCo and the planner read them too.

No torch import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from megatron_ext.config.fields import spec
from megatron_ext.config.moe_presets import MOE_PRESETS
from megatron_ext.data.kinds import TokenizerKind
from megatron_ext.errors import ConfigError
from megatron_ext.run.precision import Precision
from megatron_ext.schedules.lr import DecayStyle, WsdDecayStyle

__all__ = ["BatchRampConfig", "DataConfig", "ModelConfig", "ParallelConfig", "TrainingConfig"]


@dataclass
class ModelConfig:
    """GPT architecture (megatron-core ``TransformerConfig`` names)."""

    num_layers: int = spec(2, ge=1)
    hidden_size: int = spec(128, ge=1)
    num_attention_heads: int = spec(4, ge=1)
    num_query_groups: int | None = spec(None, ge=1, help="GQA groups; None = MHA")
    ffn_hidden_size: int | None = spec(None, ge=1, help="None = 4*hidden (2/3 of it for SwiGLU)")
    kv_channels: int | None = spec(None, ge=1)
    vocab_size: int | None = spec(None, ge=1, help="None = tokenizer's vocabulary")
    make_vocab_size_divisible_by: int = spec(128, ge=1)
    normalization: Literal["RMSNorm", "LayerNorm"] = spec("RMSNorm")
    layernorm_epsilon: float = spec(1e-5, gt=0.0)
    position_embedding_type: Literal["rope", "learned_absolute"] = spec("rope")
    rotary_base: int = spec(10000, ge=1)
    rotary_percent: float = spec(
        1.0, gt=0.0, le=1.0, help="share of each head's channels that RoPE rotates (GPTModel's)"
    )
    activation: Literal["swiglu", "gelu"] = spec("swiglu")
    add_bias_linear: bool = False
    qk_layernorm: bool = False
    qk_layernorm_scope: Literal["head", "projection"] = spec(
        "head",
        help="q/k RMSNorm per head (Qwen3) or over the whole projection (OLMoE)",
    )
    untie_embeddings_and_output_weights: bool = True
    init_method_std: float = spec(0.02, gt=0.0)
    hidden_dropout: float = spec(0.0, ge=0.0, le=1.0)
    attention_dropout: float = spec(0.0, ge=0.0, le=1.0)
    transformer_impl: Literal["auto", "local", "transformer_engine"] = spec(
        "auto",
        help="auto = Transformer Engine when installed and on GPU",
    )
    # Mixture of experts (0 experts = dense); megatron_ext.config.moe_presets
    moe_preset: str = spec(
        "", choices=MOE_PRESETS, help="olmoe, qwen3_moe, deepseek_v3; explicit fields win"
    )
    num_moe_experts: int = spec(0, ge=0)
    moe_router_topk: int = spec(2, ge=1)
    moe_ffn_hidden_size: int | None = spec(None, ge=1)
    moe_router_score_function: Literal["softmax", "sigmoid"] = spec("softmax")
    moe_router_enable_expert_bias: bool = False
    moe_router_load_balancing_type: Literal[
        "aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"
    ] = spec("aux_loss", help="megatron-core's router balancing (sinkhorn: no auxiliary loss)")
    moe_aux_loss_coeff: float = spec(0.0, ge=0.0, help="megatron-core's, per MoE layer")
    moe_z_loss_coeff: float | None = spec(None, ge=0.0)
    moe_router_pre_softmax: bool = spec(False, help="softmax over all experts before top-k")
    moe_router_topk_scaling_factor: float | None = spec(None, gt=0.0)
    moe_router_bias_update_rate: float = spec(1e-3, ge=0.0)
    moe_router_num_groups: int | None = spec(None, ge=1)
    moe_router_group_topk: int | None = spec(None, ge=1)
    moe_router_dtype: Literal["fp32", "fp64"] | None = spec(
        "fp32", help="None = the model's dtype (Megatron-LM's default)"
    )
    moe_shared_expert_intermediate_size: int | None = spec(None, ge=1)
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_layer_freq: list[int] = spec(
        [], help="[] = every layer MoE; [N] = one in N; or a 0/1 pattern, one per layer"
    )
    moe_token_dispatcher_type: Literal["alltoall", "allgather", "flex"] = spec(
        "alltoall",
        help="flex = megatron-core's DeepEP/HybridEP/NCCL-EP dispatcher (CUDA GPUs only: "
        "refused at launch on a CPU host)",
    )
    moe_grouped_gemm: bool = False
    # Every other megatron-core field, by its own name: what the fields above do not say
    transformer_config: dict[str, Any] = spec(
        {},
        help="further megatron-core TransformerConfig (MLATransformerConfig) fields by name, "
        "over what the fields above derive (activation_func by name: squared_relu, ...); "
        "names checked against megatron-core's dataclass when the model is built",
    )


@dataclass
class ParallelConfig:
    """Model-parallel sizes; data parallel is derived: dp = world / (tp * pp * cp)."""

    tensor_model_parallel_size: int = spec(1, ge=1)
    pipeline_model_parallel_size: int = spec(1, ge=1)
    virtual_pipeline_model_parallel_size: int | None = spec(
        None,
        ge=2,
        help="model chunks per pipeline rank, run by megatron-core's interleaved 1F1B schedule "
        "(Megatron-LM's --num-layers-per-virtual-pipeline-stage derives it); None = one chunk",
    )
    context_parallel_size: int = spec(1, ge=1)
    expert_model_parallel_size: int = spec(1, ge=1)
    sequence_parallel: bool = False
    recompute_granularity: Literal["none", "selective", "full"] = spec(
        "none",
        help="activation recomputation (megatron-core's): selective = the modules of "
        "recompute_modules, full = whole layers from their input (recompute_method)",
    )
    recompute_modules: list[str] = spec(
        ["core_attn"],
        help="selective recomputation's modules, megatron-core's names (core_attn, mlp, "
        "layernorm, moe, moe_act, shared_experts, mla_up_proj)",
    )
    recompute_method: Literal["uniform", "block"] = spec(
        "uniform",
        help="full recomputation: uniform = every layer, recompute_num_layers per checkpoint; "
        "block = only the first recompute_num_layers layers of each pipeline stage",
    )
    recompute_num_layers: int = spec(1, ge=1, help="full recomputation's layer count")
    backend: Literal["auto", "nccl", "gloo"] = spec(
        "auto", help="auto = nccl with CUDA, gloo without"
    )

    def __post_init__(self) -> None:
        # megatron-core reads each of these with one granularity only: set with another, the
        # recipe would promise a recomputation that does not happen
        g = self.recompute_granularity
        if g != "selective" and self.recompute_modules != ["core_attn"]:
            raise ConfigError(
                f"parallel.recompute_modules={self.recompute_modules} is read with "
                f"parallel.recompute_granularity=selective only (this recipe: {g}): set both"
            )
        if g == "selective" and not self.recompute_modules:
            raise ConfigError(
                "parallel.recompute_modules is empty: name at least one module, or set "
                "parallel.recompute_granularity=none"
            )
        full_fields = {"recompute_method": "uniform", "recompute_num_layers": 1}
        for name, default in full_fields.items():
            if g != "full" and getattr(self, name) != default:
                raise ConfigError(
                    f"parallel.{name}={getattr(self, name)!r} is read with "
                    f"parallel.recompute_granularity=full only (this recipe: {g}): set both"
                )


@dataclass
class DataConfig:
    """Where tokens come from."""

    path: str = spec("", help="indexed-dataset prefix (<path>.bin/.idx)")
    source: list[str] = spec(
        [],
        help="text inputs built into `path` when it is missing; "
        "'python-stdlib' = the installed stdlib's docstrings",
    )
    tokenizer: TokenizerKind = spec("byte")
    tokenizer_model: str = spec(
        "", help="SentencePiece .model file, or a Hugging Face tokenizer's folder"
    )
    split: str = spec("98,2,0", help="train,valid,test weights")

    def __post_init__(self) -> None:
        # megatron-core reads up to three comma-separated weights (missing ones are 0); checked
        # here so a typo stops before launch, not in the ranks' dataset builder
        parts = self.split.split(",")
        try:
            weights = [float(w) for w in parts]
        except ValueError:
            weights = []
        if not 1 <= len(parts) <= 3 or len(weights) != len(parts) or min(weights, default=-1) < 0:
            raise ConfigError(
                f"data.split={self.split!r}: give up to three non-negative train,valid,test "
                "weights, e.g. 98,2,0"
            )
        if sum(weights) <= 0:
            raise ConfigError(f"data.split={self.split!r}: the weights sum to 0")


@dataclass
class BatchRampConfig:
    """A doubling global-batch ramp (:class:`megatron_ext.schedules.batch.DoublingRamp`)."""

    start: int = spec(0, ge=0, help="first global batch B0 (sequences); 0 = no ramp")
    double_every: int = spec(0, ge=0, help="optimizer steps between doublings, up to the target")
    warmup: Literal["ramp", "first_stage", "recipe"] = spec(
        "ramp",
        help="LR warmup ends where the ramp ends, at its first doubling, or at "
        "training.lr_warmup_steps",
    )


@dataclass
class TrainingConfig:
    """Loop length, batch and the LR schedule (``OptimizerParamScheduler`` names)."""

    # Megatron's linear ramp (megatron-core 0.19 ignores it): refused with the new fields' names.
    RENAMED: ClassVar[dict[str, list[str]]] = {
        "rampup_batch_size": ["batch_ramp", "step_batch_size_schedule"]
    }
    #: fields that moved out of the section (the recipe's core holds the one seed)
    MOVED: ClassVar[dict[str, str]] = {"seed": "seed"}

    steps: int = spec(100, ge=1, help="run length in optimizer steps (set by train_tokens)")
    train_tokens: int | None = spec(
        None, ge=1, help="run length in tokens: the first step count that reaches it"
    )
    micro_batch_size: int = spec(4, ge=1)
    global_batch_size: int = spec(8, ge=1, help="the target batch (sequences) of a ramp")
    batch_ramp: BatchRampConfig = field(default_factory=BatchRampConfig)
    step_batch_size_schedule: str = spec(
        "", help="megatron-core's 'THRESHOLD:BATCH ...' (K/M/B/T suffixes); '' = none"
    )
    step_batch_size_schedule_unit: Literal["tokens", "samples"] = spec("tokens")
    batch_lr_scaling: Literal["sqrt", "none"] = spec(
        "sqrt", help="lr x sqrt(B / target B) at every batch stage"
    )
    seq_length: int = spec(128, ge=1)
    precision: Precision = spec(
        "fp32", help="megatron_ext.run.precision maps each to megatron-core"
    )
    fp8_format: Literal["e4m3", "hybrid"] | None = spec(
        None,
        help="FP8 precisions: megatron-core's fp8 format (Megatron-LM's --fp8-format) instead "
        "of the precision's (run/precision.py); hybrid = E4M3 forward, E5M2 gradients",
    )
    params_dtype: Literal["bfloat16", "float32"] | None = spec(
        None,
        help="FP8/FP4 precisions: the parameters' dtype instead of bfloat16; float32 = "
        "Megatron-LM's --fp8-format/--fp4-format without --bf16 (no Float16Module: Transformer "
        "Engine quantizes the fp32 weights at each GEMM)",
    )
    num_layers_at_start_in_bf16: int = spec(
        0, ge=0, help="FP8/FP4: first transformer layers kept in BF16"
    )
    num_layers_at_end_in_bf16: int = spec(0, ge=0, help="FP8/FP4: last layers kept in BF16")
    lr_warmup_steps: int = spec(0, ge=0)
    lr_warmup_init: float = spec(
        0.0, ge=0.0, help="the LR the warmup starts from (Megatron-LM's --lr-warmup-init)"
    )
    lr_decay_style: DecayStyle = spec("cosine")
    lr_decay_steps: int | None = spec(None, ge=1, help="None = steps")
    lr_wsd_decay_steps: int | None = spec(None, ge=1, help="WSD: length of the final decay")
    # Megatron-LM's --lr-warmup-samples / --lr-decay-samples: positions in sequences, exact
    # where they end inside a step (its scheduler counts consumed samples)
    lr_warmup_samples: int | None = spec(
        None, ge=1, help="warmup length in sequences (instead of lr_warmup_steps)"
    )
    lr_decay_samples: int | None = spec(
        None, ge=1, help="decay end in sequences (instead of lr_decay_steps)"
    )
    lr_warmup_fraction: float | None = spec(
        None,
        gt=0.0,
        lt=1.0,
        help="Megatron-LM's --lr-warmup-fraction: the warmup as a fraction of the decay "
        "(instead of lr_warmup_steps)",
    )
    lr_wsd_decay_samples: int | None = spec(
        None, ge=1, help="WSD: the final decay in sequences (instead of lr_wsd_decay_steps)"
    )
    lr_wsd_decay_style: WsdDecayStyle = spec("minus_sqrt")
    eval_interval: int = spec(
        0, ge=0, help="validation loss every N steps (and after the last); 0 = after the last only"
    )
    eval_iters: int = spec(
        0, ge=0, help="global batches of the validation split; 0 = no validation"
    )
    # Stopping early, cleanly: save a checkpoint, exit 0 (megatron_ext.run.stopping)
    exit_interval: int | None = spec(
        None, ge=1, help="save and exit after a step divisible by N (Megatron-LM's name)"
    )
    exit_duration_in_mins: float | None = spec(
        None, gt=0, help="save and exit after N minutes of this run (Megatron-LM's name)"
    )
    exit_signals: list[str] = spec(
        ["SIGTERM", "SIGUSR1"],
        help="signals on which every rank finishes its step, saves and exits 0; [] = none",
    )
