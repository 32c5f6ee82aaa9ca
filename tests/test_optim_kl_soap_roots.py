"""KL-SOAP's Newton–Schulz inverse roots in the held eigenbasis (``inverse_root="newton_schulz"``):
the Jacobi-scaled inverse against float64, and the roots of a whole trajectory's factors."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.optimizers.kl_soap_math import (
    KLSoapConfig,
    KLSoapMatrices,
    explicit_factors,
    kl_soap_direction,
    root_in_basis,
)
from megatron_ext.optimizers.matrix_roots import inverse_newton_schulz, inverse_root_newton_schulz

from .test_optim_kl_soap import relative, spd

F64 = torch.float64


def nearly_diagonal(k: int, cond: float, angle: float, seed: int) -> torch.Tensor:
    """SPD ``Q Λ Qᵀ`` (eigenvalues log-spaced over ``cond``) whose eigenbasis Q is the identity
    rotated by ``exp(S)``, S skew with entries ~``angle``: a factor seen in a basis that is
    nearly, not exactly, its eigenbasis."""
    g = torch.Generator().manual_seed(seed)
    skew = torch.randn(k, k, generator=g, dtype=F64) * angle
    q = torch.linalg.matrix_exp(skew - skew.T)
    values = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=F64)
    return (q * values) @ q.T


# (A + 1e-6·I)⁻¹ in fp32 vs float64, relative Frobenius error, and iterations (of at most 25),
# measured: random eigenbasis κ = 1e2: 9e-7, 13 iterations (cold coupled NS, 25 iterations:
# 3e-6); κ = 1e4, k = 64: 4e-5, 19 (cold: 1.5e-4); nearly diagonal κ = 1e4 (rotation 1e-3):
# 1e-7, 7 at k = 64 and 2e-7, 10 at k = 256. fp32 accuracy is ~κ·u at best.
@pytest.mark.parametrize(
    ("k", "cond", "tol", "most"),
    [(64, 1e2, 1e-5, 16), (64, 1e4, 3e-4, 22)],
)
def test_jacobi_inverse_matches_float64_in_any_basis(
    k: int, cond: float, tol: float, most: int
) -> None:
    """A random eigenbasis gives the diagonal scaling nothing to work with: the iteration still
    converges within the cap, stops by itself, and is as accurate as the plain start."""
    a = torch.stack([spd(k, cond, seed=3), spd(k, cond, seed=4)]) * 5.0
    ref = torch.linalg.inv(a + 1e-6 * torch.eye(k, dtype=F64))
    x, done = inverse_newton_schulz(a.float(), eps=1e-6, max_iters=25)
    assert done <= most, done
    assert relative(x, ref) < tol
    cold = inverse_root_newton_schulz(a.float(), 1, eps=1e-6, num_iters=25)
    assert relative(x, ref) <= 1.5 * relative(cold, ref)
    assert torch.equal(x, x.mT)


def test_jacobi_inverse_of_a_nearly_diagonal_matrix_takes_few_iterations() -> None:
    a = torch.stack([nearly_diagonal(64, 1e4, 1e-3, seed=s) for s in (5, 6)])
    ref = torch.linalg.inv(a)
    x, done = inverse_newton_schulz(a.float(), max_iters=25)
    assert done <= 9, done  # measured 7
    assert relative(x, ref) < 1e-5  # measured 1e-7
    # the check stops it where it converged: two iterations fewer leave it far off (measured
    # 3e-4; the last one finds the rounding floor)
    early, _ = inverse_newton_schulz(a.float(), max_iters=done - 2)
    assert relative(early, ref) > 10 * relative(x, ref)


def _trajectory(
    shape: tuple[int, int, int], cfg: KLSoapConfig, steps: int, seed: int
) -> list[tuple[KLSoapMatrices, torch.Tensor]]:
    """The state before each of ``steps`` KL-SOAP steps (from step 2; copies) and that step's
    gradient; Gaussian gradients whose scale varies by up to 3× from step to step."""
    state = KLSoapMatrices.zeros(*shape)
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(1, steps + 1):
        grad = torch.randn(*shape, generator=g) * (0.5 + torch.rand(1, generator=g))
        if step > 1:
            snapshot = KLSoapMatrices(*(t.clone() for t in vars(state).values()))
            out.append((snapshot, grad))
        kl_soap_direction(grad.clone(), state, cfg, step)
    return out


def _damped_inverse64(factor: torch.Tensor, cfg: KLSoapConfig) -> torch.Tensor:
    """``(F + δI)⁻¹`` in float64, ``δ = ε + root_damping·‖F‖_F``."""
    f = factor.double()
    delta = cfg.factor_eps + cfg.root_damping * torch.linalg.matrix_norm(f, keepdim=True)
    return torch.linalg.inv(f + delta * torch.eye(f.shape[-1], dtype=F64))


@pytest.mark.parametrize("variant", [{}, {"refresh_every": 10}])
def test_roots_in_the_eigenbasis_match_float64_over_a_trajectory(variant: dict) -> None:
    """40 steps of a (2, 24, 40) batch (R is rank-deficient: m < n, so δ sets κ ≈ 1e4): every
    step's ``S⁻¹ = Q X Qᵀ`` is the float64 inverse of the damped factor, within 1e-3 (measured
    1.2e-4 for R, 1e-6 for L; the plain-start iteration on the explicit factor: 1.9e-4), and
    takes at most 3 iterations (measured 1; the plain start always runs ``root_iters`` = 25) —
    also when the basis is refreshed only every 10 steps."""
    cfg = KLSoapConfig(inverse_root="newton_schulz", **variant)
    stale: list[float] = []
    previous: list[torch.Tensor] | None = None
    for state, _ in _trajectory((2, 24, 40), cfg, steps=40, seed=7):
        factors = explicit_factors(state)
        sides = ((state.factor_basis_l, state.basis_l), (state.factor_basis_r, state.basis_r))
        roots = []
        for i, ((product, basis), factor) in enumerate(zip(sides, factors, strict=True)):
            x, done = root_in_basis(product, basis, cfg)
            assert done <= 3, done
            ref = _damped_inverse64(factor, cfg)
            roots.append(basis @ x @ basis.mT)
            assert relative(roots[-1], ref) < 1e-3
            if previous is not None:
                stale.append(relative(previous[i], ref))
        previous = roots
    # The tolerance is sharp: the previous step's root — what a warm start that skipped its
    # iterations would give — is off by more than 5e-3 at every step (measured ≥ 2e-2).
    assert min(stale) > 5e-3, min(stale)


def test_newton_schulz_steps_match_the_plain_start_iteration() -> None:
    """The whole step with roots in the eigenbasis against the same step with the plain-start
    coupled iteration on the explicit factors (the previous implementation), from the same
    states of a 30-step trajectory: the factor products agree within 1e-4 (measured 2e-6)."""
    cfg = KLSoapConfig(inverse_root="newton_schulz")
    for state, grad in _trajectory((2, 20, 12), cfg, steps=30, seed=9)[::5]:
        m, n = grad.shape[-2:]
        ours = KLSoapMatrices(*(t.clone() for t in vars(state).values()))
        kl_soap_direction(grad.clone(), ours, cfg, step=2)
        factor_l, factor_r = explicit_factors(state)
        # previous implementation: roots of the explicit factors, then L·Q, R·Q (before refresh)
        inv_r = inverse_root_newton_schulz(factor_r, 1, eps=_eps(factor_r, cfg), num_iters=25)
        inv_l = inverse_root_newton_schulz(factor_l, 1, eps=_eps(factor_l, cfg), num_iters=25)
        beta = cfg.factor_beta(2)
        new_l = beta * factor_l + (1 - beta) / n * grad @ inv_r @ grad.mT
        new_r = beta * factor_r + (1 - beta) / m * grad.mT @ inv_l @ grad
        got_l, got_r = explicit_factors(ours)
        assert relative(got_l, new_l) < 1e-4
        assert relative(got_r, new_r) < 1e-4


def _eps(factor: torch.Tensor, cfg: KLSoapConfig) -> torch.Tensor:
    norm = torch.linalg.matrix_norm(factor, keepdim=True)
    return cfg.root_damping * norm + cfg.factor_eps
