"""Routed evaluation of a SOMA mixture, routed inference throughput, and the unigram baseline.

A window of ``route_bytes + score_bytes + 1`` bytes (1,025 by default) is routed on its first
``route_bytes`` to the ``k`` nearest centroids; each selected expert reads the window from a zero
state, and the mixture's next-byte distribution is the plain average of the selected experts'
distributions. The score is the mean cross-entropy of the last ``score_bytes`` targets, in
nats/byte. Every (window, expert) pair of a batch runs in one batched forward
(:func:`mixture_target_probs`), however many experts there are.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_ext.soma.data import window_texts
from megatron_ext.soma.layout import BodyLayout
from megatron_ext.soma.model import DEFAULT_MAX_CHUNK_BYTES, target_log_probs
from megatron_ext.soma.router import Router
from megatron_ext.soma.scan import FusedMode

# Units per forward call: every time chunk re-reads the gathered weights of its call, so past a
# few hundred small units the weight traffic outgrows what larger batched ops save (N = 256
# experts of width 16, 512 units: 2 calls of 256 measured ~8% faster than 1 call on 2 cores).
MAX_UNITS_PER_CALL = 256


@dataclass(frozen=True)
class EvalResult:
    nats_per_byte: float
    windows: int
    targets: int
    k: int
    expert_load: list[int]  # windows routed to each expert


@dataclass(frozen=True)
class PairPacking:
    """The (window, expert) pairs of a routed batch packed into equal-sized units.

    Unit ``u`` runs expert ``expert[u]`` over the windows ``rows[u]`` (``slot`` of them);
    ``real[u, j]`` is False for padding (a repeat of one of the unit's own windows, never
    scored). All units have the same shape, so one forward with the experts' bodies gathered
    along its batch axis runs every pair of the batch at once."""

    expert: np.ndarray  # (U,) int64
    rows: np.ndarray  # (U, slot) int64 window indices
    real: np.ndarray  # (U, slot) bool

    @property
    def slot(self) -> int:
        return self.rows.shape[1]


def unit_cost_windows(d_model: int) -> float:
    """Fixed cost of one packed unit in windows' worth of work, for experts of width d: each
    unit re-reads its expert's weights (∝ d²) while a window's own work is its d² matmuls plus
    a width-independent part (the 256-way head and softmax, the gates' element-wise passes),
    so the cost grows as d²/(d² + 48²) towards 4 windows. Fitted to the fastest slot of 1..71
    measured on a 2-core CPU at 128 windows, top-4: d = 16 (N = 256) -> 1 window per unit,
    d = 32 (N = 32) -> 5, d = 62 (N = 32) -> 21, d = 128 (N = 8) -> 71 (whole groups)."""
    return 4.0 * d_model**2 / (d_model**2 + 48.0**2)


def slot_size(group_sizes: np.ndarray, unit_cost: float = 1.0) -> int:
    """Windows per unit minimising ``Σ_e ceil(g_e/s)·(s + unit_cost)`` over the experts'
    group sizes ``g_e`` (zeros ignored): the padded windows computed plus a fixed cost per unit
    (:func:`unit_cost_windows`), counted in windows."""
    sizes = group_sizes[group_sizes > 0]
    candidates = np.arange(1, int(sizes.max()) + 1)
    units = np.ceil(sizes[None, :] / candidates[:, None]).sum(axis=1)
    return int(candidates[np.argmin(units * (candidates + unit_cost))])


def pack_pairs(routes: np.ndarray, slot: int | None = None, unit_cost: float = 1.0) -> PairPacking:
    """Pack the pairs of ``routes`` (W, k) expert ids: each expert's windows in order, cut into
    units of ``slot`` windows (default: :func:`slot_size` at ``unit_cost``), the last unit of
    an expert padded by repeating its first window."""
    order = np.argsort(routes.ravel(), kind="stable")
    experts = routes.ravel()[order]
    windows = order // routes.shape[1]
    ids, starts, counts = np.unique(experts, return_index=True, return_counts=True)
    slot = slot or slot_size(counts, unit_cost)
    expert, rows, real = [], [], []
    for e, first, count in zip(ids, starts, counts, strict=True):
        mine = windows[first : first + count]
        n_units = -(-count // slot)
        padded = np.concatenate([mine, np.full(n_units * slot - count, mine[0])])
        expert.append(np.full(n_units, e))
        rows.append(padded.reshape(n_units, slot))
        real.append((np.arange(n_units * slot) < count).reshape(n_units, slot))
    return PairPacking(np.concatenate(expert), np.concatenate(rows), np.concatenate(real))


def mixture_target_probs(
    windows: np.ndarray,
    routes: np.ndarray,
    experts: Sequence[torch.Tensor],
    emb: torch.Tensor,
    layout: BodyLayout,
    route_bytes: int,
    score_bytes: int,
    *,
    slot: int | None = None,
    max_units: int = MAX_UNITS_PER_CALL,
    max_weight_bytes: int = 128 * 2**20,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    fused: FusedMode = "auto",
) -> torch.Tensor:
    """(W, score_bytes) float64 mixture probability of each scored target byte: the average
    over a window's ``k`` routed experts of the probability each gives the target.

    ``windows``: (W, ≥ route_bytes + score_bytes + 1) uint8; ``routes``: (W, k) expert ids;
    ``experts[e]``: (numel,) body of expert e (every expert has ``layout``). The work is grouped
    by expert shape, not by expert: all (window, expert) pairs are packed into equal units
    (:func:`pack_pairs`) and run as ONE batch of bodies, the experts' weights gathered along the
    forward's batch axis, in equal calls of at most ``max_units`` units whose gathered bodies
    fit ``max_weight_bytes``. Only the scored positions are projected to logits."""
    n_in = route_bytes + score_bytes
    tokens = torch.from_numpy(windows[:, : n_in + 1].astype(np.int64))
    pack = pack_pairs(routes, slot, unit_cost_windows(layout.shape.d_model))
    bank = torch.stack(list(experts))
    per_unit = layout.numel * bank.element_size()
    cap = max(1, min(max_units, max_weight_bytes // per_unit))
    calls = -(-len(pack.expert) // cap)
    units = -(-len(pack.expert) // calls)  # equal calls: no small remainder call
    acc = torch.zeros(len(windows) * score_bytes, dtype=torch.float64)
    for first in range(0, len(pack.expert), units):
        sel = slice(first, first + units)
        rows, real = torch.from_numpy(pack.rows[sel]), torch.from_numpy(pack.real[sel])
        lp = target_log_probs(
            bank[torch.from_numpy(pack.expert[sel])],
            emb,
            tokens[rows],
            layout,
            start=route_bytes,
            max_chunk_bytes=max_chunk_bytes,
            fused=fused,
        )  # (units, slot, score_bytes)
        p = lp.double().exp() * real[..., None]
        flat = rows[..., None] * score_bytes + torch.arange(score_bytes)
        acc.index_add_(0, flat.reshape(-1), p.reshape(-1))
    return acc.view(len(windows), score_bytes) / routes.shape[1]


def _route_and_score(
    windows: np.ndarray,
    router: Router,
    experts: Sequence[torch.Tensor],
    emb: torch.Tensor,
    layout: BodyLayout,
    k: int,
    route_bytes: int,
    score_bytes: int,
    fused: FusedMode = "auto",
) -> tuple[np.ndarray, torch.Tensor, float, float]:
    """Route every window on its first ``route_bytes`` and score the next ``score_bytes`` with
    the mixture: (routes (n, k), target probabilities (n, score_bytes), routing seconds, total
    seconds)."""
    t0 = time.perf_counter()
    routes = router.route(window_texts(windows, prefix_bytes=route_bytes), k)
    t1 = time.perf_counter()
    probs = mixture_target_probs(
        windows, routes, experts, emb, layout, route_bytes, score_bytes, fused=fused
    )
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
    fused: FusedMode = "auto",
) -> dict[str, float]:
    """Routed inference over ``windows``, timed end to end (routing included).

    Returns ``tokens_per_s`` (input bytes read per second, each window counted once however many
    experts read it), ``routing_s`` and ``total_s``."""
    with torch.inference_mode():
        _, _, routing_s, total_s = _route_and_score(
            windows, router, experts, emb, layout, k, route_bytes, score_bytes, fused
        )
    tokens = len(windows) * (route_bytes + score_bytes)
    return {"tokens_per_s": tokens / total_s, "routing_s": routing_s, "total_s": total_s}
