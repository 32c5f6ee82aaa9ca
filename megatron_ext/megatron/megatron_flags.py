"""The tables of :mod:`.from_megatron`: which Megatron-LM flag sets which recipe field,
Megatron-LM's defaults where the recipe's differ, the required flags and torchrun's flags. An
optimizer's own flags, defaults and spellings are its spec's (``OptimizerSpec.megatron``), read
here through the registry (:func:`optimizer_flags`, :func:`megatron_optimizers`).

No torch import.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from megatron_ext.optimizers.spec import BASE, registered_optimizers

__all__ = [
    "CONSUMED",
    "ENTRY_SCRIPTS",
    "MEGATRON_DEFAULTS",
    "MODEL_CHANGING",
    "PLAIN",
    "READ_TOGETHER",
    "REASONS",
    "REQUIRED",
    "TORCHRUN",
    "megatron_optimizers",
    "optimizer_flag_defaults",
    "optimizer_flags",
]


def megatron_optimizers() -> dict[str, str]:
    """Megatron-LM's ``--optimizer`` (megatron-core's ``OptimizerConfig.optimizer``) -> the
    registered optimizer: each spec's ``megatron.optimizers`` (``adam`` -> ``adamw``, ``soap``
    -> ``kl_soap``), and every optimizer but AdamW by its own name (the drop-in takes those)."""
    specs = registered_optimizers()
    out = {alias: spec.name for spec in specs.values() for alias in spec.megatron.optimizers}
    return out | {name: name for name in specs if name != BASE}


def optimizer_flags() -> dict[str, tuple[str, str, Mapping[str, str] | None]]:
    """Megatron-LM flag -> (registered optimizer, recipe path, the spelling table of a choice
    flag or None): every spec's ``megatron.flags``."""
    out: dict[str, tuple[str, str, Mapping[str, str] | None]] = {}
    for spec in registered_optimizers().values():
        for flag, key in spec.megatron.flags.items():
            table = spec.megatron.choices.get(flag.replace("-", "_"))
            out[flag] = (spec.name, f"optimizer.{key}", table)
    return out


def optimizer_flag_defaults(name: str) -> dict[str, Any]:
    """Megatron-LM's defaults of optimizer ``name``'s flags where the recipe's differ, as recipe
    paths (``optimizer.muon_momentum`` 0.9)."""
    spec = registered_optimizers().get(name)
    defaults = spec.megatron.flag_defaults if spec is not None else {}
    return {f"optimizer.{key}": value for key, value in defaults.items()}


# Megatron-LM 0.19's defaults where the recipe's differ (arguments.py, OptimizerConfig,
# SchedulerConfig). Not here: a model field of the same name in megatron-core's
# TransformerConfig (normalization, add_bias_linear, the dropouts, the MoE dispatcher), which
# the converter takes from Megatron-LM's own config (from_megatron_parsed._model_fields), or in
# its OptimizerConfig (adam_beta2, weight_decay: _optimizer_fields). Still
# here: GPTModel's arguments (positions, tied embeddings) and the activation, which
# TransformerConfig spells as a function and a GLU switch.
MEGATRON_DEFAULTS: dict[str, Any] = {
    "model.position_embedding_type": "learned_absolute",
    "model.activation": "gelu",
    "model.untie_embeddings_and_output_weights": False,
    "optimizer.name": "adamw",
    "training.lr_decay_style": "linear",
    "training.batch_lr_scaling": "none",  # Megatron-LM never scales the LR with the batch
    "training.lr_wsd_decay_style": "exponential",
    "data.split": "969,30,1",
    "logging.log_interval": 100,
}
REQUIRED = (
    "num-layers",
    "hidden-size",
    "num-attention-heads",
    "seq-length",
    "micro-batch-size",
    "lr",
    "data-path",
)
TORCHRUN = {"nproc-per-node", "nnodes", "node-rank", "master-addr", "master-port", "rdzv-id"}
TORCHRUN |= {"rdzv-endpoint", "rdzv-backend", "standalone"}

