"""fp16's loss scale (megatron_ext/megatron/loss_scale.py) against megatron-core's own
``DynamicGradScaler`` and ``ConstantGradScaler``, and in the optimizer adapter: scaled gradients
unscaled to the unscaled run's step, a non-finite one skipping the step as megatron-core does."""

from __future__ import annotations

import random

import pytest
import torch
from megatron.core.optimizer import grad_scaler

from megatron_ext.megatron.loss_scale import LossScale
from tests.test_optimizer_adapter import _adapter, _model, _set_main_grads


def _megatron_core(monkeypatch, cls, *args):
    """megatron-core's scaler, its CUDA tensors made on the CPU (only its constructor asks for
    device='cuda'; its rule is unchanged)."""
    real = torch.tensor

    def on_cpu(*a, device=None, **k):
        return real(*a, **k)

    with monkeypatch.context() as patch:
        patch.setattr(torch, "tensor", on_cpu)
        return cls(*args)


def test_the_dynamic_rule_is_megatron_cores(monkeypatch) -> None:
    """3,000 steps of random overflows (runs of them, as fp16 produces): the same scale after
    every update, and the same trackers."""
    args = (2.0**10, 0.25, 2.0, 0.5, 7, 3)  # initial, min, growth, backoff, window, hysteresis
    theirs = _megatron_core(monkeypatch, grad_scaler.DynamicGradScaler, *args)
    ours = LossScale(*args)
    rng = random.Random(0)
    found, seen = False, set()
    for _ in range(3000):
        found = rng.random() < (0.6 if found else 0.15)
        theirs.update(found)
        ours.update(found)
        assert torch.equal(ours.scale, theirs.scale)
        assert torch.equal(ours.inv_scale, theirs.inv_scale)
        seen.add(float(ours.scale))
    assert ours.state_dict() == {
        "scale": float(theirs.state_dict()["scale"]),
        "growth_tracker": theirs.state_dict()["growth_tracker"],
        "hysteresis_tracker": theirs.state_dict()["hysteresis_tracker"],
    }
    assert min(seen) == 0.25 and max(seen) > 2.0**10  # the floor and growth both reached
    constant = LossScale(initial_scale=512.0, constant=True)
    peer = _megatron_core(monkeypatch, grad_scaler.ConstantGradScaler, 512.0)
    constant.update(True)
    peer.update(True)
    assert torch.equal(constant.scale, peer.scale) and constant.state_dict() == peer.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"min_scale": 0.0}, "min_loss_scale=0.0"),
        ({"min_scale": 2.0**40}, "min_loss_scale"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"initial_scale": -1.0, "constant": True}, "constant loss scale"),
    ],
)
def test_bad_settings_are_refused(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        LossScale(**kwargs)


def test_the_adapter_unscales_skips_and_resumes_the_scale() -> None:
    """Gradients scaled by 2¹² step exactly as unscaled ones (powers of two: exact); a
    non-finite gradient skips the step, leaves the parameters and halves the scale after
    ``hysteresis`` such steps; the scale's state round-trips."""
    plain, scaled = _model(torch.float32), _model(torch.float32)
    a, b = _adapter(plain, bf16=False), _adapter(scaled, bf16=False)
    b.loss_scale = LossScale(initial_scale=2.0**12, hysteresis=2, growth_interval=1000)
    assert float(b.get_loss_scale()) == 2.0**12 and float(a.get_loss_scale()) == 1.0
    for step in range(3):
        _set_main_grads(plain, step, scale=0.05)
        _set_main_grads(scaled, step, scale=0.05 * 2.0**12)
        ok_a, norm_a, _ = a.step()
        ok_b, norm_b, _ = b.step()
        assert ok_a and ok_b and norm_a == pytest.approx(norm_b, rel=1e-6)
        for p, q in zip(plain.parameters(), scaled.parameters(), strict=True):
            assert torch.equal(p, q)
    before = [p.detach().clone() for p in scaled.parameters()]
    for overflow in range(2):
        _set_main_grads(scaled, 10 + overflow)
        next(iter(scaled.parameters())).main_grad[0, 0] = float("inf")
        assert b.step() == (False, None, None)
        assert all(torch.equal(x, p) for x, p in zip(before, scaled.parameters(), strict=True))
    assert float(b.loss_scale.scale) == 2.0**11  # the second overflow: hysteresis 2 spent
    state = b.loss_scale.state_dict()
    again = LossScale(initial_scale=2.0**12, hysteresis=2, growth_interval=1000)
    again.load_state_dict(state)
    assert (
        again.state_dict()
        == state
        == {
            "scale": 2.0**11,
            "growth_tracker": 0,
            "hysteresis_tracker": 0,
        }
    )
