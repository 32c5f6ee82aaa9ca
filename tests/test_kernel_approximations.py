"""The C kernel's polynomial and rational coefficients are what scripts/fit_kernel_approximations.py
fits (the source says so), and the fits are as accurate as the source claims."""

from __future__ import annotations

import importlib.util
import math
import re

import numpy as np

from tests.conftest import ROOT

SOURCE = (ROOT / "megatron_ext" / "soma" / "native_lstm.c").read_text()
LITERAL = re.compile(r"(\d\.\d+e[-+]\d+)f")


def _fit_module():
    spec = importlib.util.spec_from_file_location(
        "fit_kernel_approximations", ROOT / "scripts" / "fit_kernel_approximations.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _function_body(signature: str) -> str:
    start = SOURCE.index(signature)
    return SOURCE[start : SOURCE.index("\n}\n", start)]


def _function_literals(signature: str) -> list[float]:
    """The function's float literals in exponent notation, in source order."""
    return [float(x) for x in LITERAL.findall(_function_body(signature))]


def test_exp2_polynomial_is_the_fit_and_within_2e_9():
    fit = _fit_module()
    c = fit.fit_exp2()
    # in the source: highest degree first, the constant term written as 1.0f
    np.testing.assert_allclose(
        _function_literals("static inline vf exp2_poly"), c[:0:-1], rtol=1e-6
    )
    assert abs(c[0] - 1) < 1e-8
    f = np.linspace(-0.5, 0.5, 100_001)
    assert np.abs(np.polyval(c[::-1], f) / 2.0**f - 1).max() < 2e-9


def test_gelu_rational_is_the_fit_with_u_folded_in():
    fit = _fit_module()
    p, q = fit.fit_erf()
    coeffs = _function_literals("static inline vf vgelu")  # P, Q interleaved from the top degree
    clamp = float(re.search(r"vmax\(x, -([\d.]+)f\)", _function_body("static inline vf vgelu"))[1])
    assert math.isclose(clamp, fit.ERF_RANGE * math.sqrt(2), rel_tol=1e-9)
    k = np.arange(len(p))
    want_p = (p / 2.0**k / math.sqrt(2))[::-1]
    want_q = (q / 2.0**k)[:0:-1]  # Q's constant term is 1.0f
    np.testing.assert_allclose(coeffs[0::2][: len(p)], want_p, rtol=1e-5)
    np.testing.assert_allclose(coeffs[1::2][: len(q) - 1], want_q, rtol=1e-5)
    u = np.linspace(0, fit.ERF_RANGE, 20_001)
    approx = u * np.polyval(p[::-1], u**2) / np.polyval(q[::-1], u**2)
    assert np.abs(approx - np.array([math.erf(v) for v in u])).max() < 3e-8
