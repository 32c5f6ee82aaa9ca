"""Activation bytes of one micro-batch: measured on CPU, ``megatron-ext plan``'s count, and
Megatron-LM's ``theoretical_memory_usage`` formulas, at two MLP widths.

Run (one gloo rank; the GPT trainer's own setup and forward, synthetic tokens)::

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node 1 \\
        scripts/activations_vs_megatron_lm.py

For each MLP width of :data:`FFN` (the rest fixed: a bf16 Llama-style GPT, local spec, TP 1,
no recomputation, one sequence of :data:`SEQ` tokens): the bytes autograd saves in the forward
(``tests/dist/planner_measure.saved_bytes``: saved-tensor hooks, each storage once, weights
excluded), the plan's ``stage_activations``, and Megatron-LM's two formulas on Megatron-LM's
own parsed arguments for the same model: ``compute_activation_memory_without_sp`` (what
``report_theoretical_memory`` uses here: no sequence parallelism) and
``compute_activation_memory`` (its sequence-parallel, selective-recompute formula, the one with
an MLP-width term). Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

#: the MLP widths compared (4x apart), at hidden size HIDDEN
FFN = (512, 2048)
HIDDEN, HEADS, LAYERS, SEQ, VOCAB = 256, 4, 2, 512, 1024


def overrides(ffn: int) -> list[str]:
    return [
        "training.eval_iters=0",
        "checkpoint.save_interval=0",
        "model.transformer_impl=local",
        f"model.num_layers={LAYERS}",
        f"model.hidden_size={HIDDEN}",
        f"model.num_attention_heads={HEADS}",
        f"model.num_query_groups={HEADS}",
        f"model.ffn_hidden_size={ffn}",
        f"model.vocab_size={VOCAB}",
        f"training.seq_length={SEQ}",
        "training.micro_batch_size=1",
        "training.global_batch_size=1",
        "training.precision=bf16",
    ]


def megatron_lm(ffn: int) -> dict[str, float]:
    """Megatron-LM's activation formulas (bytes) for the same model."""
    from megatron.core.tokenizers.utils.build_tokenizer import vocab_size_with_padding
    from megatron.training import arguments
    from megatron.training import theoretical_memory_usage as tmu

    flags = (
        f"--num-layers {LAYERS} --hidden-size {HIDDEN} --num-attention-heads {HEADS} "
        f"--ffn-hidden-size {ffn} --seq-length {SEQ} --max-position-embeddings {SEQ} "
        "--micro-batch-size 1 --global-batch-size 1 --bf16 --swiglu --normalization RMSNorm "
        "--position-embedding-type rope --disable-bias-linear "
        "--untie-embeddings-and-output-weights --train-iters 1 --lr 1e-4 --mock-data "
        f"--tokenizer-type NullTokenizer --vocab-size {VOCAB}"
    ).split()
    with mock.patch.object(sys, "argv", ["pretrain_gpt.py", *flags]):
        args = arguments.parse_args()
        arguments.validate_args(args)
    args.padded_vocab_size = vocab_size_with_padding(VOCAB, args, logging_enabled=False)
    return {
        "without_sp": tmu.compute_activation_memory_without_sp(args, num_microbatches=1),
        "sp_selective": tmu.compute_activation_memory(args, num_microbatches=1),
    }


def main() -> None:
    import torch
    import torch.distributed as dist

    from megatron_ext.config.load import load_recipe
    from megatron_ext.planner.inputs import plan_vocab_size, run_layout
    from megatron_ext.planner.stage import stage_activations
    from tests.dist.ending import leave
    from tests.dist.planner_measure import model_parallel_groups, saved_bytes, trainer_run

    torch.set_num_threads(2)
    out = {}
    for ffn in FFN:
        recipe = load_recipe("tiny_cpu_gpt", overrides(ffn), world_size=1)
        planned, _ = stage_activations(recipe, run_layout(recipe, 1), 0, plan_vocab_size(recipe))
        with model_parallel_groups():
            run = trainer_run("tiny_cpu_gpt", overrides(ffn))
            measured = saved_bytes(run, "none", backward=False)["kept"]
            del run
        out[f"ffn_{ffn}"] = {"measured": measured, "plan": planned, **megatron_lm(ffn)}
    if dist.get_rank() == 0:
        print(json.dumps({"hidden": HIDDEN, "seq": SEQ, "layers": LAYERS, **out}, indent=1))
    leave()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())  # tests.dist.* from the repository root
    main()
