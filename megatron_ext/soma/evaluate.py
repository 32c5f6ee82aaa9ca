"""Routed evaluation of a SOMA mixture, routed inference throughput, and the unigram baseline.

A window of ``route_bytes + score_bytes + 1`` bytes (1,025 by default) is routed on its first
``route_bytes`` to the ``k`` nearest centroids; each selected expert reads the window from a zero
state, and the mixture's next-byte distribution is the plain average of the selected experts'
distributions. The score is the mean cross-entropy of the last ``score_bytes`` targets, in
nats/byte. Windows are grouped by expert, so each expert runs once over all windows routed to it
(in batches of ``batch_windows``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_ext.soma.data import window_texts
from megatron_ext.soma.layout import BodyLayout
from megatron_ext.soma.model import log_probs
from megatron_ext.soma.router import Router


@dataclass(frozen=True)
class EvalResult:
    nats_per_byte: float
    windows: int
    targets: int
    k: int
    expert_load: list[int]  # windows routed to each expert


def target_probs_by_expert(
    windows: np.ndarray,
    routes: np.ndarray,
    experts: Sequence[torch.Tensor],
    emb: torch.Tensor,
    layout: BodyLayout,
    route_bytes: int,
    score_bytes: int,
    max_chunk_bytes: int = 256 * 2**20,
) -> torch.Tensor:
    """(W, score_bytes) mixture probability of each scored target byte.

    ``windows``: (W, ≥ route_bytes + score_bytes + 1) uint8; ``routes``: (W, k) expert ids;
    ``experts[e]``: (numel,) body of expert e. Requests are grouped by expert and the experts
    run side by side in one forward (each body its own batch, padded to the largest group by
    repeating the group's windows; padding is never scored), as many experts at a time as keep the
    scored log-probabilities within ``max_chunk_bytes``."""
    n_in = route_bytes + score_bytes
    tokens = torch.from_numpy(windows[:, : n_in + 1].astype(np.int64))
    k = routes.shape[1]
    acc = torch.zeros(len(windows), score_bytes, dtype=torch.float64)
    groups = {int(e): np.flatnonzero((routes == e).any(axis=1)) for e in np.unique(routes)}
    width = max(len(rows) for rows in groups.values())
    per_expert = width * n_in * layout.shape.vocab * 4  # fp32 log-probabilities
    chunk = max(1, max_chunk_bytes // per_expert)
    ids = sorted(groups)
    for start in range(0, len(ids), chunk):
        part = ids[start : start + chunk]
        rows = [np.resize(groups[e], width) for e in part]  # pad by repeating the group
        idx = torch.from_numpy(np.stack(rows))  # (E, width)
        thetas = torch.stack([experts[e] for e in part])
        lp = log_probs(thetas, emb, tokens[idx, :n_in], layout)[:, :, route_bytes:]
        tgt = tokens[idx, route_bytes + 1 : n_in + 1]
        p = lp.gather(-1, tgt[..., None])[..., 0].double().exp()  # (E, width, score)
        for i, e in enumerate(part):
            real = len(groups[e])
            acc[idx[i, :real]] += p[i, :real]
    return acc / k


def _route_and_score(
    windows: np.ndarray,
    router: Router,
    experts: Sequence[torch.Tensor],
    emb: torch.Tensor,
    layout: BodyLayout,
    k: int,
    route_bytes: int,
    score_bytes: int,
) -> tuple[np.ndarray, torch.Tensor, float, float]:
    """Route every window on its first ``route_bytes`` and score the next ``score_bytes`` with
    the mixture: (routes (n, k), target probabilities (n, score_bytes), routing seconds, total
    seconds)."""
    t0 = time.perf_counter()
    routes = router.route(window_texts(windows, prefix_bytes=route_bytes), k)
    t1 = time.perf_counter()
    probs = target_probs_by_expert(windows, routes, experts, emb, layout, route_bytes, score_bytes)
    return routes, probs, t1 - t0, time.perf_counter() - t0


def routed_eval(
    windows: np.ndarray,
    router: Router,
    experts: Sequence[torch.Tensor],
    emb: torch.Tensor,
    layout: BodyLayout,
    k: int,
    route_bytes: int = 256,
    score_bytes: int = 768,
) -> EvalResult:
    """Mean cross-entropy (nats/byte) of the top-``k`` routed mixture on ``windows``."""
    routes, probs, _, _ = _route_and_score(
        windows, router, experts, emb, layout, k, route_bytes, score_bytes
    )
    load = np.bincount(routes.ravel(), minlength=len(experts)).tolist()
    return EvalResult(
        nats_per_byte=float(-probs.log().mean()),
        windows=len(windows),
        targets=probs.numel(),
        k=k,
        expert_load=load,
    )


def unigram_entropy(windows: np.ndarray) -> float:
    """Entropy (nats/byte) of the byte histogram of ``windows``: the loss of the best
    context-free predictor fit to exactly these bytes."""
    counts = np.bincount(windows.ravel(), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def routed_throughput(
    windows: np.ndarray,
    router: Router,
    experts: Sequence[torch.Tensor],
    emb: torch.Tensor,
    layout: BodyLayout,
    k: int,
    route_bytes: int = 256,
    score_bytes: int = 768,
) -> dict[str, float]:
    """Routed inference over ``windows``, timed end to end (routing included).

    Returns ``tokens_per_s`` (input bytes read per second, each window counted once however many
    experts read it), ``routing_s`` and ``total_s``."""
    with torch.inference_mode():
        _, _, routing_s, total_s = _route_and_score(
            windows, router, experts, emb, layout, k, route_bytes, score_bytes
        )
    tokens = len(windows) * (route_bytes + score_bytes)
    return {"tokens_per_s": tokens / total_s, "routing_s": routing_s, "total_s": total_s}
