"""SOMA's C kernels (:mod:`megatron_ext.soma.native`) against the eager torch forward they
replace and the float64 reference of test_soma_model, and what happens where they cannot run."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.soma import forward, model, native, scan
from megatron_ext.soma.forward import NORM_EPS
from megatron_ext.soma.layout import ExpertShape
from megatron_ext.soma.model import batched_loss, target_log_probs
from tests.test_soma_model import _setup, reference_loss

needs_kernel = pytest.mark.skipif(
    not native.native_available()[0], reason=f"C kernel: {native.native_available()[1]}"
)


@pytest.fixture
def native_calls(monkeypatch):
    """Counts the forward's calls of the C block kernel and head (so a test cannot pass on
    eager alone)."""
    calls = {"block": 0, "head": 0}
    block, head = native.lstm_block, native.head_nll

    def counting_block(*args):
        calls["block"] += 1
        return block(*args)

    def counting_head(*args):
        calls["head"] += 1
        return head(*args)

    monkeypatch.setattr(native, "lstm_block", counting_block)
    monkeypatch.setattr(model, "head_nll", counting_head)
    return calls


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
    "p, tc, b, d, shared", [(5, 3, 4, 32, True), (3, 5, 3, 7, False), (2, 1, 1, 62, False)]
)
def test_block_kernel_matches_the_eager_block(p, tc, b, d, shared, threads, monkeypatch):
    """One x for all bodies or one each; an odd batch (a row left over from the two-row loop);
    widths no multiple of the vector length (the column tails); a carried h that is a strided
    view, as between chunks; GELU inputs well into both tails of erf."""
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
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("p, rows, e, v, per_body", [(3, 7, 32, 256, False), (2, 4, 24, 9, True)])
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
        assert not any(native_calls.values())
        got = batched_loss(thetas, emb, tokens, layout, fused="native", max_chunk_bytes=2**14)
        auto = batched_loss(thetas, emb, tokens, layout)
    assert native_calls["block"] > 2 * shape.num_blocks and native_calls["head"] > 2
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
    assert native_calls["block"] and native_calls["head"]
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
def test_auto_takes_the_kernels_only_for_whole_vector_widths(native_calls):
    """d = 24 (three 8-float vectors): native under "auto"; d = 15: eager under "auto" (scalar
    tails, measured slower), native only when asked -- with the same losses."""
    whole = ExpertShape(d_embed=16, d_model=24)
    layout, thetas, emb, tokens = _setup(whole, p=2, b=2, t=6, dtype=torch.float32)
    with torch.inference_mode():
        batched_loss(thetas, emb, tokens, layout)
    assert forward.native_pays(layout) and native_calls["block"]
    odd = ExpertShape(d_embed=16, d_model=15)
    layout, thetas, emb, tokens = _setup(odd, p=2, b=2, t=6, dtype=torch.float32)
    native_calls["block"] = 0
    with torch.inference_mode():
        auto = batched_loss(thetas, emb, tokens, layout)
        assert not native_calls["block"] and not forward.native_pays(layout)
        asked = batched_loss(thetas, emb, tokens, layout, fused="native")
    assert native_calls["block"]
    torch.testing.assert_close(asked, auto, rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_8_float_build_matches_too(monkeypatch, tmp_path):
    """The kernels as built for a host without AVX-512 (8-float vectors, the AVX-512VL or plain
    reciprocal): same results as the torch path."""
    monkeypatch.setattr(native, "FLAGS", (*native.FLAGS, "-DSOMA_VW=8"))
    monkeypatch.setenv(native.CACHE_VAR, str(tmp_path / "cache"))
    native._library.cache_clear()
    try:
        assert native.native_available() == (True, "")
        test_block_kernel_matches_the_eager_block(3, 5, 3, 7, False, 2, monkeypatch)
        test_block_kernel_matches_the_eager_block(5, 3, 4, 32, True, 2, monkeypatch)
        test_head_kernel_matches_cross_entropy(3, 7, 32, 256, False, 2, monkeypatch)
    finally:
        native._library.cache_clear()
    assert len(list((tmp_path / "cache" / "kernels").glob("soma_lstm_*.so"))) == 1
