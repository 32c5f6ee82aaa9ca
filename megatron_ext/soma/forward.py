"""The batched forward of the SOMA body (:mod:`.model`), streamed over time chunks: ``P``
bodies (P, numel) through one forward with a body axis, each chunk of time steps run eagerly or
as one compiled graph (:mod:`.scan`). The public entry points are in :mod:`.model`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from megatron_ext.soma import native
from megatron_ext.soma.layout import BodyLayout
from megatron_ext.soma.scan import (
    Compiled,
    FusedMode,
    lstm_scan_cells,
    lstm_scan_inplace,
    use_fused,
    use_native,
)

NORM_EPS = 1e-5
# Fastest of 4-64 MiB for batched_loss at d=32, P=128, B=16, T=256 on 2 CPU threads: bigger
# chunks fault in fresh pages on every call. On a GPU, pass a larger max_chunk_bytes.
DEFAULT_MAX_CHUNK_BYTES = 8 * 2**20


def gate_order(d: int, device: torch.device) -> torch.Tensor:
    """Row permutation i, f, g, o -> i, f, o, g: the three sigmoid gates become contiguous."""
    return torch.cat(
        [torch.arange(0, 2 * d), torch.arange(3 * d, 4 * d), torch.arange(2 * d, 3 * d)]
    ).to(device)


def block_weights(
    w: dict[str, torch.Tensor], pre: str, perm: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's matrices for the batched forward, transposed for ``x @ W``: (w_ih_t (P, d, 4d),
    whh_t (P, d, 4d), fc1_t (P, d, 4d), fc2_t (P, 4d, d)). LSTM gates are reordered to
    i, f, o, g with the g columns times 2 (what the scans expect, see
    :func:`~.scan.lstm_scan_inplace`); norm gains are folded into the matrix that follows them,
    (n·g)Wᵀ = n·(W·diag g)ᵀ."""
    d = perm.numel() // 4
    scale = torch.ones(4 * d, 1, dtype=w[f"{pre}.lstm.w_ih"].dtype, device=perm.device)
    scale[3 * d :] = 2.0
    w_ih = w[f"{pre}.lstm.w_ih"][:, perm] * scale * w[f"{pre}.norm1.gain"][:, None, :]
    w_hh = w[f"{pre}.lstm.w_hh"][:, perm] * scale
    fc1 = w[f"{pre}.mlp.fc1"] * w[f"{pre}.norm2.gain"][:, None, :]
    return (
        w_ih.transpose(1, 2),
        w_hh.transpose(1, 2).contiguous(),  # row-major (d, 4d): the per-step baddbmm is faster
        fc1.transpose(1, 2),
        w[f"{pre}.mlp.fc2"].transpose(1, 2),
    )


def row_width(layout: BodyLayout, on_kernels: bool = False) -> int:
    """Widest per-position intermediate (elements): 4d-wide gates / MLP, or the V logits; on
    the C kernels (``on_kernels``) the d-wide block outputs and hidden states (gates, MLP and
    logits stay in per-thread scratch)."""
    shape = layout.shape
    if on_kernels:
        return max(shape.d_model, shape.d_embed)
    return max(4 * shape.d_model, shape.vocab, shape.d_embed)


