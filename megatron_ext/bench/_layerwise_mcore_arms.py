"""The two arms of ``bench layerwise --against megatron-core``: the same GPT, data and Muon.

Both arms are built in one process from one model initialisation:

* ``megatron_core``: megatron-core's ``DistributedDataParallel`` (its bucketed gradient
  all-reduce, ``overlap_grad_reduce`` as asked) and the optimizer megatron-core's
  ``get_megatron_optimizer`` returns for ``OptimizerConfig(optimizer="muon",
  use_layer_wise_distributed_optimizer=True)``: its ``LayerWiseDistributedOptimizer`` over
  Emerging-Optimizers' ``TensorParallelMuon`` (hidden matrices) and AdamW (the rest), fp32,
  each inner optimizer wrapped in megatron-core's ``FP32Optimizer``
  (:func:`~megatron_ext.megatron.cpu_compat_layerwise.wrap_fp32_inner_optimizers`).
* ``megatron_ext``: built as the GPT trainer builds it (``megatron_ext.gpt.setup``):
  megatron-ext's DDP subclass, the optimizer from megatron-ext's drop-in
  ``get_megatron_optimizer`` given the *same* ``OptimizerConfig`` (its layer-wise optimizer,
  Muon on the hidden matrices, AdamW on the rest), the gradient sync taken over by the
  optimizer's reduce-scatter-v, and the parameter all-gather waited on in the next forward.

The Muon settings (:func:`muon_config`): Emerging-Optimizers' ``quintic`` coefficients
(megatron-ext's ``quintic_schedule``), 5 Newton–Schulz steps, spectral scale times
``extra_scale``, no update-RMS matching, QKV orthogonalised fused (``muon_split_qkv=False``:
megatron-ext has no split), Nesterov off, gradient clipping at 1.0, weight decay 0.01 (none on
norms and biases: megatron-core's ``OptimizerParamScheduler`` sets each group's from its
``wd_mult``, as in Megatron-LM's loop; without it megatron-core's groups keep the full decay).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from megatron.core.distributed import DistributedDataParallel as McDDP
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer import get_megatron_optimizer as mc_get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_ext.bench.common import optimizer_state_bytes
from megatron_ext.gpt import ModelConfig, ParallelConfig
from megatron_ext.megatron import DistributedDataParallel as ExtDDP
from megatron_ext.megatron import build_gpt_model, half_precision_module, wrap_fp32_inner_optimizers
from megatron_ext.megatron import get_megatron_optimizer as ext_get_megatron_optimizer

ARMS = ("megatron_core", "megatron_ext")
WEIGHT_DECAY = 0.01


@dataclasses.dataclass
class Arm:
    """One side: its DDP-wrapped model, its optimizer and how to read its state bytes."""

    name: str
    model: Any
    optimizer: Any
    description: str

    def state_bytes(self) -> int:
        """Bytes of optimizer state (momenta, Adam moments; fp32 masters: none, the fp32
        parameters are their own) this rank holds."""
        if self.name == "megatron_core":
            return _state_bytes(self.optimizer)
        return (
            optimizer_state_bytes(self.optimizer.optimizer)
            + self.optimizer.optimizer.master_bytes()
        )

    def params(self) -> dict[str, torch.Tensor]:
        module = self.model.module
        module = getattr(module, "module", module)  # inside Float16Module (bf16)
        return dict(module.named_parameters())


def describe(optimizer: Any) -> str:
    """``Chained[Wrapper(TorchOptimizer), ...]``: megatron-core's optimizer tree by class."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return f"{type(optimizer).__name__}[{', '.join(describe(o) for o in chained)}]"
    inner = getattr(optimizer, "optimizer", None)
    return f"{type(optimizer).__name__}({type(inner).__name__})"


def _state_bytes(optimizer: Any) -> int:
    """State bytes of megatron-core's optimizer tree: chained optimizers (the layer-wise one,
    a DistributedOptimizer beside it on the padded path) down to their torch optimizers, with
    the fp32 masters of its bf16 wrappers."""
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return sum(_state_bytes(o) for o in chained)
    masters = sum(
        p.numel() * p.element_size()
        for group in getattr(optimizer, "shard_fp32_from_float16_groups", None)
        or getattr(optimizer, "fp32_from_float16_groups", None)
        or []
        for p in group
    )
    return optimizer_state_bytes(optimizer.optimizer) + masters


def model_config(layers: int, hidden: int, vocab: int) -> ModelConfig:
    """The benchmark GPT: ``layers`` blocks of width ``hidden`` (heads of 64), SwiGLU, RMSNorm,
    RoPE, untied embeddings, no dropout."""
    return ModelConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=max(1, hidden // 64),
        vocab_size=vocab,
        make_vocab_size_divisible_by=1,
    )


def muon_config(lr: float, extra_scale: float, bf16: bool = False) -> OptimizerConfig:
    """megatron-core's ``OptimizerConfig`` both arms are given (module docstring)."""
    config = OptimizerConfig(
        optimizer="muon",
        lr=lr,
        min_lr=0.0,
        weight_decay=WEIGHT_DECAY,
        clip_grad=1.0,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        muon_momentum=0.95,
        muon_nesterov=False,
        muon_split_qkv=False,
        muon_scale_mode="spectral",
        muon_coefficient_type="quintic",
        muon_num_ns_steps=5,
        muon_extra_scale_factor=extra_scale,
        muon_fp32_matmul_prec="highest",
        use_layer_wise_distributed_optimizer=True,
    )
    return config


