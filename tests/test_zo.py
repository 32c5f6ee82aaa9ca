"""The shared zero-order core: probe streams, the SPSA estimate, ZOAdam, PlateauHalving.

References are written from the definitions: a pure-Python (int) rewrite of the documented hash,
float64 loops of the estimator formula and of Adam with coupled weight decay."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_ext.zo.probes import probe_matrix, probe_rows, second_moments
from megatron_ext.zo.spsa import PlateauHalving, ZOAdam, loss_differences, perturb, spsa_estimate

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --- the hash, rewritten from the module docstring in plain Python ints -------------------------

M32 = 2**32 - 1


def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def py_bits(key: tuple[int, ...], i: int) -> int:
    limbs = [len(key)]
    for v in key:
        v %= 2**64
        limbs += [v & M32, v >> 32]
    h0, h1 = 0x243F6A88, 0x85A308D3
    for limb in limbs:
        h0 = (py_mix32(h0 ^ limb) + 0x9E3779B9) & M32
        h1 = py_mix32((h1 + limb) & M32) ^ h0
    k0, k1 = py_mix32(h0), py_mix32(h1 ^ h0)
    x = py_mix32(i ^ k0)
    x = py_mix32((x + k1) & M32)
    return py_mix32(x ^ k0)


def py_probe(key: tuple[int, ...], i: int, gain: bool) -> float:
    """Coordinate ``i`` of the probe, from the documented use of the hash's two low bits."""
    bits = py_bits(key, i)
    sign = -1.0 if bits & 1 else 1.0
    return sign if gain or (bits >> 1) & 1 else 0.0


@pytest.mark.parametrize(
    "key", [(0,), (1, 2, 3), (7, 0, 123456, 3, 63), (2**64 - 1, 2**40 + 5), (-1, 5)]
)
def test_probes_equal_pure_python_hash(key):
    n = 70_000
    mask = _mask(n, 2_000)
    rows = probe_rows([key, (3,)], mask)
    assert rows.dtype == torch.float32 and rows.shape == (2, n)
    for i in (0, 1, 2, 31, 1999, 2000, 4095, 65_536, n - 1):
        assert float(rows[0, i]) == py_probe(key, i, bool(mask[i])), i
        assert float(rows[1, i]) == py_probe((3,), i, bool(mask[i])), i


