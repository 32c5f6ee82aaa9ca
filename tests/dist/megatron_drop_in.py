"""A Megatron-LM-style training loop with megatron-ext's drop-in ``get_megatron_optimizer``.

As ``pretrain_gpt.py`` does it: megatron-core's GPTModel (megatron-ext's builder, the same
layer spec as the GPT trainer), megatron-core's own ``DistributedDataParallel`` (not
megatron-ext's) and ``finalize_model_grads``, megatron-core's forward/backward schedule, the
optimizer from ``megatron_ext.megatron.drop_in.get_megatron_optimizer`` given megatron-core's
``OptimizerConfig(optimizer="muon", ...)``, and megatron-core's ``OptimizerParamScheduler``
counting samples (Megatron-LM's ``train_iters`` setup). The data order is the GPT trainer's.

Usage (torchrun): megatron_drop_in.py RECIPE OUT_JSON [key=value ...]; writes the per-step
losses, grad norms and learning rates on rank 0.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_ext.config import load_recipe
from megatron_ext.data import build_gpt_datasets, build_tokenizer
from megatron_ext.gpt.setup import ensure_dataset
from megatron_ext.megatron.drop_in import get_megatron_optimizer
from megatron_ext.megatron.model import build_gpt_model
from megatron_ext.megatron.parallel import init_distributed
from megatron_ext.optimizers.muon_spec import MuonOptions
from tests.dist.ending import leave


def forward_step(data_iterator, model):
    """pretrain_gpt.py's shape: per-token losses and a masked mean."""
    batch = next(data_iterator)
    losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()

    def loss_func(output):
        loss = (output.float() * mask).sum() / mask.sum().clamp(min=1.0)
        return loss, {"lm loss": loss.detach().clone()}

    return losses, loss_func


def main() -> None:
    recipe_path, out_path, *overrides = sys.argv[1:]
    recipe = load_recipe(recipe_path, overrides, world_size=int(os.environ["WORLD_SIZE"]))
    t, o = recipe.training, recipe.optimizer
    env = init_distributed(recipe.parallel, recipe.seed, recipe.launch.master_port)
    dp, dp_rank = (
        parallel_state.get_data_parallel_world_size(),
        parallel_state.get_data_parallel_rank(),
    )
    tokenizer = build_tokenizer(recipe.data.tokenizer, recipe.data.tokenizer_model)
    ensure_dataset(recipe, tokenizer, env)
    train, _, _ = build_gpt_datasets(
        recipe.data.path,
        tokenizer,
        seq_length=t.seq_length,
        split=recipe.data.split,
        seed=recipe.seed,
        num_samples=(t.steps * t.global_batch_size, None, None),
    )
    module = build_gpt_model(
        recipe.model,
        recipe.parallel,
        t.precision,
        vocab_size=tokenizer.vocab_size,
        seq_length=t.seq_length,
    )
    config = module.config
    model = DistributedDataParallel(
        config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        module,
    )
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = model.no_sync
    opt_config = OptimizerConfig(
        optimizer="muon",
        lr=o.lr,
        min_lr=o.min_lr,
        weight_decay=o.weight_decay,
        adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2,
        adam_eps=o.adam_eps,
        clip_grad=o.clip_grad,
        muon_momentum=o.of(MuonOptions).momentum,
        muon_coefficient_type="polar_express",
        muon_tp_mode=o.tp_mode,
        muon_split_qkv=o.split_qkv,
        muon_fp32_matmul_prec="high",  # fp32 Newton–Schulz ("medium" is bf16)
    )
    # the GPT trainer's recipe meaning, asked for by name (the drop-in's defaults are
    # megatron-core's: its routing, raw update scale, plain Newton–Schulz)
    opt_config.match_update_rms = o.match_update_rms
    opt_config.matrix_routing = o.matrix_routing
    opt_config.muon_ns_method = o.of(MuonOptions).ns_method
    optimizer = get_megatron_optimizer(opt_config, [model])
    gbs = t.global_batch_size
    scheduler = OptimizerParamScheduler(  # Megatron-LM: positions in samples, += gbs per step
        optimizer,
        init_lr=0.0,
        max_lr=o.lr,
        min_lr=o.min_lr,
        lr_warmup_steps=t.lr_warmup_steps * gbs,
        lr_decay_steps=(t.lr_decay_steps or t.steps) * gbs,
        lr_decay_style=t.lr_decay_style,
        start_wd=o.weight_decay,
        end_wd=o.weight_decay,
        wd_incr_steps=t.steps * gbs,
        wd_incr_style="constant",
        wsd_decay_steps=t.lr_wsd_decay_steps * gbs if t.lr_wsd_decay_steps else None,
        lr_wsd_decay_style=t.lr_wsd_decay_style,
    )
    per_rank, micro = gbs // dp, t.micro_batch_size
    losses, norms, lrs = [], [], []
    for step in range(t.steps):
        first = step * gbs + dp_rank * per_rank

        def batches(first: int = first):
            for m in range(per_rank // micro):
                samples = [train[first + m * micro + i] for i in range(micro)]
                yield {
                    k: torch.stack([torch.as_tensor(s[k]) for s in samples])
                    for k in ("tokens", "labels", "loss_mask", "position_ids")
                }

        model.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=batches(),
            model=[model],
            num_microbatches=per_rank // micro,
            seq_length=t.seq_length,
            micro_batch_size=micro,
            forward_only=False,
        )
        lrs.append(optimizer.param_groups[0]["lr"])
        _, grad_norm, _ = optimizer.step()
        scheduler.step(increment=gbs)
        loss = torch.tensor(
            [sum(float(x["lm loss"]) for x in outputs) / len(outputs)], dtype=torch.float64
        )
        dist.all_reduce(loss, group=parallel_state.get_data_parallel_group())
        losses.append(float(loss) / dp)
        norms.append(float(grad_norm))
    if env.rank == 0:
        with open(out_path, "w") as f:
            json.dump(
                {
                    "losses": losses,
                    "grad_norms": norms,
                    "lrs": lrs,
                    "optimizer": type(optimizer).__name__,
                },
                f,
            )
    leave()


if __name__ == "__main__":
    main()
