"""Fit the two function approximations of ``megatron_ext/soma/native_lstm.c`` and print them.

* ``exp2_poly``: 2^f on [-1/2, 1/2] by a degree-6 polynomial, least maximum relative error.
* GELU's erf: erf(u) = u P(u²) / Q(u²), degrees 5 / 5, Q(0) = 1, least maximum absolute error
  on [0, 4] (erf(4) = 1 - 1.5e-8: 1 in float beyond), then u = x / √2 folded into the
  coefficients so that the kernel evaluates P and Q at x².

Method: linear least squares on Chebyshev nodes turned into a minimax fit by Lawson's
reweighting (each weight times its point's error, renormalised); for the rational, Loeb's
linearisation (residual u·P - erf·Q, divided by the previous iterate's Q). Prints each fit's
largest error in float64 and in float32 arithmetic (Horner, as the kernel evaluates it), and
the C literals. Run: ``python scripts/fit_kernel_approximations.py`` (numpy only, ~2 s).
"""

from __future__ import annotations

import math

import numpy as np

ERF_RANGE = 4.0


def chebyshev_nodes(lo: float, hi: float, n: int) -> np.ndarray:
    """n Chebyshev nodes of [lo, hi] and n evenly spaced points (the fit's sample), sorted."""
    cheb = (np.cos(np.pi * (np.arange(n) + 0.5) / n) + 1) / 2 * (hi - lo) + lo
    return np.sort(np.concatenate([cheb, np.linspace(lo, hi, n)]))


def fit_exp2(degree: int = 6, iterations: int = 200) -> np.ndarray:
    """Coefficients c[0..degree] (ascending) of p(f) ≈ 2^f on [-1/2, 1/2], least maximum
    relative error."""
    f = chebyshev_nodes(-0.5, 0.5, 2000)
    a = np.vander(f, degree + 1, increasing=True) / 2.0 ** f[:, None]  # rows: p(f) / 2^f
    w = np.ones_like(f)
    best = (np.inf, None)
    for _ in range(iterations):
        c, *_ = np.linalg.lstsq(a * np.sqrt(w)[:, None], np.sqrt(w), rcond=None)
        err = np.abs(a @ c - 1)
        if err.max() < best[0]:
            best = (err.max(), c)
        w = w * err + 1e-300
        w /= w.sum()
    return best[1]


def fit_erf(dp: int = 5, dq: int = 5, iterations: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """(p, q) ascending in s = u², q[0] = 1, with u p(s) / q(s) ≈ erf(u) on [0, ERF_RANGE],
    least maximum absolute error."""
    u = chebyshev_nodes(0.0, ERF_RANGE, 3000)
    target = np.array([math.erf(x) for x in u])
    s = (u / ERF_RANGE) ** 2  # fitted in s / range², rescaled below: better conditioned
    q_prev, w = np.ones_like(u), np.ones_like(u)
    best = (np.inf, None, None)
    for _ in range(iterations):
        a = np.hstack(
            [
                u[:, None] * s[:, None] ** np.arange(dp + 1),
                -target[:, None] * s[:, None] ** np.arange(1, dq + 1),
            ]
        )
        scale = np.sqrt(w) / q_prev
        c, *_ = np.linalg.lstsq(a * scale[:, None], target * scale, rcond=None)
        p, q = c[: dp + 1], np.concatenate([[1.0], c[dp + 1 :]])
        q_prev = np.polyval(q[::-1], s)
        err = u * np.polyval(p[::-1], s) / q_prev - target
        if np.abs(err).max() < best[0]:
            best = (np.abs(err).max(), p, q)
        w = w * np.abs(err) + 1e-300
        w /= w.sum()
    _, p, q = best
    return p / ERF_RANGE ** (2 * np.arange(dp + 1)), q / ERF_RANGE ** (2 * np.arange(dq + 1))


def horner32(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Σ coeffs[k] x^k by Horner's rule in float32 (coefficients rounded to float first)."""
    acc = np.full_like(x, np.float32(coeffs[-1]))
    for c in coeffs[-2::-1]:
        acc = (acc * x + np.float32(c)).astype(np.float32)
    return acc


def main() -> None:
    c = fit_exp2()
    f = np.linspace(-0.5, 0.5, 200001)
    rel64 = np.abs(np.polyval(c[::-1], f) / 2.0**f - 1).max()
    f32 = f.astype(np.float32)
    rel32 = np.abs(horner32(c, f32).astype(np.float64) / 2.0 ** f32.astype(np.float64) - 1).max()
    print(
        f"exp2_poly, degree {len(c) - 1}: max relative error {rel64:.2e} (float64), "
        f"{rel32:.2e} (float32)"
    )
    print("  " + ", ".join(f"{v:.16e}f" for v in c[::-1]))

    p, q = fit_erf()
    x = np.linspace(0.0, 6.0, 300001)
    xc = np.minimum(x, ERF_RANGE)
    ref = np.array([math.erf(v) for v in x])
    err64 = np.abs(xc * np.polyval(p[::-1], xc**2) / np.polyval(q[::-1], xc**2) - ref).max()
    x32 = xc.astype(np.float32)
    s32 = x32 * x32
    err32 = np.abs((x32 * horner32(p, s32) / horner32(q, s32)).astype(np.float64) - ref).max()
    print(
        f"erf, degrees {len(p) - 1}/{len(q) - 1} in u²: max absolute error {err64:.2e} "
        f"(float64), {err32:.2e} (float32)"
    )
    # GELU evaluates erf(x / √2) at s = x²: P_k / 2^k / √2 and Q_k / 2^k.
    k = np.arange(len(p))
    print("  P(x²): " + ", ".join(f"{v:.9e}f" for v in (p / 2.0**k / math.sqrt(2))[::-1]))
    print("  Q(x²): " + ", ".join(f"{v:.9e}f" for v in (q / 2.0 ** np.arange(len(q)))[::-1]))
    print(f"  clamp |x| <= {ERF_RANGE * math.sqrt(2):.9f}")


if __name__ == "__main__":
    main()
