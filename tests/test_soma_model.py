"""The SOMA expert body against an independent reference built from torch.nn.LSTM.

The reference walks the flat vector in the documented order itself and evaluates one body with
torch.nn.LSTM(bias=False), F.layer_norm (gain as weight, no bias), exact GELU and F.cross_entropy,
all in float64. Nothing in it shares code with the batched forward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_ext.soma.layout import BodyLayout, ExpertShape, init_body, init_embedding
from megatron_ext.soma.model import (
    batched_loss,
    body_hidden,
    head_gradient,
    log_probs,
    naive_loss_loop,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_forward(
    theta: torch.Tensor, emb: torch.Tensor, tokens: torch.Tensor, shape: ExpertShape
) -> tuple[torch.Tensor, torch.Tensor]:
    """One body, float64: (final hidden (B, T, d_E), logits (B, T, V)) for inputs tokens (B, T)."""
    d, e, v = shape.d_model, shape.d_embed, shape.vocab
    offset = 0

    def take(*dims: int) -> torch.Tensor:
        nonlocal offset
        n = math.prod(dims)
        out = theta[offset : offset + n].reshape(dims)
        offset += n
        return out

    blocks = [
        dict(g1=take(d), wih=take(4 * d, d), whh=take(4 * d, d), g2=take(d), fc1=take(4 * d, d),
             fc2=take(d, 4 * d))
        for _ in range(shape.num_blocks)
    ]  # fmt: skip
    g_final = take(d)
    wide = d != e
    if wide:
        in_proj, out_proj, head = take(d, e), take(e, d), take(v, e)
    assert offset == theta.numel()

    # the wide expert's own head is its tied input embedding (paper: App. C)
    x = head[tokens] @ in_proj.T if wide else emb[tokens]
    for blk in blocks:
        lstm = torch.nn.LSTM(d, d, bias=False, batch_first=True, dtype=theta.dtype)
        # functional_call keeps theta's slices as the LSTM weights, so autograd reaches theta.
        weights = {"weight_ih_l0": blk["wih"], "weight_hh_l0": blk["whh"]}
        inp = F.layer_norm(x, (d,), weight=blk["g1"], eps=1e-5)
        y, _ = torch.func.functional_call(lstm, weights, (inp,))
        x = x + y
        hmid = F.layer_norm(x, (d,), weight=blk["g2"], eps=1e-5)
        x = x + F.gelu(hmid @ blk["fc1"].T, approximate="none") @ blk["fc2"].T
    h = F.layer_norm(x, (d,), weight=g_final, eps=1e-5)
    if wide:
        h = h @ out_proj.T
        return h, h @ head.T
    return h, h @ emb.T


def reference_loss(theta, emb, tokens, shape) -> torch.Tensor:
    _, z = reference_forward(theta, emb, tokens[:, :-1], shape)
    return F.cross_entropy(z.reshape(-1, shape.vocab), tokens[:, 1:].reshape(-1))


def _setup(shape: ExpertShape, p: int, b: int, t: int, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    layout = BodyLayout.from_shape(shape)
    theta = init_body(shape, gen, dtype=dtype)
    # Rows differ everywhere, gains included, so a mixed-up row or gain would show.
    noise = torch.randn(p, layout.numel, generator=gen, dtype=dtype)
    thetas = theta + 0.3 * noise * theta.abs().mean()
    thetas[:, layout.gain_mask] = 1.0 + 0.5 * torch.rand(p, int(layout.gain_mask.sum()),
                                                         generator=gen, dtype=dtype)  # fmt: skip
    emb = init_embedding(shape, gen, dtype=dtype)
    tokens = torch.randint(0, shape.vocab, (b, t + 1), generator=gen)
    return layout, thetas, emb, tokens


def test_default_body_has_32928_parameters_in_documented_order():
    layout = BodyLayout.from_shape(ExpertShape())
    assert layout.numel == 32_928 == 2 * (2 * 32 + 16 * 32 * 32) + 32
    assert int(layout.gain_mask.sum()) == 2 * 2 * 32 + 32
    names = [e.name for e in layout.entries]
    assert names[:7] == [
        "blocks.0.norm1.gain",
        "blocks.0.lstm.w_ih",
        "blocks.0.lstm.w_hh",
        "blocks.0.norm2.gain",
        "blocks.0.mlp.fc1",
        "blocks.0.mlp.fc2",
        "blocks.1.norm1.gain",
    ]
    assert names[-1] == "final_norm.gain"
    offset = 0
    for e in layout.entries:
        assert e.offset == offset
        offset += e.numel
        assert e.gain == e.name.endswith(".gain")
    assert layout.entry("blocks.1.mlp.fc2").shape == (32, 128)


def test_views_alias_the_flat_vector():
    layout = BodyLayout.from_shape(ExpertShape(d_embed=8, d_model=8, num_blocks=1))
    theta = torch.zeros(3, layout.numel)
    views = layout.views(theta)
    views["blocks.0.lstm.w_hh"][2, 5, 1] = 7.0
    entry = layout.entry("blocks.0.lstm.w_hh")
    assert theta[2, entry.offset + 5 * 8 + 1] == 7.0
    assert views["final_norm.gain"].shape == (3, 8)
    assert all(v.data_ptr() >= theta.data_ptr() for v in views.values())
    with pytest.raises(ValueError, match=r"\(P, "):
        layout.views(torch.zeros(layout.numel))


@pytest.mark.parametrize(
    "kwargs", [dict(vocab=1), dict(d_model=0), dict(num_blocks=0), dict(d_embed=2.5)]
)
def test_expert_shape_rejects_bad_sizes(kwargs):
    with pytest.raises(ValueError, match="ExpertShape"):
        ExpertShape(**kwargs)


def test_init_body_gains_one_and_deterministic():
    shape = ExpertShape(d_embed=16, d_model=16, num_blocks=2)
    layout = BodyLayout.from_shape(shape)
    a = init_body(shape, torch.Generator().manual_seed(3))
    b = init_body(shape, torch.Generator().manual_seed(3))
    c = init_body(shape, torch.Generator().manual_seed(4))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.dtype == torch.float32 and a.shape == (layout.numel,)
    assert torch.all(a[layout.gain_mask] == 1.0)
    w = layout.views(a[None])["blocks.0.lstm.w_ih"]
    assert w.abs().max() <= 1 / 4 and w.std() > 0.1
    emb = init_embedding(shape, torch.Generator().manual_seed(0))
    assert emb.shape == (256, 16) and abs(emb.pow(2).sum(1).mean().item() - 1.0) < 0.1


@pytest.mark.parametrize("chunk_bytes", [16 * 2**20, 1])  # one chunk / one body and step each
def test_batched_matches_reference_float64(chunk_bytes):
    shape = ExpertShape(d_embed=8, d_model=8, num_blocks=2)
    layout, thetas, emb, tokens = _setup(shape, p=3, b=3, t=7)
    hidden = body_hidden(thetas, emb, tokens[:, :-1], layout, max_chunk_bytes=chunk_bytes)
    losses = batched_loss(thetas, emb, tokens, layout, max_chunk_bytes=chunk_bytes)
    assert hidden.shape == (3, 3, 7, 8) and losses.shape == (3,)
    for i in range(3):
        ref_h, _ = reference_forward(thetas[i], emb, tokens[:, :-1], shape)
        torch.testing.assert_close(hidden[i], ref_h, rtol=1e-12, atol=1e-12)
        ref_l = reference_loss(thetas[i], emb, tokens, shape)
        torch.testing.assert_close(losses[i], ref_l, rtol=1e-12, atol=1e-12)
    # Distinct rows really give distinct losses (the rows are not all the same body).
    assert losses.unique().numel() == 3


def test_log_probs_normalised_and_consistent_with_loss():
    shape = ExpertShape(d_embed=8, d_model=8, num_blocks=1)
    layout, thetas, emb, tokens = _setup(shape, p=2, b=2, t=5)
    lp = log_probs(thetas, emb, tokens[:, :-1], layout)
    assert lp.shape == (2, 2, 5, 256)
    torch.testing.assert_close(lp.exp().sum(-1), torch.ones(2, 2, 5, dtype=torch.float64))
    picked = lp.gather(-1, tokens[:, 1:][None, :, :, None].expand(2, -1, -1, 1))
    torch.testing.assert_close(
        -picked.mean(dim=(1, 2, 3)), batched_loss(thetas, emb, tokens, layout)
    )


def test_autograd_path_matches_reference_gradient():
    shape = ExpertShape(d_embed=8, d_model=8, num_blocks=2)
    layout, thetas, emb, tokens = _setup(shape, p=1, b=2, t=6)
    theta = thetas[0].clone().requires_grad_(True)
    loss = batched_loss(theta[None], emb, tokens, layout, max_chunk_bytes=1)[0]
    (grad,) = torch.autograd.grad(loss, theta)
    ref_theta = thetas[0].clone().requires_grad_(True)
    (ref_grad,) = torch.autograd.grad(reference_loss(ref_theta, emb, tokens, shape), ref_theta)
    torch.testing.assert_close(loss.detach(), batched_loss(thetas[:1], emb, tokens, layout)[0])
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-12)


def test_fp32_batched_matches_naive_loop():
    shape = ExpertShape()  # d = 32, D = 2, V = 256
    layout, thetas, emb, tokens = _setup(shape, p=6, b=2, t=40, dtype=torch.float32)
    batched = batched_loss(thetas, emb, tokens, layout)
    naive = naive_loss_loop(thetas, emb, tokens, layout)
    assert naive.shape == (6,)
    torch.testing.assert_close(batched, naive, rtol=1e-5, atol=1e-5)
    ref = torch.stack([reference_loss(t.double(), emb.double(), tokens, shape) for t in thetas])
    torch.testing.assert_close(batched.double(), ref, rtol=1e-4, atol=1e-4)


def test_wide_body_shapes_and_reference():
    shape = ExpertShape(vocab=256, d_embed=32, d_model=48, num_blocks=2)
    layout = BodyLayout.from_shape(shape)
    d, e = 48, 32
    assert layout.numel == 2 * (2 * d + 16 * d * d) + d + 2 * d * e + 256 * e
    assert [x.name for x in layout.entries[-3:]] == ["in_proj", "out_proj", "head"]
    assert [x.shape for x in layout.entries[-3:]] == [(48, 32), (32, 48), (256, 32)]
    layout, thetas, emb, tokens = _setup(shape, p=2, b=2, t=5)
    hidden = body_hidden(thetas, emb, tokens[:, :-1], layout)
    assert hidden.shape == (2, 2, 5, 32)
    losses = batched_loss(thetas, emb, tokens, layout)
    for i in range(2):
        ref_h, _ = reference_forward(thetas[i], emb, tokens[:, :-1], shape)
        torch.testing.assert_close(hidden[i], ref_h, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(
            losses[i], reference_loss(thetas[i], emb, tokens, shape), rtol=1e-12, atol=1e-12
        )


def test_head_gradient_is_decoder_path_autograd():
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 7, 16, generator=gen, dtype=torch.float64)
    emb = 0.3 * torch.randn(256, 16, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 256, (3, 7), generator=gen)
    e = emb.clone().requires_grad_(True)
    loss = F.cross_entropy((hidden.detach() @ e.T).reshape(-1, 256), targets.reshape(-1))
    (ref,) = torch.autograd.grad(loss, e)
    torch.testing.assert_close(head_gradient(hidden, emb, targets), ref, rtol=1e-12, atol=1e-14)


def test_bad_inputs_fail_clearly():
    shape = ExpertShape(d_embed=8, d_model=8, num_blocks=1)
    layout, thetas, emb, tokens = _setup(shape, p=2, b=2, t=4)
    with pytest.raises(ValueError, match="embedding"):
        batched_loss(thetas, emb[:, :4], tokens, layout)
    with pytest.raises(ValueError, match=r"\(B, T\+1\)"):
        batched_loss(thetas, emb, tokens[:, :1], layout)
    with pytest.raises(ValueError, match="bodies"):
        batched_loss(thetas[:, :-1], emb, tokens, layout)


def test_uint8_windows_read_as_byte_ids():
    shape = ExpertShape(d_embed=8, d_model=8, num_blocks=1)
    layout, thetas, emb, tokens = _setup(shape, p=2, b=2, t=6)
    as_bytes = tokens.to(torch.uint8)
    assert torch.equal(
        batched_loss(thetas, emb, as_bytes, layout), batched_loss(thetas, emb, tokens, layout)
    )
    assert torch.equal(
        body_hidden(thetas, emb, as_bytes[:, :-1], layout),
        body_hidden(thetas, emb, tokens[:, :-1], layout),
    )


@pytest.mark.parametrize("shape", [ExpertShape(), ExpertShape(d_embed=16, d_model=24)])
def test_benchmark_textbook_loop_computes_the_same_losses(shape):
    """The SOMA benchmark's anchor (standard torch.nn modules, one forward per body) must compute
    what the batched forward computes, or its speedup would compare different work."""
    from megatron_ext.bench._soma_textbook import torch_nn_expert, torch_nn_loss_loop

    layout, thetas, emb, tokens = _setup(shape, p=3, b=2, t=9)
    module = torch_nn_expert(layout, torch.float64)
    with torch.no_grad():
        loop = torch_nn_loss_loop(thetas, emb, tokens, layout, module)
    want = torch.stack([reference_loss(th, emb, tokens, shape) for th in thetas])
    torch.testing.assert_close(loop, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        batched_loss(thetas, emb, tokens, layout), want, rtol=1e-10, atol=1e-10
    )
