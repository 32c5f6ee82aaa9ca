"""Muon and MOP against float64 references; batching, fused QKV, scaling, state dicts."""

from __future__ import annotations

import copy
import io
import logging
import math

import pytest
import torch

from megatron_ext.optimizers import mop as mop_module
from megatron_ext.optimizers.mop import MOP, polar_factor
from megatron_ext.optimizers.muon import Muon
from megatron_ext.optimizers.ns_schedule import resolve_coefficients
from megatron_ext.optimizers.qkv import QKVLayout, qkv_views

from .optim_reference import MuonReference, polar_reference

SHAPES = [(16, 16), (40, 12), (12, 40), (3, 12, 20)]


def grads_for(shape: tuple[int, ...], steps: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


def run_fast(opt_factory, w0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    p = torch.nn.Parameter(w0.clone())
    opt = opt_factory([p])
    for g in grads:
        p.grad = g.clone()
        opt.step()
    return p.detach()


def run_reference(ref_factory, w0: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """Reference on each matrix of ``w0`` (the experts of a 3-D stack independently)."""
    mats = [w0] if w0.ndim == 2 else list(w0)
    out = []
    for i, w in enumerate(mats):
        ref = ref_factory()
        w = w.double()
        for g in grads:
            w = ref.step(w, g if g.ndim == 2 else g[i])
        out.append(w)
    return out[0] if w0.ndim == 2 else torch.stack(out)


def assert_updates_close(
    fast: torch.Tensor, ref: torch.Tensor, w0: torch.Tensor, tol: float
) -> None:
    """Relative Frobenius error of the total update W_T − W_0."""
    du_fast, du_ref = fast.double() - w0.double(), ref - w0.double()
    err = (torch.linalg.norm(du_fast - du_ref) / torch.linalg.norm(du_ref)).item()
    assert err < tol, err


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"nesterov": True, "weight_decay": 0.1},
        {"scale_mode": "shape", "extra_scale_factor": 0.5},
        {"scale_mode": "unit_rms", "coefficients": "quintic"},
        {"rms_match": "beta", "momentum": 0.9, "extra_scale_factor": 1.5},
    ],
)
def test_muon_matches_float64_reference(shape: tuple[int, ...], options: dict) -> None:
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    grads = grads_for(shape, 4)
    coefficients = options.get("coefficients", "polar_express")  # Muon's default
    momentum = options.get("momentum", 0.95)
    extra = options.get("extra_scale_factor", 1.0)
    if options.get("rms_match") == "beta":  # the paper's factor, Sec. 5.2
        extra *= math.sqrt((1 - momentum) / (1 + momentum))
    fast = run_fast(lambda p: Muon(p, lr=0.05, **options), w0, grads)
    ref = run_reference(
        lambda: MuonReference(
            lr=0.05,
            momentum=momentum,
            nesterov=options.get("nesterov", False),
            weight_decay=options.get("weight_decay", 0.0),
            scale_mode=options.get("scale_mode", "spectral"),
            extra=extra,
            steps=resolve_coefficients(coefficients, 5),
        ),
        w0,
        grads,
    )
    # fp32 NS (plain, or Gram without restart: the fp32 default) vs float64: ≤ 1e-4
    assert_updates_close(fast, ref, w0, 1e-4)


