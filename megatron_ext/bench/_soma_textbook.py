"""The textbook per-probe loop of ``megatron-ext bench soma``: the SOMA expert as standard
``torch.nn`` modules (``nn.LSTM``, ``nn.LayerNorm``, ``nn.Linear``), each probe's flat body
copied in before its forward -- the anchor the batched SPSA forward is measured against."""

from __future__ import annotations

from typing import Any


def torch_nn_expert(layout: Any, dtype: Any = None) -> Any:
    """The expert body as standard ``torch.nn`` modules (the textbook per-probe loop's model),
    in ``dtype`` (default float32); :func:`load_body` copies one flat body vector into it."""
    import torch

    from megatron_ext.soma import NORM_EPS

    shape = layout.shape
    d, e = shape.d_model, shape.d_embed
    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList()
    for _ in range(shape.num_blocks):
        blk = torch.nn.Module()
        blk.norm1 = torch.nn.LayerNorm(d, eps=NORM_EPS, bias=False)
        blk.lstm = torch.nn.LSTM(d, d, bias=False, batch_first=True)
        blk.norm2 = torch.nn.LayerNorm(d, eps=NORM_EPS, bias=False)
        blk.fc1 = torch.nn.Linear(d, 4 * d, bias=False)
        blk.fc2 = torch.nn.Linear(4 * d, d, bias=False)
        root.blocks.append(blk)
    root.final_norm = torch.nn.LayerNorm(d, eps=NORM_EPS, bias=False)
    if shape.wide:
        root.in_proj = torch.nn.Linear(e, d, bias=False)
        root.out_proj = torch.nn.Linear(d, e, bias=False)
        root.head = torch.nn.Linear(e, shape.vocab, bias=False)
    return root.to(dtype or torch.float32)


def load_body(module: Any, theta: Any, layout: Any) -> None:
    """Copy one (numel,) body vector into :func:`torch_nn_expert`'s parameters."""
    w = {k: v[0] for k, v in layout.views(theta[None]).items()}
    for i, blk in enumerate(module.blocks):
        pre = f"blocks.{i}"
        blk.norm1.weight.copy_(w[f"{pre}.norm1.gain"])
        blk.lstm.weight_ih_l0.copy_(w[f"{pre}.lstm.w_ih"])
        blk.lstm.weight_hh_l0.copy_(w[f"{pre}.lstm.w_hh"])
        blk.norm2.weight.copy_(w[f"{pre}.norm2.gain"])
        blk.fc1.weight.copy_(w[f"{pre}.mlp.fc1"])
        blk.fc2.weight.copy_(w[f"{pre}.mlp.fc2"])
    module.final_norm.weight.copy_(w["final_norm.gain"])
    if layout.shape.wide:
        for name in ("in_proj", "out_proj", "head"):
            getattr(module, name).weight.copy_(w[name])


def torch_nn_loss_loop(thetas: Any, emb: Any, tokens: Any, layout: Any, module: Any) -> Any:
    """(P, numel) bodies -> (P,) mean next-byte cross-entropy, one ``torch.nn`` forward per
    body: the textbook per-probe loop."""
    import torch
    import torch.nn.functional as F

    inputs, targets = tokens[:, :-1].long(), tokens[:, 1:].reshape(-1).long()
    losses = []
    for theta in thetas:
        load_body(module, theta, layout)
        # a wide expert's own head is its tied input embedding
        x = module.in_proj(module.head.weight[inputs]) if layout.shape.wide else emb[inputs]
        for blk in module.blocks:
            x = x + blk.lstm(blk.norm1(x))[0]
            x = x + blk.fc2(F.gelu(blk.fc1(blk.norm2(x))))
        h = module.final_norm(x)
        z = module.head(module.out_proj(h)) if layout.shape.wide else h @ emb.T
        losses.append(F.cross_entropy(z.reshape(-1, z.shape[-1]), targets))
    return torch.stack(losses)
