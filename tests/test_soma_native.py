"""SOMA's C kernels (:mod:`megatron_ext.soma.native`) against the eager torch forward they
replace and the float64 reference of test_soma_model, and what happens where they cannot run."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_ext.soma import forward, model, native, scan
from megatron_ext.soma.forward import NORM_EPS
from megatron_ext.soma.layout import BodyLayout, ExpertShape
from megatron_ext.soma.model import batched_loss, body_hidden, target_log_probs
from tests.test_soma_model import _setup, reference_loss

needs_kernel = pytest.mark.skipif(
    not native.native_available()[0], reason=f"C kernel: {native.native_available()[1]}"
)


@pytest.fixture
def native_calls(count_calls):
    """Counts the forward's calls of the C block kernel and head (so a test cannot pass on
    eager alone)."""
    return {"block": count_calls(native, "lstm_block"), "head": count_calls(model, "head_nll")}


def torch_block(x, w_ih_t, whh_t, fc1_t, fc2_t, h, n):
    """The eager torch path of the same block: norm, projection, the in-place scan, residual,
    norm, MLP, residual."""
    p, (b, d) = w_ih_t.shape[0], h.shape[1:]
    xw = torch.matmul(F.layer_norm(x, (d,), eps=NORM_EPS), w_ih_t)
    out, h, n = scan.lstm_scan_inplace(xw.view(p, -1, b, 4 * d), whh_t, h, n)
    x1 = x + out.view(p, -1, d)
    u = F.gelu(torch.bmm(F.layer_norm(x1, (d,), eps=NORM_EPS), fc1_t))
    return torch.baddbmm(x1, u, fc2_t), h, n


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "p, tc, b, d, shared",
    [
        (5, 3, 4, 32, True),
        (3, 5, 3, 7, False),
        (2, 1, 1, 62, False),
        (2, 9, 13, 32, False),
        (1, 2, 70, 16, True),
        (2, 4, 5, 24, False),
        (2, 5, 16, 32, False),
        (3, 2, 8, 24, True),
    ],
)
def test_block_kernel_matches_the_eager_block(p, tc, b, d, shared, threads, monkeypatch):
    """One x for all bodies or one each; batches that leave a short register tile (b = 3, 13,
    70 rows against tiles of 6 / 8 / 16) and the 2-vector tiles of b = 8, 16; chunks of several
    passes and a short last pass (9 x 13 rows, passes of ~64 rows) and a batch wider than a pass
    (b = 70); widths no multiple of the vector length (the column tails) and 4d = 96 (tiles of 4
    and 2 vectors); a carried h
    that is a strided view, as between chunks; GELU inputs well into both tails of erf."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(p * 100 + d)
    x = torch.randn(1 if shared else p, tc * b, d, generator=gen)
    w_ih_t, whh_t, fc1_t = (torch.randn(p, d, 4 * d, generator=gen) / d**0.5 for _ in range(3))
    fc1_t = 3 * fc1_t  # pre-activations out to about +-10
    fc2_t = torch.randn(p, 4 * d, d, generator=gen) / (4 * d) ** 0.5
    carried = torch.randn(p, 3, b, d, generator=gen)[:, -1]  # bodies strided, rows contiguous
    n0 = 2 * torch.randn(p, b, d, generator=gen)
    want = torch_block(x, w_ih_t, whh_t, fc1_t, fc2_t, carried.clone(), n0.clone())
    n = n0.clone()
    wcat = torch.cat([w_ih_t, whh_t], dim=1)
    out, h = native.lstm_block(x, wcat, fc1_t, fc2_t, carried, n, NORM_EPS)
    for got, ref in zip((out, h, n), want, strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)


@needs_kernel
def test_the_kernels_gelu_and_sigmoid_against_float64():
    """The block's GELU (a fitted rational erf) and sigmoid (exp by a fitted 2^f polynomial and a
    Newton-refined reciprocal) over their whole range, against float64: GELU within 1e-6
    absolute and 1e-6 relative, exactly 0 far left (an erf one rounding short of -1 would leave
    -x * 6e-8, 2.4e-5 at x = -400) and x far right; sigmoid within 2e-7."""
    x = torch.cat([torch.linspace(-400, 400, 200_001), torch.linspace(-8, 8, 200_001)])
    gelu = native.pointwise("gelu", x)
    ref = F.gelu(x.double())
    torch.testing.assert_close(gelu.double(), ref, rtol=1e-6, atol=1e-6)
    assert torch.all(gelu[x < -6] == 0) and torch.all(gelu[x > 6] == x[x > 6])
    sig = native.pointwise("sigmoid", x)
    torch.testing.assert_close(sig.double(), torch.sigmoid(x.double()), rtol=0, atol=2e-7)