def test_batched_step_equals_one_by_one() -> None:
    shapes = [(12, 40)] * 3 + [(40, 12)] * 2 + [(4, 12, 40), (16, 16)]
    g = torch.Generator().manual_seed(2)
    w0 = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    together = [torch.nn.Parameter(w.clone()) for w in w0]
    opt = Muon(together, lr=0.1, weight_decay=0.01)
    alone = [torch.nn.Parameter(w.clone()) for w in w0]
    opts = [Muon([p], lr=0.1, weight_decay=0.01) for p in alone]
    for step_grads in grads:
        for p, q, gr in zip(together, alone, step_grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        opt.step()
        for o in opts:
            o.step()
    for p, q in zip(together, alone, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_batch_size_limit_does_not_change_results() -> None:
    params = [torch.nn.Parameter(torch.randn(8, 24)) for _ in range(6)]
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, q in zip(params, clones, strict=True):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    Muon(params, lr=0.1, max_batch_numel=8 * 24 * 2).step()  # batches of 2
    Muon(clones, lr=0.1).step()
    for p, q in zip(params, clones, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


LAYOUT = QKVLayout(num_query_groups=2, heads_per_group=3, kv_channels=4)  # 2·(3+2)·4 = 40 rows


def test_qkv_views_follow_megatron_interleaved_layout() -> None:
    hidden = 6
    weight = torch.arange(LAYOUT.rows * hidden, dtype=torch.float32).view(LAYOUT.rows, hidden)
    q, k, v = qkv_views(weight, LAYOUT)
    group = (LAYOUT.heads_per_group + 2) * LAYOUT.kv_channels  # 20 rows per group
    # group g: rows [20g, 20g+12) are q (3 heads × 4), then 4 rows k, then 4 rows v
    for gi in range(2):
        torch.testing.assert_close(q[gi], weight[gi * group : gi * group + 12])
        torch.testing.assert_close(k[gi], weight[gi * group + 12 : gi * group + 16])
        torch.testing.assert_close(v[gi], weight[gi * group + 16 : gi * group + 20])
    assert q.reshape(-1, hidden).shape == LAYOUT.shapes(hidden)[0] == (24, hidden)
    q.zero_()  # views, not copies
    assert weight[0:12].abs().sum() == 0 and weight[12:20].abs().sum() > 0
    with pytest.raises(ValueError, match="40 rows"):
        qkv_views(torch.zeros(41, hidden), LAYOUT)


def test_fused_qkv_split_matches_reference() -> None:
    hidden = 16
    group = (LAYOUT.heads_per_group + 2) * LAYOUT.kv_channels
    offsets = torch.arange(2) * group
    q_rows = (offsets[:, None] + torch.arange(12)).flatten()
    k_rows = (offsets[:, None] + 12 + torch.arange(4)).flatten()
    v_rows = (offsets[:, None] + 16 + torch.arange(4)).flatten()
    w0 = torch.randn(LAYOUT.rows, hidden, generator=torch.Generator().manual_seed(3))
    grads = grads_for((LAYOUT.rows, hidden), 3)
    fast = run_fast(lambda p: Muon(p, lr=0.05, qkv_layout=LAYOUT), w0, grads)
    ref = MuonReference(lr=0.05, steps=resolve_coefficients("polar_express", 5))
    w = w0.double()
    for g in grads:
        w = ref.step(w, g, split_rows=[q_rows, k_rows, v_rows])
    assert_updates_close(fast, w, w0, 1e-4)
    unsplit = run_fast(lambda p: Muon(p, lr=0.05), w0, grads)
    assert (unsplit - fast).abs().max() > 1e-3  # the split does change the update


@pytest.mark.parametrize("shape", [(64, 256), (256, 64), (128, 128), (8, 64, 128)])
def test_update_rms_with_extra_factor_is_adamw_like(shape: tuple[int, ...]) -> None:
    # Default (polar_express, 5 steps): singular values of O in ~[0.87, 1.12] with RMS ≈ 1, so
    # the spectral scale times 0.2 gives an update RMS of 0.2 ± 5%. The quintic set settles
    # lower (RMS ≈ 0.86 → 0.17), which this test also pins down.
    def rms_after_one_step(**kwargs: object) -> float:
        p = torch.nn.Parameter(torch.zeros(shape))
        p.grad = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        Muon([p], lr=1.0, extra_scale_factor=0.2, **kwargs).step()
        return p.detach().pow(2).mean().sqrt().item()

    assert abs(rms_after_one_step() - 0.2) < 0.01
    assert 0.16 < rms_after_one_step(coefficients="quintic") < 0.185


@pytest.mark.parametrize("optimizer", [Muon, MOP])
def test_beta_rms_match_is_the_constant_factor_exactly(optimizer: type) -> None:
    """``rms_match="beta"`` equals ``rms_match="constant"`` with ``extra_scale_factor`` =
    √((1 − β)/(1 + β)), bit for bit, each parameter group with its own momentum β."""
    g = torch.Generator().manual_seed(11)
    shapes = [(12, 40), (40, 12), (2, 16, 16)]
    w0 = [torch.randn(s, generator=g) for s in shapes]
    betas = (0.95, 0.9, 0.8)  # one group per parameter
    runs = {}
    for mode in ("beta", "constant"):
        params = [torch.nn.Parameter(w.clone()) for w in w0]
        groups = [
            {
                "params": [p],
                "momentum": beta,
                "extra_scale_factor": 1.0 if mode == "beta" else math.sqrt((1 - beta) / (1 + beta)),
            }
            for p, beta in zip(params, betas, strict=True)
        ]
        opt = optimizer(groups, lr=0.05, weight_decay=0.1, rms_match=mode)
        step_grads = torch.Generator().manual_seed(12)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=step_grads)
            opt.step()
        runs[mode] = params
    for p, q in zip(runs["beta"], runs["constant"], strict=True):
        assert torch.equal(p, q)


def test_beta_rms_match_gives_the_update_rms_of_the_factor() -> None:
    """Spectral scale, ``extra_scale_factor=1``: the update RMS is √((1 − β)/(1 + β)) (0.160 at
    β = 0.95), as it is 0.2 with the constant 0.2 (test above; polar_express: ±5%)."""
    p = torch.nn.Parameter(torch.zeros(64, 256))
    p.grad = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
    Muon([p], lr=1.0, rms_match="beta").step()
    assert p.detach().pow(2).mean().sqrt().item() == pytest.approx(0.1601, rel=0.05)


def test_state_dict_without_rms_match_loads_as_constant() -> None:
    """A state dict saved before ``rms_match`` existed (its groups lack the key) scaled by
    ``extra_scale_factor`` alone: loaded, it continues so (torch installs the saved groups)."""
    g = torch.Generator().manual_seed(13)
    params = [torch.nn.Parameter(torch.randn(12, 30, generator=g))]
    opt = Muon(params, lr=0.1, extra_scale_factor=0.2)
    params[0].grad = torch.randn(12, 30, generator=g)
    opt.step()
    saved = copy.deepcopy(opt.state_dict())
    for group in saved["param_groups"]:
        del group["rms_match"]
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = Muon(clones, lr=0.1, extra_scale_factor=0.2, rms_match="beta")
    fresh.load_state_dict(saved)
    assert fresh.param_groups[0]["rms_match"] == "constant"
    params[0].grad = torch.randn(12, 30, generator=g)
    clones[0].grad = params[0].grad.clone()
    opt.step()
    fresh.step()
    assert torch.equal(params[0], clones[0])


def test_state_dict_round_trip_gives_identical_next_step() -> None:
    g = torch.Generator().manual_seed(6)
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in [(12, 30), (2, 8, 8)]]
    opt = Muon(params, lr=0.1, nesterov=True)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = Muon(clones, lr=0.1, nesterov=True)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    for p, q in zip(params, clones, strict=True):
        p.grad = torch.randn(p.shape, generator=g)
        q.grad = p.grad.clone()
    opt.step()
    fresh.step()
    for p, q in zip(params, clones, strict=True):
        assert torch.equal(p, q)


def test_matches_emerging_optimizers_muon() -> None:
    eo_muon = pytest.importorskip("emerging_optimizers.orthogonalized_optimizers.muon")
    g = torch.Generator().manual_seed(7)
    shapes = [(32, 96), (96, 32), (48, 48)]
    ours = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    # Emerging-Optimizers calls the (3.4445, −4.7750, 2.0315) triple "simple"; its "quintic" is
    # a different per-step table.
    their_opt = eo_muon.Muon(
        theirs,
        lr=0.1,
        weight_decay=0.0,
        fp32_matmul_prec="highest",
        coefficient_type="simple",
        num_ns_steps=5,
        scale_mode="spectral",
    )
    our_opt = Muon(ours, lr=0.1, coefficients="quintic", num_steps=5, ns_method="plain")
    w0 = [p.detach().clone() for p in ours]
    for _ in range(3):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn(p.shape, generator=g)
            q.grad = p.grad.clone()
        our_opt.step()
        their_opt.step()
    for p, q, w in zip(ours, theirs, w0, strict=True):
        du_ours, du_theirs = p.detach() - w, q.detach() - w
        err = (torch.linalg.norm(du_ours - du_theirs) / torch.linalg.norm(du_theirs)).item()
        assert err < 1e-5, err


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"coefficients": "quintc"}, "polar_express"),
        ({"ns_method": "fast"}, "gram"),
        ({"scale_mode": "rms"}, "unit_rms"),
        ({"momentum": 1.0}, "momentum"),
        ({"num_steps": 0}, "num_steps"),
        ({"precision": "fp16"}, "bf16"),
        (
            {"rms_match": "adamw"},
            r"rms_match='adamw' is not valid; choose one of \['constant', 'beta'\]",
        ),
    ],
)
def test_bad_hyperparameters_are_rejected_with_choices(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Muon([torch.nn.Parameter(torch.zeros(4, 4))], **kwargs)


def test_vectors_are_rejected() -> None:
    with pytest.raises(ValueError, match="AdamW"):
        Muon([torch.nn.Parameter(torch.zeros(8))])
    with pytest.raises(ValueError, match="AdamW"):
        MOP([torch.nn.Parameter(torch.zeros(2, 2, 2, 2))])


# ------------------------------------------------------------------------------------------ MOP
@pytest.mark.parametrize("shape", SHAPES)
def test_mop_matches_float64_reference(shape: tuple[int, ...]) -> None:
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(8))
    grads = grads_for(shape, 3)
    fast = run_fast(lambda p: MOP(p, lr=0.05, weight_decay=0.1), w0, grads)
    ref = run_reference(lambda: MuonReference(lr=0.05, weight_decay=0.1, polar=True), w0, grads)
    assert_updates_close(fast, ref, w0, 1e-4)