def chunk_sizes(
    layout: BodyLayout,
    p: int,
    b: int,
    t_len: int,
    dtype: torch.dtype,
    max_chunk_bytes: int,
    on_kernels: bool = False,
) -> tuple[int, int]:
    """(bodies per chunk, time steps per chunk) so that one (bodies, steps·B, width) intermediate
    stays within ``max_chunk_bytes`` (at least one body and one step); ``on_kernels``: the
    forward runs on the C kernels (:func:`row_width`)."""
    row = row_width(layout, on_kernels) * torch.empty((), dtype=dtype).element_size()
    bodies = max(1, min(p, max_chunk_bytes // (b * row)))
    steps = max(1, min(t_len, max_chunk_bytes // (bodies * b * row)))
    return bodies, steps


def check_inputs(
    theta: torch.Tensor, emb: torch.Tensor, inputs: torch.Tensor, layout: BodyLayout
) -> None:
    shape = layout.shape
    if theta.dim() != 2 or theta.shape[1] != layout.numel:
        raise ValueError(
            f"expected bodies of shape (P, {layout.numel}) for {shape}, got {tuple(theta.shape)}"
        )
    if emb.shape != (shape.vocab, shape.d_embed):
        raise ValueError(
            f"embedding must be ({shape.vocab}, {shape.d_embed}), got {tuple(emb.shape)}"
        )
    if inputs.dim() not in (2, 3) or min(inputs.shape) < 1:
        raise ValueError(
            f"input tokens must be (B, T) or per-body (P, B, T) with B, T >= 1, "
            f"got {tuple(inputs.shape)}"
        )
    if inputs.dim() == 3 and inputs.shape[0] != theta.shape[0]:
        raise ValueError(
            f"per-body tokens {tuple(inputs.shape)} need one (B, T) batch per body "
            f"({theta.shape[0]} bodies)"
        )


Blocks = list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]
State = list[tuple[torch.Tensor, torch.Tensor]]


def _body_chunk(
    x: torch.Tensor,
    blocks: Blocks,
    state: State,
    in_proj_t: torch.Tensor | None,
    out_proj_t: torch.Tensor | None,
    gain: torch.Tensor | None,
    scan: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, State]:
    """One chunk of tc time steps through the whole body: embeddings x (1 or P, tc·B, d_E) ->
    (final hidden states (P, tc·B, d_E), each block's carried (h, n) after the chunk).

    ``blocks`` from :func:`block_weights`; ``state[i]`` block i's (h, n), each (P, B, d); a
    wide body has ``in_proj_t`` (P, d_E, d) and ``out_proj_t`` (P, d, d_E) with the final norm's
    gain folded in (``gain`` None), a narrow one only ``gain`` (P, 1, d)."""
    if in_proj_t is not None:
        x = torch.matmul(x, in_proj_t)
    new_state = []
    for (w_ih_t, whh_t, fc1_t, fc2_t), (h, n) in zip(blocks, state, strict=True):
        (p, b, d), rows = h.shape, x.shape[1]
        xw = torch.matmul(F.layer_norm(x, (d,), eps=NORM_EPS), w_ih_t)
        out, h, n = scan(xw.view(p, rows // b, b, 4 * d), whh_t, h, n)
        new_state.append((h, n))
        x = x + out.view(p, rows, d)
        u = F.gelu(torch.bmm(F.layer_norm(x, (d,), eps=NORM_EPS), fc1_t))
        x = torch.baddbmm(x, u, fc2_t)
    hid = F.layer_norm(x, (x.shape[-1],), eps=NORM_EPS)
    return (hid * gain if out_proj_t is None else torch.bmm(hid, out_proj_t)), new_state


def _fused_body_chunk(
    x: torch.Tensor,
    blocks: Blocks,
    state: State,
    in_proj_t: torch.Tensor | None,
    out_proj_t: torch.Tensor | None,
    gain: torch.Tensor | None,
) -> tuple[torch.Tensor, State]:
    """:func:`_body_chunk` with the out-of-place scan: what :data:`_FUSED` compiles into one
    graph (matmuls as library calls, every element-wise run between them -- norms, residuals,
    GELU, the LSTM gates of each step -- fused into loops)."""
    return _body_chunk(x, blocks, state, in_proj_t, out_proj_t, gain, lstm_scan_cells)


_FUSED = Compiled(_fused_body_chunk)


def _native_body_chunk(
    x: torch.Tensor,
    blocks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    state: State,
    in_proj_t: torch.Tensor | None,
    out_proj_t: torch.Tensor | None,
    gain: torch.Tensor | None,
    *,
    d_model: int,
) -> tuple[torch.Tensor, State]:
    """:func:`_body_chunk` with each block one call of the C kernel (:func:`~.native.lstm_block`),
    at the padded width of ``blocks`` (:func:`~.native.pack_block`; the state, gain and a wide
    body's projections zero-padded to it, :func:`hidden_chunks`); the last block also applies
    the final norm. A wide body's projections stay torch. Returns hidden states (P, rows, d_E)
    (a view of the padded ones for a narrow body)."""
    width = blocks[0][0].shape[1] // 2
    if in_proj_t is not None:
        x = torch.matmul(x, in_proj_t)
    elif width > d_model:
        x = F.pad(x, (0, width - d_model))
    new_state = []
    for i, ((wcat, fc1_t, fc2_t), (h, n)) in enumerate(zip(blocks, state, strict=True)):
        last = i == len(blocks) - 1  # the final norm (and gain) in the same pass
        x, h = native.lstm_block(
            x,
            wcat,
            fc1_t,
            fc2_t,
            h,
            n,
            NORM_EPS,
            final_norm=last,
            gain=gain if last else None,
            norm_width=d_model,
        )
        new_state.append((h, n))
    if out_proj_t is not None:
        return torch.bmm(x, out_proj_t), new_state
    return x[..., :d_model], new_state


Kind = str  # "autograd", "compiled", "native" or "eager"


def forward_kind(
    fused: FusedMode, theta: torch.Tensor, emb: torch.Tensor, layout: BodyLayout
) -> Kind:
    """How :func:`hidden_chunks` runs for these arguments: with autograd (the out-of-place
    scan, eagerly) when gradients are wanted; else compiled (:func:`~.scan.use_fused`), the C
    kernels (:func:`~.scan.use_native`, any width: padded to whole vectors) or eager torch (the
    in-place scan)."""
    if torch.is_grad_enabled() and (theta.requires_grad or emb.requires_grad):
        return "autograd"
    if use_fused(fused, theta.device):
        return "compiled"
    return "native" if use_native(fused, theta.device, theta.dtype) else "eager"


def hidden_chunks(
    theta: torch.Tensor,
    emb: torch.Tensor,
    inputs: torch.Tensor,
    layout: BodyLayout,
    steps: int,
    kind: Kind,
) -> Iterator[tuple[int, torch.Tensor]]:
    """Stream the forward over time: yields ``(t0, h)`` with h (P, tc, B, d_E) the final hidden
    states of steps ``t0 .. t0+tc-1`` (time-major inside the chunk).

    Every block only needs its own LSTM state from the previous chunk, so all blocks advance one
    chunk at a time and no intermediate ever spans the whole window. The chunk runs as
    ``kind`` says (:func:`forward_kind`, decided once by the caller, which also sizes the chunks
    by it)."""
    shape = layout.shape
    w = layout.views(theta)
    p, (b, t_len), d, e = theta.shape[0], inputs.shape[-2:], shape.d_model, shape.d_embed
    run: Callable[..., tuple[torch.Tensor, State]] = {
        "autograd": functools.partial(_body_chunk, scan=lstm_scan_cells),
        "compiled": _FUSED,
        "native": _native_body_chunk,
        "eager": functools.partial(_body_chunk, scan=lstm_scan_inplace),
    }[kind]
    perm = gate_order(d, theta.device)
    blocks: list[Any] = [block_weights(w, f"blocks.{i}", perm) for i in range(shape.num_blocks)]
    gain = w["final_norm.gain"][:, None, :]
    in_proj_t, out_proj_t = None, None
    if shape.wide:
        in_proj_t = w["in_proj"].transpose(1, 2)
        out_proj_t, gain = (w["out_proj"] * gain).transpose(1, 2), None
    width = d
    if kind == "native":  # whole vectors of the kernel: the matrices zero-padded
        width = native.padded_width(d)
        blocks = [native.pack_block(*weights, width) for weights in blocks]
        pad = width - d
        if gain is not None:
            gain = F.pad(gain, (0, pad))
        if shape.wide:
            in_proj_t, out_proj_t = F.pad(in_proj_t, (0, pad)), F.pad(out_proj_t, (0, 0, 0, pad))
        run = functools.partial(run, d_model=d)
    state = [(theta.new_zeros(p, b, width), theta.new_zeros(p, b, width)) for _ in blocks]

    # Time-major (1 or P, T, B): shared tokens stay one copy, broadcast by the matmuls.
    per_body = inputs.dim() == 3
    tok_tm = inputs.transpose(-1, -2) if per_body else inputs.T[None]
    if shape.wide:
        # A wide body embeds with its OWN head, tied input/output within the expert (paper:
        # App. C "heads are tied between input and output within an expert"); ``emb`` is not
        # read. Gathered per chunk: (P, tc, B, d_E), never the whole window at once.
        table, body_rows = w["head"], torch.arange(p, device=theta.device)[:, None, None]
    else:
        emb_tm = emb.to(theta.dtype)[tok_tm]  # (1 or P, T, B, d_E)
    for t0 in range(0, t_len, steps):
        tc = min(steps, t_len - t0)
        if shape.wide:
            x = table[body_rows, tok_tm[:, t0 : t0 + tc]].reshape(p, tc * b, e)
        else:
            # (1, tc·B, d) while it is the same for every body (block 0 without in_proj): the
            # first norm is then computed once and broadcast by the matmul.
            x = emb_tm[:, t0 : t0 + tc].reshape(emb_tm.shape[0], tc * b, e)
        hid, state = run(x, blocks, state, in_proj_t, out_proj_t, gain)
        yield t0, hid.view(p, tc, b, e)
