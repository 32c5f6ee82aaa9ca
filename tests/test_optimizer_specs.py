"""Optimizer specs: every option reachable from a recipe, one LR for every optimizer (update-RMS
matching), and a new optimizer added by its own code plus one registration."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from megatron_ext.config.load import recipe_from_dict
from megatron_ext.config.optimizer import OptimizerConfig, update_rms_note
from megatron_ext.distributed.allgather_v import AllGatherV, Pending
from megatron_ext.distributed.layerwise import LayerwiseOptimizer
from megatron_ext.errors import ConfigError
from megatron_ext.optimizers.registry import build_optimizer, hyperparameter_names
from megatron_ext.optimizers.spec import (
    Hyperparameter,
    OptimizerSpec,
    register_optimizer,
    registered_optimizers,
)


def _non_default(hp: Hyperparameter) -> object:
    """A valid value other than the default."""
    if hp.options is not None:
        return next(v for v in hp.options if v != hp.default)
    if isinstance(hp.default, bool):
        return not hp.default
    if isinstance(hp.default, int):
        return hp.default + 1
    value = hp.default * 0.5 if hp.default else 0.5
    return value


SPECS = registered_optimizers()
CASES = [(name, hp) for name, s in SPECS.items() for hp in s.hyperparameters]


@pytest.mark.parametrize(("name", "hp"), CASES, ids=[f"{n}.{hp.key}" for n, hp in CASES])
def test_every_option_reaches_the_optimizer_from_the_recipe(name: str, hp: Hyperparameter) -> None:
    """``optimizer.<name>_<key>=value`` in a recipe ends up in the built optimizer's group."""
    spec = SPECS[name]
    field = spec.field_name(hp)
    value = _non_default(hp)
    # a non-spectral scale is only valid without RMS matching
    extra = {"match_update_rms": False} if hp.key == "scale_mode" else {}
    recipe = recipe_from_dict({"optimizer": {"name": name, field: value, **extra}})
    recipe.optimizer.check()
    kwargs = spec.kwargs(recipe.optimizer)
    assert set(kwargs) <= set(hyperparameter_names(name)), "a recipe field the optimizer lacks"
    opt = build_optimizer(name, [torch.nn.Parameter(torch.zeros(6, 4))], kwargs)
    group = opt.param_groups[0]
    if name == "lion" and hp.key in ("beta1", "beta2"):
        assert group["betas"][0 if hp.key == "beta1" else 1] == value
    elif hp.key == "refresh_every":
        assert group["refresh_every"] == value  # 0 would mean "the default"
    elif hp.key == "extra_scale_factor":
        assert group["extra_scale_factor"] == pytest.approx(value * recipe.optimizer.update_rms)
    else:
        assert group[hp.keyword] == value


def test_the_recipe_section_has_one_field_per_option_and_no_other() -> None:
    fields = set(OptimizerConfig().flat())  # as a recipe writes the section
    options = {s.field_name(hp) for s in SPECS.values() for hp in s.hyperparameters}
    shared = {"name", "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps"}
    shared |= {"clip_grad", "tp_mode", "match_update_rms", "update_rms", "matrix_routing"}
    shared |= {"split_qkv", "decoupled_lr", "decoupled_min_lr"}
    shared |= {"loss_scale", "initial_loss_scale", "min_loss_scale", "loss_scale_window"}
    shared |= {"hysteresis"}  # fp16's loss scale, megatron-core's OptimizerConfig names
    assert fields == options | shared