def test_keys_outside_64_bits_rejected():
    with pytest.raises(ValueError, match="64 bits"):
        probe_rows([(2**64,)], _mask(4, 0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bits_identical_on_cuda():
    mask = torch.rand(50_000, generator=torch.Generator().manual_seed(0)) < 0.1
    cpu = probe_matrix(1, 2, 3, 4, range(8), mask)
    gpu = probe_matrix(1, 2, 3, 4, range(8), mask.cuda())
    assert torch.equal(cpu, gpu.cpu())


def _mask(n: int, gains: int) -> torch.Tensor:
    mask = torch.zeros(n, dtype=torch.bool)
    mask[:gains] = True
    return mask


def test_probe_distribution_frequencies():
    n, gains = 1_000_000, 200_000
    (z,) = probe_rows([(11, 3, 5)], _mask(n, gains))
    assert z.dtype == torch.float32
    g, w = z[:gains], z[gains:]
    # Gains: ±1 with ½ each, never 0.
    assert int((g == 0).sum()) == 0
    sd = math.sqrt(gains * 0.25)
    assert abs(int((g == 1).sum()) - gains / 2) < 5 * sd
    # Weights: 0 w.p. ½, ±1 w.p. ¼ each — chi-square over the three cells (2 dof).
    m = n - gains
    expected = torch.tensor([m / 4, m / 2, m / 4])
    counts = torch.stack([(w == v).sum() for v in (-1.0, 0.0, 1.0)]).double()
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 20.0  # P(chi2_2 > 20) ≈ 5e-5
    # q = E[z²]: 1 on gains, ½ elsewhere.
    q = second_moments(_mask(n, gains))
    assert torch.all(q[:gains] == 1.0) and torch.all(q[gains:] == 0.5)
    assert abs(float(w.pow(2).mean()) - 0.5) < 5 * math.sqrt(0.25 / m)


def test_probe_pairs_independent():
    """Joint frequencies of (z_a, z_b) for neighbouring coordinates, for the same coordinate
    under keys differing in one counter, and for two directions: chi-square over 9 cells."""
    n = 400_000
    mask = _mask(n, 0)
    z = probe_matrix(5, 1, 9, 0, [0, 1], mask)
    other_update = probe_matrix(5, 1, 10, 0, [0], mask)[0]
    p1 = torch.tensor([0.25, 0.5, 0.25], dtype=torch.float64)
    expected = torch.outer(p1, p1)
    for a, b in [(z[0][:-1], z[0][1:]), (z[0], z[1]), (z[0], other_update)]:
        cell = (a + 1).long() * 3 + (b + 1).long()
        counts = torch.bincount(cell, minlength=9).double()
        exp = expected.flatten() * a.numel()
        chi2 = float(((counts - exp) ** 2 / exp).sum())
        assert chi2 < 35.0  # 8 dof: P(chi2_8 > 35) ≈ 3e-5


def test_probes_deterministic_and_keyed():
    mask = _mask(5000, 100)
    a = probe_matrix(1, 2, 3, 4, [0, 1, 2], mask)
    assert torch.equal(a, probe_matrix(1, 2, 3, 4, [0, 1, 2], mask))
    for j in range(3):
        assert torch.equal(a[j], probe_rows([(1, 2, 3, 4, j)], mask)[0])
    # Any counter changes the probe; so does the key length.
    base = probe_rows([(1, 2, 3, 4, 0)], mask)[0]
    for key in [(2, 2, 3, 4, 0), (1, 3, 3, 4, 0), (1, 2, 4, 4, 0), (1, 2, 3, 5, 0), (1, 2, 3, 4)]:
        other = probe_rows([key], mask)[0]
        assert (other != base).float().mean() > 0.4, key
    # A subset of directions gives the same rows (what a rank in DDPP regenerates).
    assert torch.equal(probe_matrix(1, 2, 3, 4, [2], mask)[0], a[2])
    assert probe_matrix(1, 2, 3, 4, [], mask).shape == (0, 5000)
    assert probe_matrix(1, 2, 3, 4, [0], mask, dtype=torch.float64).dtype == torch.float64


# --- SPSA ---------------------------------------------------------------------------------------


def test_perturb_and_differences_order():
    theta = torch.tensor([1.0, 2.0, 3.0])
    z = torch.tensor([[1.0, 0.0, -1.0], [0.0, 1.0, 1.0]])
    rows = perturb(theta, z, 0.5)
    expect = torch.tensor([[1.5, 2.0, 2.5], [1.0, 2.5, 3.5], [0.5, 2.0, 3.5], [1.0, 1.5, 2.5]])
    assert torch.equal(rows, expect)
    assert torch.equal(
        loss_differences(torch.tensor([5.0, 7.0, 1.0, 2.0])), torch.tensor([4.0, 5.0])
    )
    with pytest.raises(ValueError):
        loss_differences(torch.ones(3))


def test_spsa_estimate_matches_formula_float64():
    gen = torch.Generator().manual_seed(0)
    k, n, eps = 7, 300, 1e-3
    z = probe_matrix(3, 0, 0, 0, range(k), _mask(n, 20))
    diffs = torch.randn(k, generator=gen, dtype=torch.float64) * 1e-3
    ref = [0.0] * n
    for j in range(k):
        for i in range(n):
            ref[i] += float(diffs[j]) / (2 * eps) * float(z[j, i]) / k
    est = spsa_estimate(diffs, z, eps)
    assert est.dtype == torch.float64
    torch.testing.assert_close(est, torch.tensor(ref, dtype=torch.float64), rtol=1e-13, atol=0)


def test_spsa_recovers_quadratic_gradient_direction():
    """On L(θ) = ½θᵀAθ the central difference is exact: E[ĝ] = diag(q)·Aθ."""
    gen = torch.Generator().manual_seed(1)
    n, k = 20, 20_000
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    a = a @ a.T / n
    theta = torch.randn(n, generator=gen, dtype=torch.float64)
    mask = _mask(n, 4)
    z = probe_matrix(0, 0, 0, 0, range(k), mask, dtype=torch.float64)
    rows = perturb(theta, z, 1e-2)
    losses = 0.5 * torch.einsum("pi,ij,pj->p", rows, a, rows)
    est = spsa_estimate(loss_differences(losses), z, 1e-2)
    expect = second_moments(mask) * (a @ theta)
    assert float((est - expect).norm() / expect.norm()) < 0.15


def test_spsa_estimate_bitwise_deterministic_across_thread_counts():
    k, n = 64, 50_000
    z = probe_matrix(2, 1, 0, 0, range(k), _mask(n, 100))
    diffs = torch.randn(k, generator=torch.Generator().manual_seed(4))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = spsa_estimate(diffs, z, 1e-3)
        torch.set_num_threads(max(2, threads))
        many = spsa_estimate(diffs, z, 1e-3)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    # Gathered from "ranks" (two halves of the directions) and re-assembled: same bits.
    gathered = torch.cat([diffs[:30].clone(), diffs[30:].clone()])
    assert torch.equal(spsa_estimate(gathered, z, 1e-3), one)


# --- ZOAdam -------------------------------------------------------------------------------------


def adam_reference(theta, grads, lrs, wd, b1=0.9, b2=0.999, eps=1e-8):
    """Float64 loops of Adam with coupled weight decay, from the algorithm."""
    theta = [float(x) for x in theta]
    m = [0.0] * len(theta)
    v = [0.0] * len(theta)
    for t, (grad, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        for i in range(len(theta)):
            g = float(grad[i]) + wd * theta[i]
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            mhat = m[i] / (1 - b1**t)
            vhat = v[i] / (1 - b2**t)
            theta[i] -= lr * mhat / (math.sqrt(vhat) + eps)
    return torch.tensor(theta, dtype=torch.float64)


def test_zo_adam_matches_reference_and_torch_adam():
    gen = torch.Generator().manual_seed(2)
    n, steps, wd = 50, 12, 0.1
    theta0 = torch.randn(n, generator=gen, dtype=torch.float64)
    grads = [torch.randn(n, generator=gen, dtype=torch.float64) for _ in range(steps)]
    lrs = [1e-2 if s < 6 else 5e-3 for s in range(steps)]

    theta = theta0.clone()
    opt = ZOAdam(n, dtype=torch.float64)
    for g, lr in zip(grads, lrs, strict=True):
        opt.step(theta, g, lr, wd)
    assert opt.steps == steps
    torch.testing.assert_close(
        theta, adam_reference(theta0, grads, lrs, wd), rtol=1e-12, atol=1e-14
    )

    param = torch.nn.Parameter(theta0.clone())
    torch_opt = torch.optim.Adam([param], lr=lrs[0], weight_decay=wd, foreach=False)
    for g, lr in zip(grads, lrs, strict=True):
        torch_opt.param_groups[0]["lr"] = lr
        param.grad = g.clone()
        torch_opt.step()
    torch.testing.assert_close(theta, param.detach(), rtol=1e-12, atol=1e-14)


def test_zo_adam_state_round_trip_continues_identically():
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(10, generator=gen) for _ in range(6)]
    theta_a = torch.zeros(10)
    a = ZOAdam(10)
    for g in grads[:3]:
        a.step(theta_a, g, 1e-3, 0.01)
    theta_b = theta_a.clone()
    b = ZOAdam(10)
    b.load_state_dict(a.state_dict())
    for g in grads[3:]:
        a.step(theta_a, g, 1e-3, 0.01)
        b.step(theta_b, g, 1e-3, 0.01)
    assert torch.equal(theta_a, theta_b) and b.steps == 6
    with pytest.raises(ValueError, match="moments"):
        ZOAdam(11).load_state_dict(a.state_dict())
    with pytest.raises(ValueError):
        a.step(torch.zeros(9), torch.zeros(9), 1e-3, 0.0)


# --- PlateauHalving -----------------------------------------------------------------------------


def test_plateau_halves_after_patience_and_restarts_window():
    p = PlateauHalving(lr=1e-3, eps=1e-3, patience=100, min_delta=1e-8, floor=1e-5)
    assert not p.observe(0, 5.0)
    assert not p.observe(50, 4.0)  # improvement at 50
    assert not p.observe(149, 4.0)  # 99 updates without improvement
    assert not p.observe(149, 4.0 - 1e-9)  # below min_delta: not an improvement
    assert p.observe(150, 4.0)  # 100 updates: halve
    assert (p.lr, p.eps) == (5e-4, 5e-4)
    assert not p.observe(200, 4.0)  # the window restarted at 150
    assert p.observe(250, 4.0)
    assert (p.lr, p.eps) == (2.5e-4, 2.5e-4)
    assert not p.observe(300, 3.9)  # a real improvement resets the window
    assert p.best == 3.9 and p.last_improvement == 300
    assert not p.observe(399, 3.95) and p.observe(400, float("nan"))


def test_plateau_floor_and_state_round_trip():
    p = PlateauHalving(lr=1e-3, eps=4e-3, patience=1, floor=1e-4)
    p.observe(0, 1.0)
    halvings = [p.observe(u, 1.0) for u in range(1, 12)]
    assert p.lr == 1e-4 and p.eps == 1e-4  # clamped, never below the floor
    assert halvings[0] and not halvings[-1]  # nothing left to halve: False
    q = PlateauHalving()
    q.load_state_dict(p.state_dict())
    assert q.state_dict() == p.state_dict()
    # A value that starts below the floor is never raised to it.
    low = PlateauHalving(lr=1e-6, eps=1e-3, patience=1, floor=1e-5)
    low.observe(0, 1.0)
    assert low.observe(1, 1.0) and low.lr == 1e-6 and low.eps == 5e-4
    with pytest.raises(ValueError):
        PlateauHalving(patience=0)
