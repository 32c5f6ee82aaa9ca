"""A GPT pretraining script in the style of Megatron-LM 0.19's ``pretrain_gpt.py`` (model
provider, forward step, mock-data provider; written here), running ``megatron.training.pretrain``
once per configuration of a JSON plan, all in this process.

    python -m megatron_ext.megatron.run_pretrain tests/dist/megatron_lm_pretrain.py PLAN OUT
    python tests/dist/megatron_lm_pretrain.py PLAN OUT        # (plain: megatron-ext not installed)

PLAN: ``{"common": [args...], "runs": {"name": [args...], ...}}``; each run parses
``common + args`` with Megatron-LM's parser and trains. With ``--two-line-edit`` among a
run's arguments, the parser gets ``extra_args_provider=megatron_ext_args`` (the documented edit).
OUT (rank 0): ``{"name": {"loss": [...], "grad_norm": [...], "iterations": [...]}}``, the values
Megatron-LM's ``training_log`` receives at each iteration; a run whose name ends in
``_refused`` must stop with megatron-ext's ConfigError (what the runner prints as its one line),
recorded as ``{"error": message}``; it runs last (the global state is left as the error left it).
"""

from __future__ import annotations

import json
import sys
from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
from megatron.core.enums import ModelType
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

import megatron.training.training as mlm_training
from megatron.training import get_args, pretrain
from megatron.training.argument_utils import pretrain_cfg_container_from_args
from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args
from megatron.training.training import destroy_global_state

from megatron_ext.errors import ConfigError
from megatron_ext.megatron.cpu_compat import apply_cpu_compat
from megatron_ext.megatron.cpu_compat_training import apply_training_cpu_compat
from megatron_ext.megatron.run_pretrain import use_built_dataset_helpers

RECORD: dict[str, list[float]] = {}


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, **_):
    """GPTModel with megatron-core's local (non-TE) layer spec; MoE when --num-experts."""
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    spec = get_gpt_layer_local_spec(
        num_experts=args.num_experts, moe_grouped_gemm=False, qk_layernorm=args.qk_layernorm
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent,
        vp_stage=vp_stage,
    )


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Token-summed loss, token count, and the report Megatron-LM averages over DP ranks."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    return (
        loss,
        num_tokens,
        {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])},
    )


def forward_step(data_iterator, model: GPTModel):
    batch = next(data_iterator)
    tokens, labels = batch["tokens"], batch["labels"]
    output = model(tokens, batch["position_ids"], batch.get("attention_mask"), labels=labels)
    return output, partial(loss_func, batch["loss_mask"])


def train_valid_test_datasets_provider(num_samples, vp_stage=None):
    """Mock GPT data on every rank (``vp_stage``: the model chunk asking, with virtual pipeline
    stages, as Megatron-LM's ``pretrain_gpt.py`` takes it; every chunk reads the same data)."""
    args = get_args()
    config = GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=None,
        split=args.split,
        tokenizer=build_tokenizer(args),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        mid_level_dataset_surplus=0.005,
    )
    return BlendedMegatronDatasetBuilder(MockGPTDataset, num_samples, lambda: True, config).build()


train_valid_test_datasets_provider.is_distributed = True


def recording_log(original):
    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *a, **kw):
        RECORD["iterations"].append(int(iteration))
        if "lm loss" in loss_dict:  # the last pipeline stage's ranks have the loss
            RECORD["loss"].append(float(loss_dict["lm loss"]))
        RECORD["grad_norm"].append(float(a[2]))  # report_memory_flag, skipped_iter, grad_norm
        return original(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, *a, **kw)

    return training_log


def run(argv: list[str], refused: bool = False) -> dict[str, list[float]]:
    extra = None
    if "--two-line-edit" in argv:
        from megatron_ext.megatron.megatron_lm import megatron_ext_args

        extra = megatron_ext_args
        argv = [a for a in argv if a != "--two-line-edit"]
    RECORD.clear()
    RECORD.update(iterations=[], loss=[], grad_norm=[])
    sys.argv = [sys.argv[0], *argv]
    args = parse_and_validate_args(extra_args_provider=extra)
    try:
        pretrain(
            pretrain_cfg_container_from_args(args),
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            model_provider=model_provider,
        )
    except SystemExit as stop:  # --exit-interval: Megatron-LM saves, then sys.exit(0)
        if stop.code not in (0, None):
            raise
    except ConfigError as err:
        if not refused:
            raise
        return {"error": str(err)}
    if refused:
        raise AssertionError("the run was expected to be refused")
    # with pipeline stages only the last stage's ranks saw the loss: every rank gets theirs
    records: list[dict] = [{}] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(records, dict(RECORD))
    destroy_global_state()  # the next run parses and initialises afresh
    return next((r for r in records if r["loss"]), records[0])


def main() -> None:
    plan_path, out_path = sys.argv[1], sys.argv[2]
    with open(plan_path, encoding="utf-8") as f:
        plan = json.load(f)
    # on this CPU host: the compatibility modules and the wheel's built dataset helpers (what
    # the runner applies too); Megatron-LM's parser and get_megatron_optimizer stay untouched
    apply_cpu_compat()
    apply_training_cpu_compat()
    use_built_dataset_helpers()
    mlm_training.training_log = recording_log(mlm_training.training_log)
    results = {
        name: run(plan["common"] + args, refused=name.endswith("_refused"))
        for name, args in plan["runs"].items()
    }
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(results, f)
    parallel_state.destroy_model_parallel()


if __name__ == "__main__":
    main()
