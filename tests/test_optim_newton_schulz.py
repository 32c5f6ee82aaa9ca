"""Newton–Schulz orthogonalisation: coefficient sets, plain vs Gram form, accuracy bounds."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.optimizers.ns_iteration import newton_schulz
from megatron_ext.optimizers.ns_schedule import (
    COEFFICIENT_SETS,
    gram_is_cheaper,
    newton_schulz_flops,
    resolve_coefficients,
)
from megatron_ext.optimizers.symmetric import symmetric_bmm

from .optim_reference import ns_reference, orthogonality_error

SHAPES = [(16, 16), (12, 40), (40, 12), (24, 64)]


def random_batch(batch: int, m: int, n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, m, n, generator=torch.Generator().manual_seed(seed))


def ill_conditioned(batch: int, m: int, n: int, cond: float, seed: int = 0) -> torch.Tensor:
    """Matrices with singular values log-spaced from 1 down to 1/cond."""
    g = torch.Generator().manual_seed(seed)
    k = min(m, n)
    u = torch.linalg.qr(torch.randn(batch, m, k, generator=g, dtype=torch.float64)).Q
    v = torch.linalg.qr(torch.randn(batch, n, k, generator=g, dtype=torch.float64)).Q
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return ((u * s) @ v.mT).float()


def test_polar_express_coefficients_include_safety_factor_and_repeat_last() -> None:
    table = COEFFICIENT_SETS["polar_express"]
    # First published triple (8.2872, −23.5959, 17.3004) divided by 1.01^(1, 3, 5).
    assert table[0] == pytest.approx((8.2051, -22.9019, 16.4607), abs=1e-4)
    assert table[-1] == (1.875, -1.25, 0.375)
    steps = resolve_coefficients("polar_express", 11)
    assert steps[:8] == list(table) and steps[8:] == [table[-1]] * 3


def test_single_triple_sets_and_user_lists() -> None:
    assert resolve_coefficients("quintic", 3) == [(3.4445, -4.7750, 2.0315)] * 3
    assert resolve_coefficients("cubic", 2) == [(1.5, -0.5, 0.0)] * 2
    assert resolve_coefficients([(2, -1, 0.5), (1.5, -0.5, 0)], 3) == [
        (2.0, -1.0, 0.5),
        (1.5, -0.5, 0.0),
        (1.5, -0.5, 0.0),
    ]


@pytest.mark.parametrize("bad", ["quintik", [], [(1.0, 2.0)]])
def test_bad_coefficients_list_the_choices(bad: object) -> None:
    with pytest.raises(ValueError, match="quintic"):
        resolve_coefficients(bad, 5)  # type: ignore[arg-type]


@pytest.mark.parametrize("coefficients", ["quintic", "polar_express", "cubic", "quintic_cubic"])
@pytest.mark.parametrize("shape", SHAPES)
def test_plain_ns_matches_float64_reference(coefficients: str, shape: tuple[int, int]) -> None:
    x = random_batch(3, *shape)
    out = newton_schulz(x, coefficients=coefficients, num_steps=5, method="plain")
    steps = resolve_coefficients(coefficients, 5)
    for i in range(3):
        ref = ns_reference(x[i], steps)
        err = (torch.linalg.norm(out[i].double() - ref) / torch.linalg.norm(ref)).item()
        assert err < 2e-5, err  # fp32 rounding through 5 steps


@pytest.mark.parametrize("shape", SHAPES)
def test_batched_equals_one_by_one(shape: tuple[int, int]) -> None:
    x = random_batch(5, *shape)
    together = newton_schulz(x)
    for i in range(5):
        torch.testing.assert_close(together[i], newton_schulz(x[i]), rtol=1e-5, atol=1e-6)


def _relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    diff = torch.linalg.matrix_norm(out.double() - ref.double())
    return (diff / torch.linalg.matrix_norm(ref.double())).max().item()


@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 64), (20, 20)])
@pytest.mark.parametrize("restart", [(), (2,)])
def test_gram_matches_plain_on_random_inputs(shape: tuple[int, int], restart: tuple) -> None:
    x = random_batch(4, *shape)
    for coefficients in ("quintic", "polar_express"):
        plain = newton_schulz(x, coefficients=coefficients, method="plain")
        gram = newton_schulz(x, coefficients=coefficients, method="gram", gram_restart=restart)
        # measured ≤ 3e-6 for rectangular shapes, 5e-5 for 20×20 (σ_min of a random square
    # matrix is tiny, so it is ill-conditioned) without the restart
    assert _relative(gram, plain) < 1e-4, coefficients


@pytest.mark.parametrize("restart", [(), (2,)])
def test_tall_batches_run_gram_on_their_small_side_untransposed(restart: tuple) -> None:
    """A tall batch runs Gram NS on XᵀX (n×n) and returns X·P in its own layout: the same
    iteration as the wide Gram NS of its transpose (fp32 rounding apart), without a
    transposed copy in or out."""
    x = random_batch(4, 96, 32)
    tall = newton_schulz(x, method="gram", gram_restart=restart)
    wide = newton_schulz(x.mT.contiguous(), method="gram", gram_restart=restart)
    assert tall.is_contiguous() and tall.shape == x.shape
    # measured ≤ 1e-6 (products of the same numbers in another order)
    assert _relative(tall, wide.mT) < 1e-5


# Findings (fp32, 5 steps, 32×96, singular values log-spaced from 1 to 1/cond; error relative
# to a float64 plain-NS reference), measured for quintic and polar_express:
#   cond   plain NS   Gram, no restart   Gram, restart after step 2
#   1e2    1e-6       5e-5               5e-6
#   1e4    5e-6       1e-3               1.5e-5
#   1e6    1e-5       1.5e-3             1.6e-5
# Without a safeguard Gram NS loses ~2 digits on ill-conditioned inputs; one restart restores
# plain-NS accuracy. Even unrestarted, it stays within 5e-3 of plain NS — far below NS's own
# distance from the polar factor (~0.1 at 5 steps) — so fp32 runs without a restart by default
# (it costs two m×n-sized products); bf16 restarts after step 2.
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
@pytest.mark.parametrize("cond", [1e2, 1e4, 1e6])
def test_gram_needs_the_restart_safeguard_on_ill_conditioned_inputs(
    coefficients: str, cond: float
) -> None:
    x = ill_conditioned(4, 32, 96, cond)
    steps = resolve_coefficients(coefficients, 5)
    ref = torch.stack([ns_reference(x[i], steps) for i in range(4)])
    plain = _relative(newton_schulz(x, coefficients=coefficients, method="plain"), ref)
    bare = _relative(
        newton_schulz(x, coefficients=coefficients, method="gram", gram_restart=()), ref
    )
    restarted = _relative(
        newton_schulz(x, coefficients=coefficients, method="gram", gram_restart=(2,)), ref
    )
    default = newton_schulz(x, coefficients=coefficients, method="gram")
    torch.testing.assert_close(
        default, newton_schulz(x, coefficients=coefficients, method="gram", gram_restart=())
    )
    assert plain < 3e-5
    assert restarted < 1e-4, restarted
    assert bare < 5e-3, bare
    if cond >= 1e4:
        assert bare > 5 * restarted, (bare, restarted)  # the safeguard matters here


# Orthogonality against the exact polar factor, fp32, 8 random Gaussian 48×160 matrices
# (σ_min/σ_max ≈ 0.3): ‖O − UVᵀ‖_F/‖UVᵀ‖_F and the singular values of O. The quintic set
# never converges (its fixed band is ~[0.68, 1.2]); polar_express is tuned to converge by
# step ~6 and overshoots on the way (σ up to 1.87 after 3 steps), so it wins from step 5 on.
ORTHO_BOUNDS = {
    # (set, steps): (max error, min σ, max σ)
    ("quintic", 5): (0.25, 0.65, 1.25),
    ("quintic", 8): (0.25, 0.65, 1.25),
    ("polar_express", 5): (0.12, 0.85, 1.15),
    ("polar_express", 6): (5e-3, 0.99, 1.01),
    ("polar_express", 8): (1e-4, 0.9999, 1.0001),
    ("cubic", 5): (0.9, 0.0, 1.0),
    ("cubic", 30): (1e-4, 0.9999, 1.0001),
    ("quintic_cubic", 4): (0.12, 0.8, 1.0),
}


@pytest.mark.parametrize(("coefficients", "steps"), list(ORTHO_BOUNDS))
def test_orthogonality_error_bounds(coefficients: str, steps: int) -> None:
    x = random_batch(8, 48, 160, seed=3)
    out = newton_schulz(x, coefficients=coefficients, num_steps=steps)
    max_err, lo, hi = ORTHO_BOUNDS[(coefficients, steps)]
    for i in range(8):
        err, smin, smax = orthogonality_error(out[i], x[i])
        assert err < max_err and smin >= lo and smax <= hi, (err, smin, smax)


@pytest.mark.parametrize("steps", [5, 6, 7, 8])
def test_polar_express_beats_quintic_at_equal_steps(steps: int) -> None:
    x = random_batch(8, 48, 160, seed=4)
    errors = {}
    for name in ("quintic", "polar_express"):
        out = newton_schulz(x, coefficients=name, num_steps=steps)
        errors[name] = max(orthogonality_error(out[i], x[i])[0] for i in range(8))
    assert errors["polar_express"] < errors["quintic"], errors


@pytest.mark.parametrize("method", ["plain", "gram"])
def test_quintic_cubic_in_4_steps_beats_5_quintic_steps_for_fewer_flops(method: str) -> None:
    """Three quintic steps then a cubic one (its c = 0 saves the A² product) end closer to the
    polar factor than five quintic steps, at about 3/4 of the flops; the Gram form agrees with
    the plain one, whose c = 0 step skips the product without changing the arithmetic."""
    x = random_batch(8, 48, 160, seed=4)
    errors = {}
    for name, steps in (("quintic", 5), ("quintic_cubic", 4)):
        out = newton_schulz(x, coefficients=name, num_steps=steps, method=method)
        errors[name] = max(orthogonality_error(out[i], x[i])[0] for i in range(8))
    assert errors["quintic_cubic"] < 0.5 * errors["quintic"], errors
    plain = newton_schulz(x, coefficients="quintic_cubic", num_steps=4, method="plain")
    gram = newton_schulz(x, coefficients="quintic_cubic", num_steps=4, method="gram")
    assert _relative(gram, plain) < 1e-4
    for m, n in ((256, 512), (512, 2048), (512, 512)):
        q5 = newton_schulz_flops(m, n, 5, method)
        qc4 = newton_schulz_flops(m, n, 4, method, coefficients="quintic_cubic")
        assert 0.6 * q5 < qc4 <= 0.8 * q5, (m, n, qc4 / q5)
    # Gram: R and P·X, then 3 + 4 + 4 m×m products, and only P ← Q·P in the cubic step
    assert newton_schulz_flops(512, 2048, 4, "gram", (), coefficients="quintic_cubic") == (
        4 * 512**2 * 2048 + 24 * 512**3
    )


def test_flop_model_picks_gram_for_wide_matrices_only() -> None:
    assert newton_schulz_flops(512, 2048, 5, "plain") == 5 * (4 * 512**2 * 2048 + 2 * 512**3)
    assert newton_schulz_flops(512, 2048, 5, "gram", ()) == 4 * 512**2 * 2048 + 34 * 512**3
    # restart after step 2: 4 m×n-sized products and 14 m×m ones
    assert newton_schulz_flops(512, 2048, 5, "gram", (2,)) == 8 * 512**2 * 2048 + 28 * 512**3
    # defaults: no restart in fp32, after step 2 in bf16
    assert newton_schulz_flops(512, 2048, 5, "gram") == newton_schulz_flops(
        512, 2048, 5, "gram", ()
    )
    assert newton_schulz_flops(512, 2048, 5, "gram", precision="bf16") == newton_schulz_flops(
        512, 2048, 5, "gram", (2,)
    )
    assert gram_is_cheaper(512, 2048, 5) and gram_is_cheaper(2048, 512, 5)
    assert gram_is_cheaper(256, 512, 5)
    assert not gram_is_cheaper(512, 512, 5) and not gram_is_cheaper(512, 700, 5)


def test_zero_matrix_maps_to_zero_and_bf16_runs() -> None:
    assert torch.count_nonzero(newton_schulz(torch.zeros(2, 8, 12))) == 0
    x = random_batch(2, 16, 48)
    out = newton_schulz(x, precision="bf16")
    assert out.dtype == torch.bfloat16
    ref = newton_schulz(x)
    assert _relative(out.float(), ref) < 0.05


def test_leading_dims_and_orientation_are_preserved() -> None:
    x = torch.randn(2, 3, 20, 8)
    out = newton_schulz(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out[1, 2], newton_schulz(x[1, 2]), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("m", [16, 200])
def test_symmetric_bmm_equals_full_product(m: int) -> None:
    """m = 200 with inner dimension 700 takes the split path, 16 the plain one."""
    g = torch.Generator().manual_seed(21)
    x = torch.randn(3, m, 700, generator=g)
    a = torch.randn(3, m, m, generator=g)
    a = a + a.mT
    out = torch.empty(3, m, m)
    full = x @ x.mT
    torch.testing.assert_close(symmetric_bmm(x, x.mT, out), full, rtol=1e-5, atol=1e-4)
    assert torch.equal(out, out.mT)
    expected = 0.5 * a + 2.0 * (a @ a)
    symmetric_bmm(a, a, out, add=a, beta=0.5, alpha=2.0)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-3)
    inplace = a.clone()
    symmetric_bmm(x, x.mT, inplace, add=inplace, beta=0.9, alpha=0.1)
    torch.testing.assert_close(inplace, 0.9 * a + 0.1 * full, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(symmetric_bmm(x, x.mT, out, alpha=0.3), 0.3 * full)