def test_mop_fp64_is_closer_than_fp32() -> None:
    x = torch.randn(4, 20, 50, generator=torch.Generator().manual_seed(9))
    ref = torch.stack([polar_reference(x[i]) for i in range(4)])
    out32, _ = polar_factor(x, precision="fp32")
    out64, _ = polar_factor(x, precision="fp64")
    assert (out64.double() - ref).abs().max() < 1e-6  # then rounded to fp32
    assert (out32.double() - ref).abs().max() < 1e-5


def test_mop_falls_back_to_eigh_then_newton_schulz_and_logs_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(mop_module, "_reported", set())
    x = torch.randn(3, 16, 40, generator=torch.Generator().manual_seed(10))
    ref = torch.stack([polar_reference(x[i]) for i in range(3)])

    def broken_svd(*args, **kwargs):
        raise torch.linalg.LinAlgError("forced failure")

    monkeypatch.setattr(torch.linalg, "svd", broken_svd)
    with caplog.at_level(logging.WARNING, logger=mop_module.__name__):
        out, path = polar_factor(x)
        out_again, _ = polar_factor(x)
    assert path == "eigh"
    assert (out.double() - ref).abs().max() < 1e-4
    assert sum("eigh path" in r.message for r in caplog.records) == 1  # once, not per call
    torch.testing.assert_close(out, out_again)

    monkeypatch.setattr(torch.linalg, "eigh", broken_svd)
    out, path = polar_factor(x)
    assert path == "newton_schulz"
    assert (out.double() - ref).abs().max() < 0.05  # 10 polar_express steps
    assert sum("newton_schulz path" in r.message for r in caplog.records) <= 1

    opt_param = torch.nn.Parameter(torch.randn(16, 40))
    opt_param.grad = x[0].clone()
    opt = MOP([opt_param], lr=0.1)
    opt.step()  # never raises, whatever the SVD does
    assert opt.last_path == "newton_schulz" and torch.isfinite(opt_param).all()


def test_mop_maps_zero_momentum_to_zero_update() -> None:
    out, path = polar_factor(torch.zeros(2, 8, 12))
    assert path == "svd" and torch.count_nonzero(out) == 0


def test_mop_state_dict_round_trip() -> None:
    p = torch.nn.Parameter(torch.randn(10, 20))
    opt = MOP([p], lr=0.1)
    p.grad = torch.randn(10, 20)
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    fresh = MOP([q], lr=0.1)
    fresh.load_state_dict(copy.deepcopy(opt.state_dict()))
    p.grad = torch.randn(10, 20)
    q.grad = p.grad.clone()
    opt.step()
    fresh.step()
    assert torch.equal(p, q)
