"""SOMA's C kernels (:mod:`megatron_ext.soma.native`) against the eager torch forward they
replace and the float64 reference of test_soma_model, and what happens where they cannot run."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.soma import forward, native, scan
from megatron_ext.soma.layout import ExpertShape
from megatron_ext.soma.model import batched_loss, target_log_probs
from tests.test_soma_model import _setup, reference_loss

needs_kernel = pytest.mark.skipif(
    not native.native_available()[0], reason=f"C kernel: {native.native_available()[1]}"
)


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the forward's calls of the C recurrence (so a test cannot pass on eager alone)."""
    calls = []
    real = native.lstm_scan_native

    def counting(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(native, "lstm_scan_native", counting)
    return calls


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("p, tc, b, d", [(5, 3, 4, 32), (3, 5, 3, 7), (2, 1, 1, 62), (4, 2, 2, 8)])
def test_recurrence_matches_the_eager_scan(p, tc, b, d, threads, monkeypatch):
    """Odd batch (a row left over from the two-row loop), widths that are no multiple of the
    vector length (the column tails), a state h that is a strided view as between chunks."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(p * 100 + d)
    xw = torch.randn(p, tc, b, 4 * d, generator=gen)
    whh_t = torch.randn(p, d, 4 * d, generator=gen) / d**0.5
    carried = torch.randn(p, 3, b, d, generator=gen)[:, -1]  # bodies strided, rows contiguous
    n0 = 2 * torch.randn(p, b, d, generator=gen)
    want_out, want_h, want_n = scan.lstm_scan_inplace(xw, whh_t, carried.clone(), n0.clone())
    n = n0.clone()
    out, h, n_after = native.lstm_scan_native(xw, whh_t, carried, n)
    assert n_after.data_ptr() == n.data_ptr()  # updated in place, as the eager scan does
    for got, want in ((out, want_out), (h, want_h), (n, want_n)):
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)


@needs_kernel
@pytest.mark.parametrize("shape", [ExpertShape(), ExpertShape(d_embed=16, d_model=24)])
def test_native_forward_matches_eager_and_float64(shape, native_calls):
    layout, thetas, emb, tokens = _setup(shape, p=4, b=3, t=21, dtype=torch.float32)
    with torch.inference_mode():
        eager = batched_loss(thetas, emb, tokens, layout, fused="off")
        assert not native_calls
        got = batched_loss(thetas, emb, tokens, layout, fused="native", max_chunk_bytes=2**14)
        auto = batched_loss(thetas, emb, tokens, layout)
    assert len(native_calls) > 2 * shape.num_blocks  # several chunks, both runs
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    assert torch.equal(auto, batched_loss(thetas, emb, tokens, layout, fused="native"))
    ref = torch.stack([reference_loss(t.double(), emb.double(), tokens, shape) for t in thetas])
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_native_routed_scoring_matches_eager(native_calls):
    """Per-body token batches (routed inference: each expert its own windows), scored after a
    prefix."""
    layout, thetas, emb, _ = _setup(ExpertShape(), p=3, b=2, t=17, dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (3, 2, 18), generator=gen)
    with torch.inference_mode():
        eager = target_log_probs(thetas, emb, tokens, layout, start=4, fused="off")
        got = target_log_probs(thetas, emb, tokens, layout, start=4, fused="native")
    assert native_calls
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)


def test_no_compiler_warns_under_native_and_auto_runs_eager_silently(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv(native.CACHE_VAR, str(tmp_path / "cache"))
    native._library.cache_clear()
    scan._warn_unavailable.cache_clear()
    try:
        ok, why = native.native_available()
        assert not ok and "no C compiler found" in why and "set CC" in why
        layout, thetas, emb, tokens = _setup(ExpertShape(), p=2, b=2, t=5, dtype=torch.float32)
        with torch.inference_mode():
            with pytest.warns(RuntimeWarning, match="no C compiler found"):
                asked = batched_loss(thetas, emb, tokens, layout, fused="native")
            off = batched_loss(thetas, emb, tokens, layout, fused="off")
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("error")
                auto = batched_loss(thetas, emb, tokens, layout)
        assert torch.equal(asked, off) and torch.equal(auto, off)
        with pytest.raises(RuntimeError, match="C kernel is unavailable"):
            native.lstm_scan_native(*(torch.zeros(1, 1, 1, 4),) * 2, *(torch.zeros(1, 1, 1),) * 2)
    finally:
        native._library.cache_clear()


def test_a_failing_compile_names_the_error(monkeypatch, tmp_path):
    bad = tmp_path / "broken.c"
    bad.write_text("int soma_lstm_scan(void) { return this is not C; }\n")
    monkeypatch.setattr(native, "SOURCE", bad)
    monkeypatch.setenv(native.CACHE_VAR, str(tmp_path / "cache"))
    native._library.cache_clear()
    try:
        ok, why = native.native_available()
    finally:
        native._library.cache_clear()
    if "no C compiler" in why:
        pytest.skip(why)
    assert not ok and why.startswith("compiling broken.c with ") and "error" in why
    assert not list((tmp_path / "cache" / "kernels").glob("*.so"))  # nothing half-written kept


@needs_kernel
def test_float64_under_native_warns_and_runs_eager(monkeypatch):
    scan._warn_unavailable.cache_clear()
    layout, thetas, emb, tokens = _setup(ExpertShape(), p=2, b=2, t=5, dtype=torch.float64)
    with torch.inference_mode():
        with pytest.warns(RuntimeWarning, match="float32 on CPU, not float64"):
            got = batched_loss(thetas, emb, tokens, layout, fused="native")
        want = batched_loss(thetas, emb, tokens, layout, fused="off")
    assert torch.equal(got, want)
    assert forward.use_native("auto", torch.device("cpu"), torch.float64) is False
