"""megatron-ext's drop-in ``get_megatron_optimizer`` (megatron_ext.megatron.drop_in): the same
signature as the installed megatron-core's, megatron-core's own optimizer for adam/sgd, the
mapping of megatron-core's ``OptimizerConfig`` onto megatron-ext's optimizer section, the
clear refusals, and a Megatron-LM-style loop (megatron-core DDP, schedule and LR scheduler)
through it that reproduces the GPT trainer's run."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from megatron.core import optimizer as mc_optimizer
from megatron.core.optimizer import OptimizerConfig, get_standard_config_overrides

from megatron_ext.errors import ConfigError
from megatron_ext.megatron import drop_in
from tests.conftest import DIST, run_torchrun
from tests.test_training import TEXT, _losses, _metric, _train


def _flat(config: OptimizerConfig) -> SimpleNamespace:
    """The drop-in's optimizer section with its keys as a recipe writes them (flat options)."""
    return SimpleNamespace(**drop_in.extension_config(config).flat())


def test_signature_is_megatron_cores() -> None:
    ours = inspect.signature(drop_in.get_megatron_optimizer).parameters
    theirs = inspect.signature(mc_optimizer.get_megatron_optimizer).parameters
    assert [(p.name, p.kind, p.default) for p in ours.values()] == [
        (p.name, p.kind, p.default) for p in theirs.values()
    ]


@pytest.mark.parametrize("name", ["adam", "sgd"])
def test_adam_and_sgd_get_megatron_cores_optimizer(monkeypatch, name: str) -> None:
    calls = []

    def megatron_core(*args, **kwargs):
        calls.append((args, kwargs))
        return "megatron-core's optimizer"

    monkeypatch.setattr(drop_in, "mc_get_megatron_optimizer", megatron_core)
    config, chunks, overrides = OptimizerConfig(optimizer=name), ["chunk"], {"k": "v"}
    got = drop_in.get_megatron_optimizer(
        config, chunks, overrides, False, None, dump_param_to_param_group_map="map.json"
    )
    assert got == "megatron-core's optimizer"
    assert calls == [
        (
            (config, chunks),
            {
                "config_overrides": overrides,
                "use_gloo_process_groups": False,
                "pg_collection": None,
                "dump_param_to_param_group_map": "map.json",
            },
        )
    ]


def test_megatron_cores_fields_map_onto_the_optimizer_section() -> None:
    muon = _flat(
        OptimizerConfig(
            optimizer="muon",
            lr=2e-3,
            min_lr=2e-4,
            weight_decay=0.05,
            clip_grad=0.5,
            muon_momentum=0.9,
            muon_nesterov=True,
            muon_scale_mode="spectral",
            muon_coefficient_type="simple",  # Emerging-Optimizers' name of Jordan's quintic
            muon_num_ns_steps=4,
            muon_extra_scale_factor=1.5,
            muon_tp_mode="distributed",
        )
    )
    assert (muon.name, muon.lr, muon.min_lr, muon.weight_decay, muon.clip_grad) == (
        "muon",
        2e-3,
        2e-4,
        0.05,
        0.5,
    )
    assert (muon.muon_momentum, muon.muon_nesterov, muon.muon_coefficient_type) == (
        0.9,
        True,
        "quintic",
    )
    assert (muon.muon_num_ns_steps, muon.muon_extra_scale_factor, muon.tp_mode) == (
        4,
        1.5,
        "distributed",
    )
    mop = OptimizerConfig(optimizer="mop", lr=1e-3, muon_momentum=0.8, muon_tp_mode="duplicated")
    mop.mop_precision = "fp64"  # an extra field: megatron-ext's name, taken as is
    ext = _flat(mop)
    assert (ext.mop_momentum, ext.mop_precision, ext.tp_mode) == (0.8, "fp64", "duplicated")
    soap = OptimizerConfig(optimizer="kl_soap", lr=1e-3, soap_shampoo_beta=0.9)
    soap.soap_precondition_frequency = 10
    soap.kl_soap_factor_eps, soap.update_rms = 1e-10, 0.25
    ext = _flat(soap)
    assert (ext.kl_soap_shampoo_beta, ext.kl_soap_refresh_every) == (0.9, 10)
    assert (ext.kl_soap_factor_eps, ext.update_rms) == (1e-10, 0.25)
    lion = _flat(OptimizerConfig(optimizer="lion", lr=1e-3, lion_beta1=0.9))
    assert (lion.lion_beta1, lion.lion_beta2) == (0.9, 0.98)


