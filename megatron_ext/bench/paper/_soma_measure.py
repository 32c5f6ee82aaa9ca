"""Measurements at fixed weights for ``megatron-ext bench paper soma``: the SPSA estimator's
variance (monolith vs shards at fixed total size; summed vs independent losses) and routed
inference throughput at equal total size. Built on :mod:`megatron_ext.soma.variance` and
:func:`megatron_ext.soma.evaluate.routed_throughput`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from megatron_ext.bench._soma_inference import D_EMBED, body_numel, width_for_total


def sharded_variance(
    n: int, d: int, blocks: int, windows: np.ndarray, *, batch: int, seq: int, n_pert: int,
    repeats: int, seed: int,
) -> dict[str, float]:  # fmt: skip
    """Relative centered variance ``R = Σ_e tr Cov(ĝ_e) / Σ_e ‖g_e‖²`` (paper App. G.1) of N
    narrow experts of width d, each on its own batch of ``windows`` (float64, fresh bodies of
    ``seed``, ε = 1e-5), against the exact gradient; and the small-ε prediction."""
    import torch

    from megatron_ext.soma import (
        BodyLayout,
        ExpertShape,
        estimator_samples,
        exact_gradient,
        init_body,
        init_embedding,
        predicted_variance,
        sample_batch,
    )
    from megatron_ext.zo import second_moments

    layout = BodyLayout.from_shape(ExpertShape(256, d, d, blocks))
    gen = torch.Generator().manual_seed(seed)
    emb = init_embedding(layout.shape, gen, dtype=torch.float64)
    pool = np.arange(len(windows), dtype=np.int64)
    cov, norm, pred_num = 0.0, 0.0, 0.0
    q = second_moments(layout.gain_mask)
    for e in range(n):
        theta = init_body(layout.shape, gen, dtype=torch.float64)
        tokens = sample_batch(windows, pool, batch, seq, (seed, e, 99))
        g = exact_gradient(theta, emb, tokens, layout)
        s = estimator_samples(
            theta, emb, tokens, layout, n_pert=n_pert, eps=1e-5, repeats=repeats,
            seed=seed, expert=e,
        )  # fmt: skip
        dev = s - s.mean(dim=0)
        cov += float(dev.pow(2).sum()) / (repeats - 1)
        g2 = float(g.pow(2).sum())
        norm += g2
        pred_num += predicted_variance(g, q, n_pert) * g2
    return {"measured": cov / norm, "predicted": pred_num / norm, "d": d, "n": n}


def summed_vs_independent_ratio(
    n: int, d: int, blocks: int, windows: np.ndarray, *, batch: int, seq: int, n_pert: int,
    repeats: int, seed: int,
) -> dict[str, float]:  # fmt: skip
    """:func:`megatron_ext.soma.variance.summed_vs_independent` on N fresh narrow experts of
    width d at fixed weights and batches (paper Fig. 11 left)."""
    import torch

    from megatron_ext.soma import (
        BodyLayout,
        ExpertShape,
        init_body,
        init_embedding,
        sample_batch,
        summed_vs_independent,
    )

    layout = BodyLayout.from_shape(ExpertShape(256, d, d, blocks))
    gen = torch.Generator().manual_seed(seed)
    emb = init_embedding(layout.shape, gen, dtype=torch.float64)
    thetas = torch.stack([init_body(layout.shape, gen, dtype=torch.float64) for _ in range(n)])
    pool = np.arange(len(windows), dtype=np.int64)
    tokens = torch.stack([sample_batch(windows, pool, batch, seq, (seed, e, 7)) for e in range(n)])
    return summed_vs_independent(
        thetas, emb, tokens, layout, n_pert=n_pert, eps=1e-5, repeats=repeats, seed=seed
    )


def throughput(
    n_values: tuple[int, int], blocks: int, windows: np.ndarray, test: np.ndarray,
    *, route_bytes: int, score_bytes: int, rounds: int, seed: int,
) -> dict[str, Any]:  # fmt: skip
    """Routed top-min(4, N) inference tokens/s (routing included, fastest of ``rounds``
    round-robin rounds) of N = n_values[0] and n_values[1] ensembles of about the same total
    parameters, the paper's Table 12 pairing: the larger N at width d_E = 32 (narrow, one shared
    E, like N = 256), the smaller N wide (own head each, like N = 8 at width 181) at the width
    nearest that total (:func:`~megatron_ext.bench._soma_inference.width_for_total`).
    Untrained bodies of ``seed`` (speed does not depend on training); routers fit on
    ``windows``."""
    import torch

    from megatron_ext.soma import (
        BodyLayout,
        ExpertShape,
        RouterConfig,
        fit_router,
        init_body,
        init_embedding,
        routed_throughput,
        window_texts,
    )

    big = n_values[1]
    total = big * body_numel(D_EMBED, blocks)
    texts = window_texts(windows)
    runs = {}
    for n in n_values:
        d = D_EMBED if n == big else width_for_total(n, total, blocks, wide_only=True)
        shape = ExpertShape(256, D_EMBED, d, blocks)
        gen = torch.Generator().manual_seed(seed)
        router, _ = fit_router(texts, RouterConfig(n, svd_dim=32, seed=seed))
        experts = [init_body(shape, gen) for _ in range(n)]
        runs[n] = (router, experts, init_embedding(shape, gen), BodyLayout.from_shape(shape), d)
    best = {n: 0.0 for n in n_values}
    for _ in range(rounds):
        for n, (router, experts, emb, layout, _) in runs.items():
            r = routed_throughput(
                test, router, experts, emb, layout, min(4, n), route_bytes, score_bytes
            )
            best[n] = max(best[n], r["tokens_per_s"])
    return {
        str(n): {"tokens_per_s": best[n], "width": runs[n][4],
                 "params": n * body_numel(runs[n][4], blocks)}
        for n in n_values
    }  # fmt: skip
