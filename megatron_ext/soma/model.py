"""The SOMA expert: a byte-level pre-norm LSTM body on one flat vector, evaluated for many
perturbed copies at once.

Architecture (one expert, width ``d = d_model``, ``D = num_blocks``, vocabulary ``V``)::

    x = E[tokens]                        (B, T, d_E)      E: the shared tied embedding (V, d_E),
                                                          or a wide body's own head W

    x = x @ in_projᵀ                     (B, T, d)        only when d != d_E
    D times:
        x = x + LSTM(norm1(x))           bias-free, zero initial state per window, gates i, f, g, o
        x = x + fc2 · gelu(fc1 · norm2(x))     d -> 4d -> d, exact (erf) GELU, no biases
    h = final_norm(x)                    (B, T, d)
    h = h @ out_projᵀ                    (B, T, d_E)      only when d != d_E
    logits = h @ Wᵀ                      (B, T, V)        W = E (tied), or the expert's own head
                                                          (tied to its input embedding)

Every norm is a LayerNorm with a gain and no bias (ε = 1e-5). With ``d == d_E`` the body has
exactly ``D·(2d + 16d²) + d`` parameters (32,928 at d = 32, D = 2).

The body lives in ONE flat vector (see :class:`~.layout.BodyLayout`); the forward takes ``P``
of them, ``theta`` (P, numel), and runs all ``P`` bodies through one batched forward (``bmm``
over the perturbation axis, one 4-gate matmul per time step), streamed over chunks of time
steps so that intermediates stay small. Each chunk runs eagerly (the recurrence writing into
preallocated buffers; out of place under autograd) or, with ``fused``, as one compiled graph
(:mod:`.scan`); the streamed forward itself is in :mod:`.forward`. Routed inference uses the
same forward with one batch per body (:func:`target_log_probs`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_ext.soma.forward import (
    DEFAULT_MAX_CHUNK_BYTES,
    NORM_EPS,
    check_inputs,
    chunk_sizes,
    forward_kind,
    hidden_chunks,
)
from megatron_ext.soma.layout import BodyLayout
from megatron_ext.soma.native import head_nll
from megatron_ext.soma.scan import FusedMode

__all__ = [
    "DEFAULT_MAX_CHUNK_BYTES",
    "NORM_EPS",
    "batched_loss",
    "body_hidden",
    "decoder_weight",
    "head_gradient",
    "log_probs",
    "logits",
    "naive_loss_loop",
    "target_log_probs",
]


def body_hidden(
    theta: torch.Tensor,
    emb: torch.Tensor,
    tokens: torch.Tensor,
    layout: BodyLayout,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    fused: FusedMode = "auto",
) -> torch.Tensor:
    """(P, numel) bodies, (V, d_E) embedding, (B, T) byte ids -> (P, B, T, d_E) final hidden
    states (after the final norm, and after ``out_proj`` for a wide body), in ``theta``'s dtype.

    Each of the ``P`` bodies sees the same tokens, or with (P, B, T) tokens each body its own
    batch (routed inference: experts side by side); every window starts from a zero LSTM state.
    A wide body embeds with its own head (its tied embedding/decoder), so ``emb`` is read only
    for narrow bodies.
    Differentiable when ``theta`` or ``emb`` requires grad (and grad mode is on)."""
    check_inputs(theta, emb, tokens, layout)
    tokens = tokens.long()
    b, t_len = tokens.shape[-2:]
    kind = forward_kind(fused, theta, emb, layout)
    p, native = theta.shape[0], kind == "native"
    _, steps = chunk_sizes(layout, p, b, t_len, theta.dtype, max_chunk_bytes, native)
    chunks = hidden_chunks(theta, emb, tokens, layout, steps, kind)
    parts = [h.transpose(1, 2) for _, h in chunks]
    return torch.cat(parts, dim=2)


def decoder_weight(theta: torch.Tensor, emb: torch.Tensor, layout: BodyLayout) -> torch.Tensor:
    """The matrix the logits are taken against: the tied ``emb`` (V, d_E), or for a wide body
    the per-body heads (P, V, d_E)."""
    return layout.views(theta)["head"] if layout.shape.wide else emb.to(theta.dtype)


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(P, ..., d_E) hidden states and (V, d_E) shared or (P, V, d_E) per-body decoder ->
    (P, ..., V) logits ``h·Wᵀ``."""
    if weight.dim() == 2:
        return hidden @ weight.T
    p, e = hidden.shape[0], hidden.shape[-1]
    flat = torch.bmm(hidden.reshape(p, -1, e), weight.transpose(1, 2))
    return flat.view(*hidden.shape[:-1], weight.shape[1])


def log_probs(
    theta: torch.Tensor,
    emb: torch.Tensor,
    tokens: torch.Tensor,
    layout: BodyLayout,
    *,
    fused: FusedMode = "auto",
) -> torch.Tensor:
    """(P, numel), (V, d_E), (B, T) or per-body (P, B, T) inputs -> (P, B, T, V)
    log-probabilities (nats) of the byte following each position."""
    hidden = body_hidden(theta, emb, tokens, layout, fused=fused)
    return F.log_softmax(logits(hidden, decoder_weight(theta, emb, layout)), dim=-1)