@pytest.mark.parametrize(
    ("fields", "extra", "match"),
    [
        ({"muon_coefficient_type": "aol"}, {}, r"muon_coefficient_type='aol' has no"),
        ({"muon_coefficient_type": "simple", "muon_scale_mode": "spectral"}, {"typo": 1}, "typo"),
        ({"muon_coefficient_type": "simple", "muon_scalar_optimizer": "lion"}, {}, "AdamW"),
        ({"muon_coefficient_type": "simple"}, {"muon_ns_method": "newton"}, "muon_ns_method"),
    ],
)
def test_bad_muon_configs_are_one_config_error(fields: dict, extra: dict, match: str) -> None:
    config = OptimizerConfig(optimizer="muon", lr=1e-3, **fields)
    for key, value in extra.items():
        setattr(config, key, value)
    with pytest.raises(ConfigError, match=match):
        _flat(config)


def test_megatron_cores_defaults_and_names_mean_what_the_converter_says() -> None:
    """One table for the drop-in and the converter: megatron-core's default Muon config (its
    'quintic' coefficients, TP mode blockwise) is megatron-ext's quintic_schedule and blockwise,
    as a converted script's recipe is; Megatron-LM's 'soap' (KL-Shampoo by default) is KL-SOAP."""
    from megatron_ext.config.load import recipe_from_dict
    from megatron_ext.megatron.from_megatron import convert
    from megatron_ext.megatron.megatron_args import read_megatron_args

    ext = _flat(OptimizerConfig(optimizer="muon", lr=1e-3))
    script = (
        "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
        "--max-position-embeddings 128 "
        "--micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 1e-3 --data-path d "
    )
    converted = recipe_from_dict(convert(read_megatron_args(script + "--optimizer muon")).recipe)
    same = ("muon_coefficient_type", "tp_mode", "muon_num_ns_steps", "muon_scale_mode")
    assert {k: getattr(ext, k) for k in same} == {k: converted.optimizer.flat()[k] for k in same}
    assert (ext.muon_coefficient_type, ext.tp_mode) == ("quintic_schedule", "blockwise")
    soap = _flat(OptimizerConfig(optimizer="soap", lr=1e-3))
    assert soap.name == "kl_soap" == drop_in.extension_name("soap")
    assert drop_in.extension_name("adam") is None  # megatron-core's own Adam


@pytest.mark.parametrize("optimizer", ["soap", "kl_soap"])
def test_soap_use_kl_shampoo_selects_the_factor_update(optimizer: str) -> None:
    """megatron-core's ``soap_use_kl_shampoo`` (default True) is ``kl_soap_factor_update``:
    True -> ``kl`` (KL-Shampoo factors), False -> ``shampoo`` (SOAP's plain ``G Gᵀ``)."""
    for use_kl, factor_update in ((True, "kl"), (False, "shampoo")):
        config = OptimizerConfig(optimizer=optimizer, lr=1e-3, soap_use_kl_shampoo=use_kl)
        assert _flat(config).kl_soap_factor_update == factor_update
    default = _flat(OptimizerConfig(optimizer=optimizer, lr=1e-3))
    assert default.kl_soap_factor_update == "kl"