@needs_kernel
@pytest.mark.parametrize("with_gain", [True, False])
def test_the_fused_final_norm_is_layer_norm_of_the_block_output(with_gain):
    """``final_norm``: the block's output through layer_norm (times the body's gain), as the
    torch path's final norm; the state is what the plain call gives."""
    p, tc, b, d = 3, 11, 7, 32  # 77 rows: two passes
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(p, tc * b, d, generator=gen)
    wcat = torch.randn(p, 2 * d, 4 * d, generator=gen) / d**0.5
    fc1_t = torch.randn(p, d, 4 * d, generator=gen) / d**0.5
    fc2_t = torch.randn(p, 4 * d, d, generator=gen) / (4 * d) ** 0.5
    h, n0 = torch.randn(p, b, d, generator=gen), torch.randn(p, b, d, generator=gen)
    gain = 1 + torch.randn(p, 2, d, generator=gen)[:, :1]  # a strided view, as from theta
    n = n0.clone()
    plain, h_plain = native.lstm_block(x, wcat, fc1_t, fc2_t, h, n, NORM_EPS)
    n_fused = n0.clone()
    fused, h_fused = native.lstm_block(
        x,
        wcat,
        fc1_t,
        fc2_t,
        h,
        n_fused,
        NORM_EPS,
        final_norm=True,
        gain=gain if with_gain else None,
    )
    want = F.layer_norm(plain, (d,), eps=NORM_EPS) * (gain if with_gain else 1)
    torch.testing.assert_close(fused, want, rtol=2e-6, atol=2e-6)
    assert torch.equal(h_fused, h_plain) and torch.equal(n_fused, n)
    with pytest.raises(ValueError, match="gain"):
        native.lstm_block(x, wcat, fc1_t, fc2_t, h, n, NORM_EPS, final_norm=True, gain=gain[:2])


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    "p, rows, e, v, per_body",
    [(3, 7, 32, 256, False), (2, 4, 24, 9, True), (2, 29, 32, 256, False)],
)
def test_head_kernel_matches_cross_entropy(p, rows, e, v, per_body, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    gen = torch.Generator().manual_seed(rows)
    hid = torch.randn(p, rows + 2, e, generator=gen)[:, 2:]  # rows of a body contiguous
    weight = torch.randn(p if per_body else 1, v, e, generator=gen)
    targets = torch.randint(0, v, (p if per_body else 1, rows), generator=gen)
    z = torch.bmm(hid, weight.expand(p, -1, -1).transpose(1, 2))
    ref = F.cross_entropy(
        z.reshape(-1, v), targets.expand(p, -1).reshape(-1), reduction="none"
    ).view(p, rows)
    got = native.head_nll(hid, weight.transpose(1, 2), targets)
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=2e-6)
    with pytest.raises(ValueError, match=f"targets outside 0..{v - 1}"):
        native.head_nll(hid, weight.transpose(1, 2), targets + v)


@needs_kernel
@pytest.mark.parametrize("shape", [ExpertShape(), ExpertShape(d_embed=16, d_model=24)])
def test_native_forward_matches_eager_and_float64(shape, native_calls):
    layout, thetas, emb, tokens = _setup(shape, p=4, b=3, t=21, dtype=torch.float32)
    with torch.inference_mode():
        eager = batched_loss(thetas, emb, tokens, layout, fused="off")
        assert not any(c["calls"] for c in native_calls.values())
        got = batched_loss(thetas, emb, tokens, layout, fused="native", max_chunk_bytes=2**14)
        auto = batched_loss(thetas, emb, tokens, layout)
    assert (
        native_calls["block"]["calls"] > 2 * shape.num_blocks and native_calls["head"]["calls"] > 2
    )
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
    assert native_calls["block"]["calls"] and native_calls["head"]["calls"]
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
            native.head_nll(torch.zeros(1, 1, 4), torch.zeros(1, 4, 3), torch.zeros(1, 1))
    finally:
        native._library.cache_clear()


def test_a_failing_compile_names_the_error(monkeypatch, tmp_path):
    bad = tmp_path / "broken.c"
    bad.write_text("int soma_lstm_block(void) { return this is not C; }\n")
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


