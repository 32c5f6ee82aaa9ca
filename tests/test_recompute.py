"""``parallel.recompute_granularity``: megatron-core's activation recomputation, on this CPU host.

Recomputing must not change the numbers: the loss and every gradient equal the run without it,
with dropout on (the recomputed forward must replay the same dropout masks, which needs the
RNG state saved and restored through the CPU compat layer), and the config fields reach
megatron-core's ``TransformerConfig``.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.gpt.sections import ModelConfig, ParallelConfig

VOCAB, SEQ = 64, 16
MODEL = ModelConfig(
    num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.1, attention_dropout=0.1
)


def loss_and_grads(
    parallel: ParallelConfig, state: dict | None, seed: int = 7
) -> tuple[float, torch.Tensor, dict]:
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.megatron.model import build_gpt_model

    init_single_process()
    gpt = build_gpt_model(MODEL, parallel, "fp32", VOCAB, SEQ)
    if state is not None:
        gpt.load_state_dict(state)
    state = {k: v.clone() for k, v in gpt.state_dict().items() if v is not None}
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=generator)
    position = torch.arange(SEQ).expand(2, SEQ)
    torch.manual_seed(seed)  # the dropout masks (megatron-core's RNG tracker forks)
    model_parallel_cuda_manual_seed(seed)
    gpt.train()
    loss = gpt(tokens, position, None, labels=tokens).mean()
    loss.backward()
    grads = torch.cat([p.grad.reshape(-1) for p in gpt.parameters()])
    return loss.item(), grads, state


#: each form megatron-core has (Megatron-LM's --recompute-granularity/-modules/-method/-num-layers)
FORMS = {
    "selective": ParallelConfig(recompute_granularity="selective"),
    "selective-mlp": ParallelConfig(
        recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]
    ),
    "full": ParallelConfig(recompute_granularity="full"),
    "full-uniform-2": ParallelConfig(recompute_granularity="full", recompute_num_layers=2),
    "full-block-1": ParallelConfig(recompute_granularity="full", recompute_method="block"),
}


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("form", list(FORMS))
def test_recomputation_changes_no_number(form: str) -> None:
    loss, grads, state = loss_and_grads(ParallelConfig(), None)
    again, again_grads, _ = loss_and_grads(FORMS[form], state)
    assert again == loss
    torch.testing.assert_close(again_grads, grads, rtol=0, atol=0)
    # the dropout is live: a run with other masks differs (the comparison can fail)
    other = loss_and_grads(ParallelConfig(), state, seed=8)[1]
    assert not torch.equal(other, grads)


def test_fields_reach_megatron_core() -> None:
    from megatron_ext.megatron.model import transformer_config

    none = transformer_config(MODEL, ParallelConfig(), "fp32")
    selective = transformer_config(MODEL, ParallelConfig(recompute_granularity="selective"), "fp32")
    full = transformer_config(MODEL, ParallelConfig(recompute_granularity="full"), "fp32")
    assert none.recompute_granularity is None
    assert (selective.recompute_granularity, selective.recompute_modules) == (
        "selective",
        ["core_attn"],
    )
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == (
        "full",
        "uniform",
        1,
    )
    modules = transformer_config(MODEL, FORMS["selective-mlp"], "fp32")
    assert modules.recompute_modules == ["core_attn", "mlp"]
    block = transformer_config(MODEL, FORMS["full-block-1"], "fp32")
    assert (block.recompute_method, block.recompute_num_layers) == ("block", 1)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"recompute_modules": ["mlp"]}, "read with parallel.recompute_granularity=selective"),
        ({"recompute_method": "block"}, "read with parallel.recompute_granularity=full"),
        (
            {"recompute_granularity": "selective", "recompute_num_layers": 2},
            "recompute_num_layers=2 is read with parallel.recompute_granularity=full",
        ),
        ({"recompute_granularity": "selective", "recompute_modules": []}, "is empty"),
    ],
)
def test_a_field_another_granularity_reads_is_refused(fields: dict, message: str) -> None:
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        ParallelConfig(**fields)


def test_norm_recomputation_without_transformer_engine_is_refused_with_the_reason() -> None:
    """megatron-core 0.19 recomputes norms through Transformer Engine's FP8 state: without TE
    its first forward stops on a NameError, so the build says why instead."""
    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.errors import ConfigError
    from megatron_ext.megatron.model import build_gpt_model, have_transformer_engine

    if have_transformer_engine():
        pytest.skip("Transformer Engine is installed: megatron-core recomputes norms itself")
    init_single_process()
    norms = ParallelConfig(recompute_granularity="selective", recompute_modules=["layernorm"])
    with pytest.raises(ConfigError, match="layernorm needs Transformer Engine"):
        build_gpt_model(MODEL, norms, "fp32", VOCAB, SEQ)