def test_what_the_layerwise_optimizer_cannot_take_is_refused() -> None:
    muon = OptimizerConfig(optimizer="muon")
    sharded = SimpleNamespace(ddp_config=SimpleNamespace(use_distributed_optimizer=True))
    with pytest.raises(ConfigError, match="use_distributed_optimizer=False"):
        drop_in._check_supported(muon, [sharded], None, None)
    with pytest.raises(ConfigError, match="pg_collection=None"):
        drop_in._check_supported(muon, [], None, object())
    drop_in._check_supported(muon, [], get_standard_config_overrides(muon), None)
    with pytest.raises(ConfigError, match="standard config_overrides"):
        drop_in._check_supported(muon, [], {}, None)
    with pytest.raises(ConfigError, match="fp16"):
        drop_in._check_supported(OptimizerConfig(optimizer="muon", fp16=True), [], None, None)


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("drop_in")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    recipe = {
        "trainer": "gpt",
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
        "optimizer": {"name": "muon", "lr": 3e-3, "min_lr": 3e-4},
        "data": {"path": str(root / "data" / "corpus"), "source": [str(root / "corpus.txt")]},
        "training": {
            "steps": 6,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "seq_length": 32,
            "lr_warmup_steps": 2,
            "lr_decay_style": "WSD",
            "lr_wsd_decay_steps": 2,
        },
        "logging": {"log_interval": 1, "tensorboard": False, "progress_bar": "off"},
        "checkpoint": {"save_interval": 0, "save_at_end": False},
        "launch": {"nproc_per_node_cpu": 2, "threads_per_rank": 1},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def test_a_megatron_lm_loop_through_the_drop_in_matches_the_gpt_trainer(
    recipe_file, tmp_path
) -> None:
    """Same model, data and schedule: the Megatron-LM-style loop (megatron-core's DDP
    all-reduce, its LR scheduler in samples) and the GPT trainer (reduce-scatter to the owners,
    LR on tokens) give the same losses and gradient norms at DP=2 (megatron-core's scheduler
    multiplies before dividing in the warmup: 1 ulp apart at most)."""
    out = tmp_path / "drop_in.json"
    run_torchrun(DIST / "megatron_drop_in.py", 2, str(recipe_file), str(out))
    theirs = json.loads(out.read_text())
    assert theirs["optimizer"] == "MegatronExtOptimizer"
    _train(recipe_file, tmp_path / "trainer")
    ours = _losses(tmp_path / "trainer")
    assert ours[-1] < ours[0] - 0.5, ours
    for a, b in zip(theirs["losses"], ours, strict=True):
        assert a == pytest.approx(b, rel=1e-5), (theirs["losses"], ours)
    for a, b in zip(theirs["grad_norms"], _metric(tmp_path / "trainer", "grad_norm"), strict=True):
        assert a == pytest.approx(b, rel=1e-4)
    for a, b in zip(theirs["lrs"], _metric(tmp_path / "trainer", "lr"), strict=True):
        assert a == pytest.approx(b, rel=1e-12, abs=0.0)


def test_megatron_core_defaults_under_the_drop_in() -> None:
    """Megatron-LM's meaning: megatron-core's routing, its raw update scale, split QKV, plain
    Newton–Schulz in bf16 under its default ``muon_fp32_matmul_prec='medium'`` (fp32 under
    ``high``); an extra attribute asks for megatron-ext's meaning instead."""
    ext = _flat(OptimizerConfig(optimizer="muon", lr=1e-3))
    assert (ext.matrix_routing, ext.match_update_rms, ext.split_qkv) == (
        "megatron_core",
        False,
        True,
    )
    assert (ext.muon_ns_method, ext.muon_ns_precision, ext.muon_fp32_matmul_prec) == (
        "plain",
        "bf16",
        "medium",
    )
    high = OptimizerConfig(optimizer="muon", lr=1e-3, muon_fp32_matmul_prec="high")
    high.match_update_rms, high.matrix_routing = True, "megatron_ext"
    ext = _flat(high)
    assert (ext.muon_ns_precision, ext.match_update_rms, ext.matrix_routing) == (
        "fp32",
        True,
        "megatron_ext",
    )
    with pytest.raises(ConfigError, match="muon_fp32_matmul_prec"):  # Megatron-LM allows 'low'
        _flat(OptimizerConfig(optimizer="muon", lr=1e-3, muon_fp32_matmul_prec="low"))


@pytest.mark.usefixtures("one_torch_thread")
def test_muon_steps_equal_megatron_cores_muon_bit_for_bit() -> None:
    """megatron-core's TensorParallelMuon (Emerging-Optimizers) and megatron-ext's Muon built
    from the drop-in's section for the same megatron-core config (defaults: bf16 Newton–Schulz,
    split QKV, spectral scale, decoupled weight decay): six steps, identical parameters."""
    import torch
    from megatron.core.optimizer.emerging_optimizers import TensorParallelMuon

    from megatron_ext.optimizers.muon import Muon
    from megatron_ext.optimizers.qkv import QKVLayout, qkv_weight_decay_groups
    from megatron_ext.optimizers.spec import recipe_hyperparameters

    config = OptimizerConfig(optimizer="muon", lr=2e-3, weight_decay=0.1, muon_momentum=0.9)
    kwargs = recipe_hyperparameters(drop_in.extension_config(config))["muon"]
    heads, groups, kv = 4, 2, 16  # GQA: Q 64 rows, K 32, V 32 in each fused weight
    names = ["linear_proj.weight", "linear_qkv.weight", "linear_fc1.weight", "position.weight"]
    shapes = [(64, 64), (groups * (heads // groups + 2) * kv, 64), (256, 64), (32, 64)]
    torch.manual_seed(0)
    theirs = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    theirs[1].is_qkv = True
    reference = TensorParallelMuon(
        theirs,
        lr=config.lr,
        momentum=config.muon_momentum,
        weight_decay=config.weight_decay,
        nesterov=config.muon_nesterov,
        split_qkv=True,
        is_qkv_fn=lambda p: getattr(p, "is_qkv", False),
        qkv_split_shapes=[heads // groups * kv, kv, kv],
        fp32_matmul_prec=config.muon_fp32_matmul_prec,
        coefficient_type=config.muon_coefficient_type,
        tp_mode="blockwise",
    )
    layout = QKVLayout.from_heads(heads, groups, kv)
    muon = Muon(qkv_weight_decay_groups(list(zip(names, ours, strict=True)), layout), **kwargs)
    for step in range(6):
        for a, b in zip(theirs, ours, strict=True):
            a.grad = torch.randn(a.shape)
            b.grad = a.grad.clone()
        reference.step()
        muon.step()
        for name, a, b in zip(names, theirs, ours, strict=True):
            assert torch.equal(a, b), f"step {step}: {name} differs"