@pytest.mark.parametrize(
    ("old", "new"),
    [("ns_steps", "muon_num_ns_steps"), ("momentum", "mop_momentum or optimizer.muon_momentum")],
)
def test_renamed_options_are_refused_with_the_new_name(old: str, new: str) -> None:
    with pytest.raises(ConfigError, match=f"optimizer.{old} was renamed: use optimizer.{new}"):
        recipe_from_dict({"optimizer": {"name": "muon", old: 3}})


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"name": "mop", "tp_mode": "distributed"}, "supports tp_mode=blockwise or duplicated"),
        ({"name": "muon", "muon_scale_mode": "shape"}, "match_update_rms=false"),
        (
            {
                "name": "kl_soap",
                "kl_soap_inverse_root": "newton_schulz",
                "kl_soap_factor_exponent": 0.3,
            },
            "1/r for an integer r",
        ),
        ({"name": "kl_soap", "kl_soap_shampoo_beta": 1.0}, r"must be < 1"),
        ({"name": "muon", "muon_coefficient_type": "quintik"}, "did you mean 'quintic'"),
        (
            {"name": "kl_soap", "kl_soap_factor_update": "plain"},
            "optimizer.kl_soap_factor_update='plain' is not one of kl, shampoo",
        ),
        (
            {
                "name": "kl_soap",
                "kl_soap_factor_update": "shampoo",
                "kl_soap_inverse_root": "newton_schulz",
            },
            "optimizer.kl_soap_inverse_root='newton_schulz' would be ignored",
        ),
        (
            {"name": "kl_soap", "kl_soap_factor_update": "shampoo", "kl_soap_factor_eps": 1e-10},
            "optimizer.kl_soap_factor_eps=1e-10 would be ignored",
        ),
        (
            {"name": "muon", "muon_rms_match": "beta", "match_update_rms": False},
            "optimizer.muon_rms_match=beta .* optimizer.match_update_rms=false",
        ),
        ({"name": "mop", "mop_rms_match": "adamw"}, "mop_rms_match='adamw' is not one of"),
    ],
)
def test_bad_options_fail_validation(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        recipe_from_dict({"optimizer": section}).optimizer.check()


def test_validation_does_not_import_torch() -> None:
    """The launcher validates recipes without torch: the specs must not pull it in."""
    code = (
        "import sys\n"
        "from megatron_ext.config.load import recipe_from_dict\n"
        "r = recipe_from_dict({'optimizer': {'name': 'kl_soap', 'kl_soap_refresh_mode': 'eigh'}})\n"
        "r.optimizer.check()\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ----------------------------------------------------------------------------- one LR for all
def _update_rms(name: str, match: bool, steps: int = 60, **fields: object) -> float:
    """RMS of W_{t} − W_{t−1} divided by lr, on i.i.d. Gaussian gradients, after ``steps``
    (``fields``: more of the recipe's optimizer section)."""
    section = {"name": name, "lr": 1e-3, "weight_decay": 0.0, "match_update_rms": match}
    cfg = recipe_from_dict({"optimizer": {**section, **fields}}).optimizer
    p = torch.nn.Parameter(torch.zeros(48, 96))
    opt = build_optimizer(name, [p], SPECS[name].kwargs(cfg))
    g = torch.Generator().manual_seed(0)
    rms = 0.0
    for _ in range(steps):
        before = p.detach().clone()
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        rms = ((p.detach() - before).pow(2).mean().sqrt() / cfg.lr).item()
    return rms


def test_update_rms_matching_brings_every_optimizer_to_adamw_rms() -> None:
    """With matching, one LR moves every optimizer's weights at AdamW's update RMS: measured
    AdamW 0.22 (√((1 − β1)/(1 + β1)) = 0.23 on noise), KL-SOAP 0.22, Muon and MOP 0.20,
    Lion 0.20; without it Lion's and Muon's updates have RMS 1, five times AdamW's."""
    adamw = _update_rms("adamw", match=True)
    assert 0.15 < adamw < 0.3
    for name in ("muon", "mop", "lion", "kl_soap"):
        assert _update_rms(name, match=True) == pytest.approx(adamw, rel=0.25), name
    for name in ("muon", "lion"):
        assert _update_rms(name, match=False) == pytest.approx(1.0, rel=0.05), name


def test_update_rms_note_names_the_factor() -> None:
    cfg = recipe_from_dict({"optimizer": {"name": "lion"}}).optimizer
    assert update_rms_note(cfg) == (
        "update-RMS matching on (target 0.2): lion update x 0.2 (RMS-match factor 0.2); "
        "adamw unscaled (its update already has AdamW's RMS)"
    )
    beta = recipe_from_dict({"optimizer": {"name": "muon", "muon_rms_match": "beta"}}).optimizer
    assert update_rms_note(beta) == (
        "update-RMS matching on (target 0.2): muon update x 0.160128 (RMS-match factor 0.1601 = "
        "√((1 − β)/(1 + β)) of its momentum β); adamw unscaled (its update already has AdamW's "
        "RMS)"
    )


@pytest.mark.parametrize("name", ["muon", "mop"])
def test_beta_rms_match_takes_the_factor_from_the_momentum_not_update_rms(name: str) -> None:
    """``<name>_rms_match=beta``: the optimizer gets ``rms_match="beta"`` and the extra scale
    factor unmultiplied (it applies √((1 − β)/(1 + β)) itself, from its momentum), whatever
    ``optimizer.update_rms`` is; ``constant`` multiplies by ``update_rms`` as before."""
    section = {"name": name, f"{name}_momentum": 0.9, f"{name}_extra_scale_factor": 1.5}
    beta = recipe_from_dict(
        {"optimizer": {**section, f"{name}_rms_match": "beta", "update_rms": 0.3}}
    ).optimizer
    beta.check()
    kwargs = SPECS[name].kwargs(beta)
    assert (kwargs["rms_match"], kwargs["extra_scale_factor"]) == ("beta", 1.5)
    assert SPECS[name].update_rms_factor(beta) == pytest.approx((0.1 / 1.9) ** 0.5, rel=1e-12)
    constant = recipe_from_dict({"optimizer": {**section, "update_rms": 0.3}}).optimizer
    kwargs = SPECS[name].kwargs(constant)
    assert kwargs["rms_match"] == "constant"
    assert kwargs["extra_scale_factor"] == pytest.approx(1.5 * 0.3)


def test_beta_rms_match_at_adamws_beta1_gives_adamws_update_rms() -> None:
    """The paper's argument (Sec. 5.2): on noise an EMA with β has RMS √((1 − β)/(1 + β)) of the
    gradient's, which is AdamW's update RMS for β = β1 (0.229 at 0.9). Muon with
    ``muon_rms_match=beta`` and its momentum at AdamW's β1 moves the weights as AdamW does:
    measured Muon 0.229, AdamW 0.225."""
    adamw = _update_rms("adamw", match=True)
    muon = _update_rms("muon", match=True, muon_rms_match="beta", muon_momentum=0.9)
    assert muon == pytest.approx((0.1 / 1.9) ** 0.5, rel=0.05)
    assert muon == pytest.approx(adamw, rel=0.1)


# ----------------------------------------------------------------------------- a new optimizer
class SignSGD(torch.optim.Optimizer):
    """A small matrix-agnostic optimizer defined in this test: ``W ← W − η·sign(G)``."""

    def __init__(self, params: object, *, lr: float = 0.01, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


SIGN_SGD = OptimizerSpec(
    name="test_sign_sgd",
    target=f"{__name__}:SignSGD",
    summary="sign SGD (registered from a test)",
    couples_matrix_entries=False,
    flops=lambda rows, cols, kwargs: 3.0 * rows * cols,
    state_bytes=lambda rows, cols: 0,
)


class LocalGather(AllGatherV):
    """One rank: every segment is already in place."""

    rank = 0  # type: ignore[assignment]
    world = 1  # type: ignore[assignment]

    def _start(self, buffer: torch.Tensor, counts: list[int], offsets: list[int]) -> Pending:
        return Pending(buffer, done=True)


@pytest.fixture
def own_registry_entries(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the test registers is gone after it (the registry is process-wide: another test's
    list of the registered optimizers must not see this one)."""
    from megatron_ext.optimizers.spec import OPTIMIZERS

    OPTIMIZERS.items()  # the shipped entries loaded first
    monkeypatch.setattr(OPTIMIZERS, "_items", dict(OPTIMIZERS._items))
    monkeypatch.setattr(OPTIMIZERS, "_origin", dict(OPTIMIZERS._origin))


@pytest.mark.usefixtures("own_registry_entries")
def test_an_optimizer_registered_from_a_test_trains_through_the_layerwise_optimizer() -> None:
    """Its own class and spec, one :func:`register_optimizer` call: the routing gives it the
    hidden matrices, the ownership plan costs it from its spec, the layer-wise optimizer steps
    it, and the result equals sign SGD done by hand."""
    register_optimizer(SIGN_SGD)
    g = torch.Generator().manual_seed(3)
    shapes = {
        "decoder.layers.0.mlp.linear_fc1.weight": (8, 4),
        "decoder.layers.0.mlp.linear_fc2.weight": (4, 8),
        "decoder.final_layernorm.weight": (4,),
    }
    named = [(n, torch.nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]
    before = {n: p.detach().clone() for n, p in named}
    hp = {"test_sign_sgd": {"lr": 0.1}, "adamw": {"lr": 0.1}}
    opt = LayerwiseOptimizer(named, "test_sign_sgd", LocalGather(), hp)
    assert opt.routes["decoder.layers.0.mlp.linear_fc1.weight"] == "test_sign_sgd"
    assert opt.routes["decoder.final_layernorm.weight"] == "adamw"
    assert opt.plan.compute[0] == 3.0 * 2 * 32  # the two matrices, from its flop model
    grads = {n: torch.randn(p.shape, generator=g) for n, p in named}
    for n, p in named:
        p.grad = grads[n].clone()
    opt.step()
    for name in list(shapes)[:2]:
        expected = before[name] - 0.1 * grads[name].sign()
        assert torch.equal(dict(named)[name].detach(), expected)