_I, _S = int, str
# flag -> (recipe field, converter); converter None = a switch that sets True. Only the flags
# whose Megatron-LM name is not the recipe field's: a flag that sets the namespace attribute
# named as a model / training / parallel / data / logging / checkpoint field (or the top-level
# seed) is that field without a row here (from_megatron.same_name_flags, from Megatron-LM's own
# parser). Not here either: the optimizer fields named as in megatron-core's OptimizerConfig
# (--lr, --min-lr, --weight-decay, --adam-beta1/2, --adam-eps, --clip-grad), read from
# Megatron-LM's parsed flags (from_megatron_parsed._optimizer_fields).
PLAIN: dict[str, tuple[str, Callable[[str], Any] | None]] = {
    "num-experts": ("model.num_moe_experts", _I),
    "train-iters": ("training.steps", _I),
    "lr-decay-iters": ("training.lr_decay_steps", _I),
    "lr-warmup-iters": ("training.lr_warmup_steps", _I),
    "lr-wsd-decay-iters": ("training.lr_wsd_decay_steps", _I),
    "save": ("run_dir", _S),
    # Megatron-LM's process groups' timeout, in minutes; ours is in seconds
    "distributed-timeout-minutes": ("launch.collective_timeout_s", lambda v: 60.0 * int(v)),
}
#: flags named as a recipe field that the converter reads together with others (not one field
#: each): GQA's group count, recomputation, the BF16 layer counts, partial rotary, the sample
#: positions, the checkpoint to load, the tokenizer, the MoE layer pattern
READ_TOGETHER = frozenset(
    {
        "num-query-groups",
        "recompute-granularity",
        "recompute-method",
        "recompute-num-layers",
        "recompute-modules",
        "num-layers-at-start-in-bf16",
        "num-layers-at-end-in-bf16",
        "rotary-percent",
        "lr-decay-samples",
        "lr-wsd-decay-samples",
        "lr-warmup-fraction",
        "lr-warmup-samples",
        "load",
        "tokenizer-model",
        "moe-layer-freq",
    }
)
# flags whose only effect is already the recipe's (consumed, nothing to set)
CONSUMED = {
    "use-mcore-models": "megatron-ext always builds megatron-core models",
    "exit-signal-handler": "megatron-ext saves and stops on training.exit_signals (SIGTERM, "
    "SIGUSR1 by default)",
}
# why a common flag is not mapped (the rest: "no megatron-ext counterpart")
REASONS = {
    "overlap-grad-reduce": "the layer-wise optimizer schedules its own gradient sync",
    "overlap-param-gather": "the layer-wise optimizer overlaps its all-gather with the forward",
    "use-distributed-optimizer": "always on: AdamW is element-sharded (ZeRO-1), matrix "
    "optimizers layer-wise",
    "tensorboard-dir": "TensorBoard goes to run_dir/tensorboard (logging.tensorboard)",
    "wandb-project": "no W&B logging",
    "wandb-exp-name": "no W&B logging",
    "no-load-optim": "a resume loads the whole checkpoint",
    "no-load-rng": "a resume loads the whole checkpoint",
    "rampup-batch-size": "refused by megatron-ext (and ignored by megatron-core 0.19): use "
    "--step-batch-size-schedule",
    "mock-data": "megatron-ext trains on an indexed dataset (data.path)",
    # fp16's loss scale: mapped into the optimizer section with --fp16 (from_megatron_parsed)
    **dict.fromkeys(
        ("loss-scale", "initial-loss-scale", "min-loss-scale", "loss-scale-window", "hysteresis"),
        "fp16's loss scale: Megatron-LM reads it only with --fp16",
    ),
    "attention-backend": "megatron-ext picks SDPA or Transformer Engine (model.transformer_impl)",
    "no-masked-softmax-fusion": "a kernel choice, not the model's: megatron-ext picks its kernels",
    "no-rope-fusion": "a kernel choice, not the model's: megatron-ext picks its kernels",
    "no-bias-gelu-fusion": "a kernel choice, not the model's: megatron-ext picks its kernels",
    "no-bias-dropout-fusion": "a kernel choice, not the model's: megatron-ext picks its kernels",
    "cross-entropy-loss-fusion": "a kernel choice, not the model's: megatron-ext picks its kernels",
    "moe-permute-fusion": "a kernel choice, not the model's: megatron-ext picks its kernels",
}
#: flags that make another model (or another reading of the data) than the recipe would describe
#: without them, and why megatron-ext cannot express them: the converter refuses them unless
#: --allow-unmapped (then each is a comment in the recipe). A flag whose effect is a
#: TransformerConfig field is not here: Megatron-LM's own config carries it
#: (model.transformer_config), and what the trainer cannot build is refused at launch.
MODEL_CHANGING = {
    "heterogeneous-layers-config-path": "heterogeneous layers are not built by megatron-ext",
    "hybrid-override-pattern": "hybrid (Mamba) models are not built by megatron-ext",
    # a dataset of another tokenizer's ids, read with megatron-ext's would be other tokens
    "tokenizer-type": "megatron-ext reads SentencePiece, Hugging Face (GPT-2 BPE too) and "
    "NullTokenizer ids; the dataset's ids are this tokenizer's",
    "tokenizer-model": "the model of a tokenizer megatron-ext does not read",
    "vocab-file": "GPT-2 BPE is not one of megatron-ext's tokenizers (byte, SentencePiece); the "
    "dataset's ids are its",
    "merge-file": "GPT-2 BPE is not one of megatron-ext's tokenizers (byte, SentencePiece); the "
    "dataset's ids are its",
    # FP8/FP4 pairs no training.precision has (the recipe would train in bf16)
    "fp8-format": "not one of megatron-ext's precisions",
    "fp8-recipe": "not one of megatron-ext's precisions",
    "fp4-format": "not one of megatron-ext's precisions",
    "fp4-recipe": "not one of megatron-ext's precisions",
}
#: Megatron-LM's entry scripts whose model a GPT recipe describes
ENTRY_SCRIPTS = ("pretrain_gpt.py",)