def target_log_probs(
    theta: torch.Tensor,
    emb: torch.Tensor,
    tokens: torch.Tensor,
    layout: BodyLayout,
    *,
    start: int = 0,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    fused: FusedMode = "auto",
) -> torch.Tensor:
    """(P, numel) bodies, (V, d_E) embedding, byte windows (B, T+1) shared by every body or
    (P, B, T+1) one batch per body -> (P, B, T − start): the log-probability (nats) of each
    target byte ``tokens[..., t+1]`` after reading ``tokens[..., : t+1]``, for t = start..T−1.

    Positions before ``start`` are read (they set the LSTM state) but never projected to
    logits. Streams over bodies and time so that no intermediate exceeds about
    ``max_chunk_bytes``; small chunks are also what keeps this fast on CPU, since the allocator
    recycles them instead of faulting in fresh pages on every call."""
    if tokens.dim() not in (2, 3) or tokens.shape[-1] < 2:
        raise ValueError(
            f"tokens must be (B, T+1) or per-body (P, B, T+1) with T >= 1, got "
            f"{tuple(tokens.shape)}"
        )
    tokens = tokens.long()  # byte windows may arrive as uint8, which would index as a mask
    inputs = tokens[..., :-1]
    check_inputs(theta, emb, inputs, layout)
    p, (b, t_len) = theta.shape[0], inputs.shape[-2:]
    if not 0 <= start < t_len:
        raise ValueError(f"start={start} must be in 0..{t_len - 1} for {t_len} targets")
    per_body = tokens.dim() == 3
    targets_tm = tokens[..., 1:].transpose(-1, -2)  # (P or 1, T, B) time-major
    targets_tm = targets_tm if per_body else targets_tm[None]
    # The C kernels' head: logits and log-sum-exp per row in cache, never stored.
    kind = forward_kind(fused, theta, emb, layout)
    native = kind == "native"
    bodies, steps = chunk_sizes(layout, p, b, t_len, theta.dtype, max_chunk_bytes, native)
    out = []
    for first in range(0, p, bodies):
        part = theta[first : first + bodies]
        pc, rows = part.shape[0], slice(first, first + bodies) if per_body else slice(None)
        weight = decoder_weight(part, emb, layout)
        if native:
            weight_t = (weight[None] if weight.dim() == 2 else weight).transpose(1, 2)
            weight_t = weight_t.contiguous()  # (1 or pc, E, V), once per part
        cols = []
        for t0, hid in hidden_chunks(part, emb, inputs[rows], layout, steps, kind):
            lo = max(start - t0, 0)  # first scored step of this chunk
            if lo >= hid.shape[1]:
                continue
            y = targets_tm[rows, t0 + lo : t0 + hid.shape[1]]  # (1 or pc, tc', B)
            if native:
                h = hid[:, lo:].reshape(pc, -1, hid.shape[-1])  # a view: rows of a body in order
                ce = head_nll(h, weight_t, y.reshape(y.shape[0], -1))
            else:
                z = logits(hid[:, lo:], weight)  # (pc, tc', B, V)
                y = y.expand(pc, -1, -1).reshape(-1)
                ce = F.cross_entropy(z.reshape(-1, z.shape[-1]), y, reduction="none")
            cols.append(ce.view(pc, -1, b))
        out.append(-torch.cat(cols, dim=1).transpose(1, 2))
    return torch.cat(out)


def batched_loss(
    theta: torch.Tensor,
    emb: torch.Tensor,
    tokens: torch.Tensor,
    layout: BodyLayout,
    *,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    fused: FusedMode = "auto",
) -> torch.Tensor:
    """(P, numel) bodies, (V, d_E) embedding, (B, T+1) byte windows -> (P,) mean next-byte
    cross-entropy in nats over the B·T targets (inputs ``tokens[:, :-1]``, targets
    ``tokens[:, 1:]``), streamed as :func:`target_log_probs` is."""
    if tokens.dim() != 2 or tokens.shape[1] < 2:
        raise ValueError(f"tokens must be (B, T+1) with T >= 1, got {tuple(tokens.shape)}")
    lp = target_log_probs(theta, emb, tokens, layout, max_chunk_bytes=max_chunk_bytes, fused=fused)
    return -lp.mean(dim=(1, 2))


def naive_loss_loop(
    thetas: torch.Tensor,
    emb: torch.Tensor,
    tokens: torch.Tensor,
    layout: BodyLayout,
    *,
    fused: FusedMode = "off",
) -> torch.Tensor:
    """(P, numel) -> (P,): :func:`batched_loss` one body at a time (the per-probe Python loop
    that the batched forward replaces; one of the benchmark's anchors)."""
    return torch.cat(
        [
            batched_loss(thetas[i : i + 1], emb, tokens, layout, fused=fused)
            for i in range(len(thetas))
        ]
    )


def head_gradient(hidden: torch.Tensor, emb: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Exact gradient of the mean cross-entropy w.r.t. the tied decoder, hidden states fixed:
    ``∇_E = (1/BT)·Σ (p − onehot(y))·hᵀ`` with ``p = softmax(h·Eᵀ)``.

    hidden (B, T, d_E), emb (V, d_E), targets (B, T) -> (V, d_E)."""
    h = hidden.reshape(-1, hidden.shape[-1]).to(emb.dtype)
    y = targets.reshape(-1).long()
    if h.shape[0] != y.numel():
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} differ")
    delta = torch.softmax(h @ emb.T, dim=-1)
    delta[torch.arange(y.numel(), device=y.device), y] -= 1.0
    return (delta.T @ h) / y.numel()
