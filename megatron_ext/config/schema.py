"""The recipe schema: one typed dataclass per YAML section.

Field names follow megatron-core where a counterpart exists (``TransformerConfig``,
``OptimizerConfig``, ``DistributedDataParallelConfig``, ``OptimizerParamScheduler``).  Each field
may carry validation metadata (``ge``/``gt``/``le`` bounds, ``choices``; :func:`.fields.spec`)
read by :mod:`megatron_ext.config.load`; cross-field rules live in :meth:`Recipe.check`.
A trainer's own section (``soma:``) and rules are declared by the trainer and composed here
through the trainer registry (:mod:`megatron_ext.run.trainers`).

This module must not import torch: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from megatron_ext.config.fields import spec
from megatron_ext.config.moe_presets import MOE_PRESETS, check_moe_fields
from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.run.precision import Precision, check_precision_fields
from megatron_ext.run.stopping import check_stop_fields
from megatron_ext.run.trainers import get_trainer, trainer_sections
from megatron_ext.schedules.lr import DecayStyle, WsdDecayStyle

if TYPE_CHECKING:
    from megatron_ext.schedules.lr import LRSchedule


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
        "aux_loss", "seq_aux_loss", "global_aux_loss", "none"
    ] = spec("aux_loss")
    moe_aux_loss_coeff: float = spec(0.0, ge=0.0, help="megatron-core's, per MoE layer")
    moe_z_loss_coeff: float | None = spec(None, ge=0.0)
    moe_router_pre_softmax: bool = spec(False, help="softmax over all experts before top-k")
    moe_router_topk_scaling_factor: float | None = spec(None, gt=0.0)
    moe_router_bias_update_rate: float = spec(1e-3, ge=0.0)
    moe_router_num_groups: int | None = spec(None, ge=1)
    moe_router_group_topk: int | None = spec(None, ge=1)
    moe_router_dtype: Literal["fp32", "fp64"] = spec("fp32")
    moe_shared_expert_intermediate_size: int | None = spec(None, ge=1)
    moe_shared_expert_gate: bool = False
    moe_shared_expert_overlap: bool = False
    moe_layer_freq: list[int] = spec(
        [], help="[] = every layer MoE; [N] = one in N; or a 0/1 pattern, one per layer"
    )
    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = spec("alltoall")
    moe_grouped_gemm: bool = False


@dataclass
class DataConfig:
    """Where tokens come from."""

    path: str = spec("", help="indexed-dataset prefix (<path>.bin/.idx)")
    source: list[str] = spec(
        [],
        help="text inputs built into `path` when it is missing; "
        "'python-stdlib' = the installed stdlib's docstrings",
    )
    tokenizer: Literal["byte", "sentencepiece"] = spec("byte")
    tokenizer_model: str = spec("", help="SentencePiece .model file")
    split: str = spec("98,2,0", help="train,valid,test weights")


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
    seed: int = spec(1234, ge=0)
    precision: Precision = spec(
        "fp32", help="megatron_ext.run.precision maps each to megatron-core"
    )
    num_layers_at_start_in_bf16: int = spec(
        0, ge=0, help="FP8/FP4: first transformer layers kept in BF16"
    )
    num_layers_at_end_in_bf16: int = spec(0, ge=0, help="FP8/FP4: last layers kept in BF16")
    lr_warmup_steps: int = spec(0, ge=0)
    lr_decay_style: DecayStyle = spec("cosine")
    lr_decay_steps: int | None = spec(None, ge=1, help="None = steps")
    lr_wsd_decay_steps: int | None = spec(None, ge=1, help="WSD: length of the final decay")
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


@dataclass
class ParallelConfig:
    """Model-parallel sizes; data parallel is derived: dp = world / (tp * pp * cp)."""

    tensor_model_parallel_size: int = spec(1, ge=1)
    pipeline_model_parallel_size: int = spec(1, ge=1)
    context_parallel_size: int = spec(1, ge=1)
    expert_model_parallel_size: int = spec(1, ge=1)
    sequence_parallel: bool = False
    backend: Literal["auto", "nccl", "gloo"] = spec(
        "auto", help="auto = nccl with CUDA, gloo without"
    )


@dataclass
class LoggingConfig:
    log_interval: int = spec(1, ge=1)
    tensorboard: bool = True
    progress_bar: Literal["auto", "on", "off"] = spec("auto")


@dataclass
class CheckpointConfig:
    save_interval: int = spec(0, ge=0, help="0 = only at the end")
    save_at_end: bool = True
    load: str = spec(
        "auto",
        help="'auto' = resume from run_dir/checkpoints if present; "
        "'none'; or a checkpoint directory (a step_000000 one gives only its weights)",
    )
    save_initial: bool = spec(False, help="also write step_000000 before the first step")
    keep_last: int = spec(2, ge=1, help="intact checkpoints kept (older ones are deleted)")
    verify: Literal["checksums", "sizes"] = spec(
        "checksums",
        help="before loading: each file's size and CRC-32 against manifest.json, or sizes only",
    )


@dataclass
class LaunchConfig:
    nproc_per_node_cpu: int = spec(2, ge=1, help="ranks per node on a CPU-only host")
    master_port: int = spec(29500, ge=1, le=65535)
    threads_per_rank: int = spec(0, ge=0, help="torch threads per rank; 0 = cores / ranks")


@dataclass
class Recipe:
    """A whole run: the object every trainer receives."""

    trainer: str = spec("gpt", help="a registered trainer (megatron_ext.run.trainers)")
    run_dir: str = spec("runs/default", help="logs, plots, checkpoints, summary.json")
    model: ModelConfig = field(default_factory=ModelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    # The registered trainers' own sections by name (``soma`` -> SomaConfig), each a top-level
    # YAML section; read one with :meth:`section`.
    sections: dict[str, Any] = field(default_factory=dict, metadata={"trainer_sections": True})

    def __post_init__(self) -> None:
        for name, config in trainer_sections().items():
            self.sections.setdefault(name, config())

    def section[T](self, kind: type[T]) -> T:
        """This recipe's trainer section of type ``kind``, e.g. ``recipe.section(SomaConfig)``."""
        for value in self.sections.values():
            if isinstance(value, kind):
                return value
        raise KeyError(f"no registered trainer declares a {kind.__name__} section")

    def lr_schedule(self) -> LRSchedule:
        """The learning-rate schedule this recipe describes (``training.lr_decay_steps=None`` =
        ``training.steps``); raises ``ConfigError`` if it is inconsistent."""
        from megatron_ext.schedules.lr import LRSchedule
        from megatron_ext.schedules.plan import run_steps

        t = self.training
        return LRSchedule(
            max_lr=self.optimizer.lr,
            min_lr=self.optimizer.min_lr,
            warmup_steps=t.lr_warmup_steps,
            decay_steps=run_steps(self) if t.lr_decay_steps is None else t.lr_decay_steps,
            decay_style=t.lr_decay_style,
            wsd_decay_steps=t.lr_wsd_decay_steps,
            wsd_decay_style=t.lr_wsd_decay_style,
        )

    def check(self, world_size: int | None = None) -> None:
        """Cross-field rules of the shared sections, then the trainer's own (its registered
        ``check``); raises ``ConfigError``. ``world_size`` adds the layout checks."""
        from megatron_ext.errors import ConfigError

        trainer = get_trainer(self.trainer)  # an unregistered name stops here, first
        m, t, p = self.model, self.training, self.parallel
        if m.hidden_size % m.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={m.hidden_size} is not divisible by "
                f"model.num_attention_heads={m.num_attention_heads}"
            )
        groups = m.num_query_groups or m.num_attention_heads
        if m.num_attention_heads % groups:
            raise ConfigError(
                f"model.num_attention_heads={m.num_attention_heads} is not "
                f"divisible by model.num_query_groups={groups}"
            )
        check_moe_fields(m, p.expert_model_parallel_size)
        if groups % p.tensor_model_parallel_size:
            raise ConfigError(
                f"attention groups ({groups}) are not divisible by "
                f"parallel.tensor_model_parallel_size="
                f"{p.tensor_model_parallel_size}"
            )
        if m.num_layers % p.pipeline_model_parallel_size:
            raise ConfigError(
                f"model.num_layers={m.num_layers} is not divisible by "
                f"parallel.pipeline_model_parallel_size="
                f"{p.pipeline_model_parallel_size}"
            )
        from megatron_ext.schedules.plan import run_steps

        steps = run_steps(self)  # training.steps, or the steps training.train_tokens takes
        if t.lr_warmup_steps > steps:
            window = t.lr_wsd_decay_steps if t.lr_decay_style == "WSD" else None
            fits = t.lr_warmup_steps + (window or 1)  # warmup, then the decay (WSD: its window)
            raise ConfigError(
                f"training.lr_warmup_steps={t.lr_warmup_steps} exceeds training.steps={steps}: "
                f"lower training.lr_warmup_steps, or set training.steps to at least {fits}"
            )
        if self.optimizer.min_lr > self.optimizer.lr:
            raise ConfigError(
                f"optimizer.min_lr={self.optimizer.min_lr} exceeds optimizer.lr={self.optimizer.lr}"
            )
        if t.lr_decay_style == "WSD" and t.lr_wsd_decay_steps is None:
            raise ConfigError(
                "training.lr_decay_style=WSD needs training.lr_wsd_decay_steps "
                "(the length of the final decay window)"
            )
        if self.data.tokenizer == "sentencepiece" and not self.data.tokenizer_model:
            raise ConfigError(
                "data.tokenizer=sentencepiece needs data.tokenizer_model "
                "(train one with `megatron-ext data tokenizer`)"
            )
        check_precision_fields(self)
        self.optimizer.check()
        check_stop_fields(t)
        trainer.check(self, world_size)