def build_arms(
    layers: int, hidden: int, vocab: int, seq: int, lr: float, extra_scale: float,
    overlap_grad_reduce: bool, precision: str = "fp32", mcore_layout: str = "legacy",
) -> dict[str, Arm]:  # fmt: skip
    """Both arms from one initialisation (the second model loads the first's weights).

    ``precision``: ``fp32``, or ``bf16`` (megatron-core's ``Float16Module`` around both models;
    fp32 masters in both optimizers: megatron-core's ``Float16OptimizerWithFloat16Params``,
    megatron-ext's masters for what each rank updates). ``mcore_layout``: ``legacy``
    (megatron-core's DDP all-reduces whole gradients, its layer-wise optimizer assigns matrices
    ping-pong by size and all-gathers them unpadded) or ``padded`` (as Megatron-LM's
    ``get_model`` wraps it by default: Megatron-LM's own ``wrap_model_chunks_with_ddp`` with the
    layer-wise parameter layout -- shard-aligned padded buckets, a reduce-scatter, the
    parameter all-gather from DDP's buffer, AdamW on a DistributedOptimizer beside it)."""
    cfg = model_config(layers, hidden, vocab)
    modules = [
        build_gpt_model(cfg, ParallelConfig(), precision, vocab_size=vocab, seq_length=seq)
        for _ in ARMS
    ]
    modules[1].load_state_dict(modules[0].state_dict())
    wrapped = [half_precision_module(m) for m in modules]

    core_ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=overlap_grad_reduce,
        use_distributed_optimizer=False,
    )
    if mcore_layout == "padded":
        from megatron.training.training import wrap_model_chunks_with_ddp

        (core_model,) = wrap_model_chunks_with_ddp(
            [wrapped[0]], modules[0].config, core_ddp, use_layer_wise_distributed_optimizer=True
        )
    else:
        core_model = McDDP(modules[0].config, core_ddp, wrapped[0])
    core_config = muon_config(lr, extra_scale, precision == "bf16")
    core_opt = mc_get_megatron_optimizer(core_config, [core_model])
    wrap_fp32_inner_optimizers(core_opt, core_config)
    if getattr(core_opt, "config", None) is None:
        core_opt.config = core_config  # ChainedOptimizer read it from the raw optimizers

    ext_model = ExtDDP(
        modules[1].config,
        DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False
        ),
        wrapped[1],
    )
    ext_config = muon_config(lr, extra_scale, precision == "bf16")
    ext_config.use_layer_wise_distributed_optimizer = False  # megatron-ext's is layer-wise
    ext_config.match_update_rms = False  # a megatron-ext field, taken by the drop-in
    ext_opt = ext_get_megatron_optimizer(ext_config, [ext_model])
    ext_opt.overlap_param_sync_with_forward(modules[1])
    ext_opt.take_over_grad_sync(ext_model)

    for module, model in zip(modules, (core_model, ext_model), strict=True):
        module.config.finalize_model_grads_func = finalize_model_grads
        module.config.no_sync_func = model.no_sync
    for opt in (core_opt, ext_opt):
        # as Megatron-LM's loop: the scheduler sets each group's LR and weight decay
        # (weight_decay x wd_mult: none on norms and biases); constant here
        OptimizerParamScheduler(
            opt,
            init_lr=lr,
            max_lr=lr,
            min_lr=lr,
            lr_warmup_steps=0,
            lr_decay_steps=1,
            lr_decay_style="constant",
            start_wd=WEIGHT_DECAY,
            end_wd=WEIGHT_DECAY,
            wd_incr_steps=1,
            wd_incr_style="constant",
        )
    return {
        "megatron_core": Arm(
            "megatron_core",
            core_model,
            core_opt,
            f"megatron-core {describe(core_opt)}"
            f"; {precision}, {mcore_layout} layout, overlap_grad_reduce={overlap_grad_reduce}",
        ),
        "megatron_ext": Arm(
            "megatron_ext",
            ext_model,
            ext_opt,
            f"megatron-ext {type(ext_opt).__name__} over "
            f"{type(ext_opt.optimizer).__name__}; reduce-scatter-v to the owners, all-gather "
            f"waited on in the next forward",
        ),
    }


def train_step(arm: Arm, tokens: torch.Tensor, clocks: Any) -> float:
    """One iteration of ``arm`` on ``tokens`` ([batch, seq + 1] int64, this rank's share):
    forward, backward and gradient sync, ``optimizer.step()``, then the wait for any parameter
    all-gather still in flight (megatron-ext's; megatron-core's is synchronous in ``step()``):
    with the arms interleaved, neither's communication may run on into the other's iteration.
    ``clocks.span(name)`` brackets each part. Returns this rank's mean token loss."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position_ids = torch.arange(inputs.shape[1], device=tokens.device).expand_as(inputs)
    with clocks.span("fwd_bwd_sync"):
        arm.model.zero_grad_buffer()
        arm.optimizer.zero_grad()
        loss = arm.model(inputs, position_ids, None, labels=labels).mean()
        loss.backward()
        finalize_model_grads([arm.model])
    with clocks.span("step"):
        success, _, _ = arm.optimizer.step()
    with clocks.span("param_sync_wait"):
        finish = getattr(arm.optimizer, "finish_param_sync", None)
        if finish is not None:
            finish()
    if not success:
        raise RuntimeError(f"{arm.name}: optimizer.step() skipped (non-finite gradients)")
    return float(loss)