@needs_kernel
def test_auto_takes_the_kernels_at_any_width_padded_to_whole_vectors(native_calls):
    """Odd widths (d = 15 narrow, d = 15 wide over d_E = 16): "auto" runs the kernels, at the
    width padded to whole vectors, with eager's losses and hidden states (the padding never
    leaks into them)."""
    for shape in (ExpertShape(d_embed=15, d_model=15), ExpertShape(d_embed=16, d_model=15)):
        layout, thetas, emb, tokens = _setup(shape, p=3, b=5, t=19, dtype=torch.float32)
        native_calls["block"]["calls"] = 0
        with torch.inference_mode():
            auto = batched_loss(thetas, emb, tokens, layout, max_chunk_bytes=2**13)
            assert native_calls["block"]["calls"] > shape.num_blocks
            eager = batched_loss(thetas, emb, tokens, layout, fused="off")
            hidden = body_hidden(thetas, emb, tokens[:, :-1], layout)
            hidden_eager = body_hidden(thetas, emb, tokens[:, :-1], layout, fused="off")
        assert native.padded_width(15) > 15 and hidden.shape[-1] == shape.d_embed
        torch.testing.assert_close(auto, eager, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(hidden, hidden_eager, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_8_float_build_matches_too(monkeypatch, tmp_path, count_calls):
    """The kernels as built for a host without AVX-512 (8-float vectors, the portable exp, the
    AVX-512VL or plain reciprocal): same results as the torch path, widths padded to 8."""
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DSOMA_VW=8"))
    monkeypatch.setenv(native.CACHE_VAR, str(tmp_path / "cache"))
    native._library.cache_clear()
    try:
        assert native.native_available() == (True, "")
        test_block_kernel_matches_the_eager_block(3, 5, 3, 7, False, 2, monkeypatch)
        test_block_kernel_matches_the_eager_block(5, 3, 4, 32, True, 2, monkeypatch)
        test_block_kernel_matches_the_eager_block(2, 9, 13, 32, False, 2, monkeypatch)
        test_head_kernel_matches_cross_entropy(3, 7, 32, 256, False, 2, monkeypatch)
        assert native.padded_width(15) == 16 and native.padded_width(16) == 16
        test_auto_takes_the_kernels_at_any_width_padded_to_whole_vectors(
            {"block": count_calls(native, "lstm_block")}
        )
        test_the_kernels_gelu_and_sigmoid_against_float64()
    finally:
        native._library.cache_clear()
    assert len(list((tmp_path / "cache" / "kernels").glob("soma_lstm_*.so"))) == 1


def test_native_chunks_are_sized_by_the_block_outputs_not_the_logits():
    """On the kernels the largest per-position intermediate is d wide (logits stay in scratch):
    time chunks 8x longer at d = 32, V = 256, within the same byte budget."""
    layout = BodyLayout.from_shape(ExpertShape(d_embed=32, d_model=32))
    budget = 8 * 2**20
    bodies, steps = forward.chunk_sizes(layout, 128, 16, 256, torch.float32, budget)
    nb, ns = forward.chunk_sizes(layout, 128, 16, 256, torch.float32, budget, on_kernels=True)
    assert (bodies, nb) == (128, 128) and (steps, ns) == (4, 32)
    assert nb * ns * 16 * 32 * 4 <= budget < nb * (ns + 1) * 16 * 32 * 4


@needs_kernel
def test_a_new_build_prunes_kernels_not_loaded_for_a_month(monkeypatch, tmp_path):
    """Kernels of earlier sources pile up with each upgrade: a build removes those not loaded
    for STALE_DAYS, keeps younger ones (another host's, say) and the one it built; loading a
    cached kernel refreshes its time."""
    import os
    import time

    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True)
    old, young, other = (folder / f"soma_lstm_{n}.so" for n in ("old", "young", "other"))
    for f in (old, young, other):
        f.write_bytes(b"not a kernel")
    month = time.time() - (native.STALE_DAYS + 1) * 86400
    os.utime(old, (month, month))
    os.utime(other, (month, month))
    (folder / "notes.txt").write_text("kept")
    os.utime(folder / "notes.txt", (month, month))
    monkeypatch.setenv(native.CACHE_VAR, str(tmp_path / "cache"))
    native._library.cache_clear()
    try:
        assert native.native_available() == (True, "")
        built = [f for f in folder.glob("soma_lstm_*.so") if f not in (old, young, other)]
        assert len(built) == 1 and young.exists() and (folder / "notes.txt").exists()
        assert not old.exists() and not other.exists()
        os.utime(built[0], (month, month))
        native._library.cache_clear()
        assert native.native_available() == (True, "")  # loads the cached one: its time renewed
        assert built[0].stat().st_mtime > time.time() - 60
    finally:
        native._library.cache_clear()


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_the_fma_peak_loop_does_the_work_it_counts(threads):
    """``bench soma``'s FMA peak divides the flops :func:`native.fma_peak` reports by its time:
    the loop must do them. Each of 12 accumulators k starts at k and takes ``iters`` steps
    c <- a c + b (a, b: 0.999 and 0.001 in float32; fixed point f = b / (1 - a)), so thread 0's
    checksum is VW · Σ_k (f + (k - f)·a^iters) (float64, the recurrence solved), and the flops
    2 · 12 · VW · iters · threads."""
    vw = native.padded_width(1)  # one vector
    a, b = float(np.float32(0.999)), float(np.float32(0.001))  # the float32 constants
    for iters in (1, 100, 3000):
        checksum, flops = native.fma_peak(iters, threads)
        fixed = b / (1 - a)
        want = vw * sum(fixed + (k - fixed) * a**iters for k in range(12))
        assert checksum == pytest.approx(want, rel=1e-5)
        assert flops == 2 * 12 * vw * iters * threads
