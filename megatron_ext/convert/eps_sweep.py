"""Sensitivity of a model's logits to the RMSNorm epsilon (``megatron-ext tools eps-sweep``).

Every norm of the megatron-core model gets ``multiple * epsilon`` in turn; the last-position
logits are compared with those at the correct epsilon (cosine, averaged over sequences, and the
fraction of sequences with the same argmax). A model whose hidden variance is near the epsilon
peaks at 1x and falls off at 0.1x; one with variance far above it is flat.
"""

from __future__ import annotations

import csv
from pathlib import Path

import torch

from megatron_ext.atomic import save_figure
from megatron_ext.convert.parity import mcore_logits

MULTIPLES = (0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0, 100.0)


def _set_eps(model: torch.nn.Module, eps: float) -> None:
    for module in model.modules():
        if isinstance(getattr(module, "eps", None), float):
            module.eps = eps


def eps_sweep(
    gpt: torch.nn.Module, eps: float, tokens: torch.Tensor, multiples: tuple[float, ...] = MULTIPLES
) -> list[dict[str, float]]:
    """One row per multiple: ``multiple``, ``epsilon``, ``cosine``, ``argmax_agreement``
    of the last-position logits [b, vocab] against the model at ``eps``."""
    _set_eps(gpt, eps)
    ref = mcore_logits(gpt, tokens)[:, -1].double()
    rows = []
    try:
        for multiple in multiples:
            _set_eps(gpt, eps * multiple)
            got = mcore_logits(gpt, tokens)[:, -1].double()
            cosine = torch.nn.functional.cosine_similarity(ref, got, dim=-1).mean()
            agree = (ref.argmax(-1) == got.argmax(-1)).double().mean()
            rows.append(
                {
                    "multiple": multiple,
                    "epsilon": eps * multiple,
                    "cosine": float(cosine),
                    "argmax_agreement": float(agree),
                }
            )
    finally:
        _set_eps(gpt, eps)
    return rows


def write_sweep(rows: list[dict[str, float]], out: Path, title: str) -> tuple[Path, Path]:
    """``out``.csv and ``out``.png (cosine and argmax agreement against the multiple, log x)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.parent.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out.with_suffix(".csv"), out.with_suffix(".png")
    with csv_path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    x = [r["multiple"] for r in rows]
    ax.semilogx(x, [r["cosine"] for r in rows], "o-", label="cosine (last position)")
    ax.semilogx(x, [r["argmax_agreement"] for r in rows], "s--", label="argmax agreement")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("epsilon / correct epsilon")
    ax.set_title(title)
    ax.legend()
    save_figure(fig, png_path, dpi=120)
    return csv_path, png_path
