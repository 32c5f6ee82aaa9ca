"""Registry, Lion, parameter routing on real megatron-core names."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_ext.optimizers import (
    KLSoap,
    Lion,
    Muon,
    build_optimizer,
    route_parameter,
)

from .optim_reference import LionReference


def test_registry_builds_every_optimizer() -> None:
    for name, cls in [("adamw", torch.optim.AdamW), ("lion", Lion), ("muon", Muon)]:
        opt = build_optimizer(name, [torch.nn.Parameter(torch.zeros(4, 4))], {"lr": 0.1})
        assert isinstance(opt, cls)
    opt = build_optimizer("kl_soap", [torch.nn.Parameter(torch.zeros(4, 4))])
    assert isinstance(opt, KLSoap)


def test_registry_errors_list_the_valid_choices() -> None:
    p = [torch.nn.Parameter(torch.zeros(4, 4))]
    with pytest.raises(ValueError, match=r"optimizers: adamw, kl_soap, lion, mop, muon$"):
        build_optimizer("shampoo", p)
    with pytest.raises(ValueError, match=r"valid ones are .*num_steps"):
        build_optimizer("muon", p, {"ns_steps": 5})
    with pytest.raises(ValueError, match="polar_express"):
        build_optimizer("muon", p, {"coefficients": "fast"})
    with pytest.raises(ValueError, match="betas"):
        build_optimizer("lion", p, {"betas": (1.5, 0.9)})


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_lion_matches_reference(weight_decay: float) -> None:
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(7, 5, generator=g)
    p = torch.nn.Parameter(w0.clone())
    opt = Lion([p], lr=0.01, weight_decay=weight_decay)
    ref = LionReference(lr=0.01, weight_decay=weight_decay)
    assert opt.param_groups[0]["betas"] == (0.95, 0.98)
    w = w0.double()
    for _ in range(4):
        grad = torch.randn(7, 5, generator=g)
        p.grad = grad.clone()
        opt.step()
        w = ref.step(w, grad)
    torch.testing.assert_close(p.detach().double(), w, rtol=0, atol=1e-6)


# Names and shapes of a real megatron-core 0.19 GPTModel (dense + MoE layers, local spec), built
# on CPU in a subprocess: it needs a 1-rank gloo process group and model-parallel state, which
# must not leak into this test process. GPTModel builds on CPU without any CUDA call.
_BUILD_GPT = textwrap.dedent(
    """
    import json, sys, tempfile, warnings
    warnings.simplefilter("ignore")
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0,
                            world_size=1)
    from megatron.core import parallel_state
    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    out = {}
    for experts in (None, 4):
        cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4,
                                num_query_groups=2, use_cpu_initialization=True,
                                num_moe_experts=experts, moe_router_topk=2 if experts else None,
                                ffn_hidden_size=64)
        model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
            num_experts=experts), vocab_size=64, max_sequence_length=16)
        out[str(experts)] = [(n, list(p.shape)) for n, p in model.named_parameters()]
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def gpt_parameters() -> dict[str, list[tuple[str, list[int]]]]:
    done = subprocess.run(
        [sys.executable, "-c", _BUILD_GPT], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_routing_on_real_gpt_model(gpt_parameters: dict) -> None:
    dense = dict(gpt_parameters["None"])
    moe = dict(gpt_parameters["4"])
    expected_matrix = {
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.mlp.linear_fc1.weight",
        "decoder.layers.1.mlp.linear_fc2.weight",
    }
    expected_adamw = {
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "output_layer.weight",
        "decoder.final_layernorm.weight",
        "decoder.layers.0.input_layernorm.weight",
        "decoder.layers.0.input_layernorm.bias",
        "decoder.layers.1.pre_mlp_layernorm.weight",
    }
    for name in expected_matrix:
        assert route_parameter(name, dense[name]) == "muon", name
    for name in expected_adamw:
        assert route_parameter(name, dense[name]) == "adamw", name
    hidden = ("linear_proj.weight", "linear_qkv.weight", "linear_fc1.weight", "linear_fc2.weight")
    for name, shape in dense.items():  # every tensor is routed; biases and 1-D go to AdamW
        expected = "muon" if len(shape) == 2 and name.endswith(hidden) else "adamw"
        assert route_parameter(name, shape) == expected, name
    experts = [n for n in moe if ".experts." in n and n.endswith(".weight")]
    assert experts and all(
        route_parameter(n, moe[n], matrix_optimizer="kl_soap") == "kl_soap" for n in experts
    )
    router = next(n for n in moe if n.endswith("router.weight"))
    assert route_parameter(router, moe[router]) == "adamw"


def test_routing_rules_and_overrides() -> None:
    # names megatron-core uses with other specs (TE fused norms, TE grouped GEMM, Mamba)
    name = "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight"
    assert route_parameter(name, (32,)) == "adamw"
    assert route_parameter("decoder.layers.0.mlp.experts.linear_fc1.weight0", (64, 32)) == "muon"
    assert route_parameter("decoder.layers.0.mlp.experts.weight1", (4, 32, 64)) == "muon"
    assert route_parameter("decoder.layers.3.mixer.conv1d.weight", (64, 1, 4)) == "adamw"
    assert route_parameter("decoder.layers.3.mixer.in_proj.weight", (128, 32)) == "muon"
    assert route_parameter("decoder.layers.3.mixer.A_log", (8,)) == "adamw"
    assert route_parameter("decoder.layers.0.self_attention.linear_proj.bias", (32,)) == "adamw"
    overrides = [("*.linear_proj.weight", "adamw"), ("output_layer.*", "lion")]
    name = "decoder.layers.0.self_attention.linear_proj.weight"
    assert route_parameter(name, (32, 32), overrides=overrides) == "adamw"
    assert route_parameter("output_layer.weight", (64, 32), overrides=overrides) == "lion"


def test_a_model_chunks_name_routes_as_the_models_own() -> None:
    """With virtual pipeline stages the trainer and the drop-in name chunk v's parameters
    ``chunk<v>.<the model's name>``: they route as the model's names do, overrides (anchored
    globs) and megatron-core's rules included."""
    from megatron_ext.optimizers.routing import chunk_of, route_parameter

    overrides = [("decoder.layers.0.*", "lion")]
    for name, shape in (
        ("decoder.layers.0.mlp.linear_fc1.weight", (64, 32)),
        ("decoder.layers.1.self_attention.linear_qkv.weight", (96, 32)),
        ("embedding.word_embeddings.weight", (256, 32)),
        ("decoder.layers.1.input_layernorm.weight", (32,)),
    ):
        for rules in ("megatron_ext", "megatron_core"):
            own = route_parameter(name, shape, overrides=overrides, rules=rules)
            assert route_parameter(f"chunk3.{name}", shape, overrides=overrides, rules=rules) == own
    assert chunk_of("chunk12.output_layer.weight") == (12, "output_layer.weight")
    assert chunk_of("decoder.chunk1.weight") == (None, "decoder.chunk1.weight")
