"""megatron-ext's MegatronOptimizer adapter, single process (no process groups needed).

Reference: torch's AdamW stepping fp32 copies of the parameters with the same gradients, and
``torch.nn.utils.clip_grad_norm_`` for the clipping.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.megatron.optimizer import MegatronExtOptimizer
from megatron_ext.megatron.optimizer_factories import adamw_factory, megatron_optimizer_config

CFG = OptimizerConfig(lr=1e-2, weight_decay=0.1, clip_grad=1.0)


def _model(dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4, bias=False)
    )
    return model.to(dtype)


def _adapter(model: torch.nn.Module, bf16: bool, cfg: OptimizerConfig = CFG):
    return MegatronExtOptimizer(
        list(model.named_parameters()), adamw_factory(cfg), megatron_optimizer_config(cfg, bf16)
    )


def _set_main_grads(model: torch.nn.Module, step: int, scale: float = 1.0) -> list[torch.Tensor]:
    """Deterministic fp32 gradients, stored where megatron-core's DDP puts them (main_grad)."""
    gen = torch.Generator().manual_seed(100 + step)
    grads = []
    for p in model.parameters():
        g = torch.randn(p.shape, generator=gen) * scale
        p.main_grad = g.clone()
        grads.append(g)
    return grads


def test_bf16_params_keep_fp32_masters_and_match_adamw():
    model = _model(torch.bfloat16)
    ref_params = [p.detach().float().clone().requires_grad_(True) for p in model.parameters()]
    names = [n for n, _ in model.named_parameters()]
    # megatron-core's convention, written out: decay on matrices, none on biases and norms.
    named = list(zip(names, ref_params, strict=True))
    ref_groups = [
        {"params": [p for n, p in named if p.ndim >= 2 and not n.endswith("bias")]},
        {"params": [p for n, p in named if p.ndim < 2 or n.endswith("bias")], "weight_decay": 0.0},
    ]
    ref = torch.optim.AdamW(
        ref_groups,
        lr=CFG.lr,
        betas=(CFG.adam_beta1, CFG.adam_beta2),
        eps=CFG.adam_eps,
        weight_decay=CFG.weight_decay,
        foreach=True,
    )
    opt = _adapter(model, bf16=True)
    assert all(m.dtype == torch.float32 for m in opt.master_params)
    for step in range(5):
        grads = _set_main_grads(model, step, scale=0.05)  # small: below the clip threshold
        ok, norm, _ = opt.step()
        assert ok
        assert norm == pytest.approx(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)), rel=1e-6)
        for p, g in zip(ref_params, grads, strict=True):
            p.grad = g
        ref.step()
    # Same fp32 arithmetic on the masters (one rank's range: here the whole flattened
    # parameter); the model holds their bf16 rounding.
    ref_of = {id(p): r for p, r in zip(model.parameters(), ref_params, strict=True)}
    for p, m in zip(opt.model_params, opt.master_params, strict=True):
        assert torch.equal(m, ref_of[id(p)].reshape(-1))
        assert torch.equal(p, ref_of[id(p)].to(torch.bfloat16))


def test_clipping_matches_torch_clip_grad_norm():
    model = _model(torch.float32)
    opt = _adapter(model, bf16=False)
    grads = _set_main_grads(model, 0, scale=3.0)
    opt.prepare_grads()
    norm = opt.clip_grad_norm(CFG.clip_grad)
    ref = [g.clone().requires_grad_(False) for g in grads]
    ref_params = [torch.zeros_like(g, requires_grad=True) for g in ref]
    for p, g in zip(ref_params, ref, strict=True):
        p.grad = g
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_params, CFG.clip_grad)
    assert norm == pytest.approx(float(ref_norm), rel=1e-6)
    assert norm > CFG.clip_grad  # the test must exercise clipping
    ref_of = {id(p): r for p, r in zip(model.parameters(), ref_params, strict=True)}
    for p, m in zip(opt.model_params, opt.master_params, strict=True):
        torch.testing.assert_close(m.grad, ref_of[id(p)].grad.reshape(-1), rtol=1e-6, atol=1e-7)


def test_non_finite_gradient_skips_the_step():
    model = _model(torch.float32)
    opt = _adapter(model, bf16=False)
    before = [p.detach().clone() for p in model.parameters()]
    _set_main_grads(model, 0)
    next(iter(model.parameters())).main_grad[0, 0] = float("nan")
    ok, norm, _ = opt.step()
    assert not ok and not math.isfinite(norm)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))


def test_state_dict_round_trip_gives_identical_next_step():
    model = _model(torch.bfloat16)
    opt = _adapter(model, bf16=True)
    for step in range(3):
        _set_main_grads(model, step, scale=0.05)
        opt.step()
    twin = copy.deepcopy(model)
    twin_opt = _adapter(twin, bf16=True)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for a, b in zip(opt.master_params, twin_opt.master_params, strict=True):
        assert torch.equal(a, b)
    _set_main_grads(model, 3, scale=0.05)
    _set_main_grads(twin, 3, scale=0.05)
    opt.step()
    twin_opt.step()
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(a, b)
