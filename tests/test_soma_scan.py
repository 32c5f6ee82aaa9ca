"""The fused forward (each time chunk one compiled graph: per step one bmm + one element-wise
loop) against the eager forward it replaces and the float64 reference of test_soma_model, and
its fallbacks."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.soma import forward, scan
from megatron_ext.soma.layout import ExpertShape
from megatron_ext.soma.model import batched_loss, body_hidden
from tests.test_soma_model import _setup, reference_loss

pytestmark = pytest.mark.usefixtures("one_torch_thread")

needs_compiler = pytest.mark.skipif(
    not scan.fused_available("cpu")[0], reason=f"fused scan: {scan.fused_available('cpu')[1]}"
)


@pytest.fixture
def fused_calls(count_calls):
    """Counts the forward's calls of the compiled chunk (so a test cannot pass on eager alone)."""
    return count_calls(forward, "_FUSED")


@needs_compiler
def test_fused_scan_matches_eager_and_float64(fused_calls):
    # d_embed != d_model: the input projection and the output head around the scan as well as
    # the scan itself (each shape is its own compile, ~20 s on a fresh clone: one is enough)
    shape = ExpertShape(d_embed=16, d_model=24)
    layout, thetas, emb, tokens = _setup(shape, p=4, b=3, t=21, dtype=torch.float32)
    with torch.inference_mode():
        eager = batched_loss(thetas, emb, tokens, layout, fused="off")
        assert not fused_calls["calls"]
        fused = batched_loss(thetas, emb, tokens, layout, fused="on", max_chunk_bytes=2**14)
        hidden_f = body_hidden(thetas, emb, tokens[:, :-1], layout, fused="on")
        hidden_e = body_hidden(thetas, emb, tokens[:, :-1], layout, fused="off")
    assert fused_calls["calls"] and not scan.COMPILE_FAILURES
    torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden_f, hidden_e, rtol=1e-5, atol=1e-5)
    ref = torch.stack([reference_loss(t.double(), emb.double(), tokens, shape) for t in thetas])
    torch.testing.assert_close(fused.double(), ref, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_compiled_cell_scan_is_the_eager_scans_arithmetic():
    """The compiled out-of-place scan == the seven-kernel in-place scan, float64, 3 steps."""
    gen = torch.Generator().manual_seed(2)
    p, tc, b, d = 3, 3, 2, 5
    xw = torch.randn(p, tc, b, 4 * d, generator=gen, dtype=torch.float64)
    whh_t = 0.3 * torch.randn(p, d, 4 * d, generator=gen, dtype=torch.float64)
    h0 = torch.randn(p, b, d, generator=gen, dtype=torch.float64)
    n0 = torch.randn(p, b, d, generator=gen, dtype=torch.float64)
    with torch.inference_mode():
        out_e, h_e, n_e = scan.lstm_scan_inplace(xw, whh_t, h0.clone(), n0.clone())
        compiled = scan.Compiled(scan.lstm_scan_cells)
        out_f, h_f, n_f = compiled(xw, whh_t, h0.clone(), n0.clone())
    assert compiled._fn is not None and not scan.COMPILE_FAILURES
    for got, want in ((out_f, out_e), (h_f, h_e), (n_f, n_e)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_auto_follows_the_measured_table_and_off_never_fuses(fused_calls, monkeypatch):
    layout, thetas, emb, tokens = _setup(ExpertShape(), p=2, b=2, t=5, dtype=torch.float32)
    monkeypatch.setitem(scan.AUTO_FUSED, "cpu", False)
    with torch.inference_mode():
        batched_loss(thetas, emb, tokens, layout)  # "auto"
        batched_loss(thetas, emb, tokens, layout, fused="off")
    assert not fused_calls["calls"]
    assert not scan.use_fused("auto", torch.device("meta"))  # a device type never measured
    monkeypatch.setitem(scan.AUTO_FUSED, "cpu", True)
    assert scan.use_fused("auto", torch.device("cpu")) == scan.fused_available("cpu")[0]


def test_unavailable_compiler_warns_under_on_and_runs_eager(monkeypatch, fused_calls):
    monkeypatch.setattr(scan, "_compile_blocker", lambda device: "no C++ compiler (test)")
    scan._warn_unavailable.cache_clear()
    layout, thetas, emb, tokens = _setup(ExpertShape(), p=2, b=2, t=5, dtype=torch.float32)
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
            on = batched_loss(thetas, emb, tokens, layout, fused="on")
        off = batched_loss(thetas, emb, tokens, layout, fused="off")
    assert not fused_calls["calls"]
    assert torch.equal(on, off)
    assert scan.fused_available("cpu") == (False, "no C++ compiler (test)")


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="fused must be one of"):
        scan.use_fused("yes", torch.device("cpu"))  # type: ignore[arg-type]
