"""Balanced spherical k-means: the one clustering of every router (SOMA's tf-idf router,
DiPaCo's generative routing).

    result = balanced_spherical_kmeans(x, n_clusters=8, seed=0)   # x: (n, d) unit rows
    result.assignment                                              # (n,) int64, balanced

Every cluster holds between :func:`capacity_bounds` points (floor(n/N) or ceil(n/N) at zero
tolerance): a capacity-constrained assignment (:func:`balanced_assign`) replaces the argmax of
Lloyd's algorithm. Deterministic for a given ``seed`` (k-means++ on a Philox stream).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import scipy.sparse

__all__ = [
    "KMeansResult",
    "balanced_assign",
    "balanced_spherical_kmeans",
    "capacity_bounds",
    "unit_rows",
]


def capacity_bounds(n: int, n_clusters: int, tolerance: float = 0.0) -> tuple[int, int]:
    """(lower, upper) cluster sizes for n points in ``n_clusters`` clusters with relative slack
    ``tolerance``: floor(n/N·(1−τ)) and ceil(n/N·(1+τ)); with τ = 0, floor(n/N) and ceil(n/N)."""
    lower, upper = n // n_clusters, -(-n // n_clusters)
    if tolerance > 0:
        lower = min(lower, math.floor(n / n_clusters * (1 - tolerance)))
        upper = max(upper, math.ceil(n / n_clusters * (1 + tolerance)))
    return lower, upper


def balanced_assign(sim: np.ndarray, lower: int, upper: int) -> np.ndarray:
    """Assign each of n points to one of N clusters so that every cluster gets between ``lower``
    and ``upper`` points (exactly; requires N·lower ≤ n ≤ N·upper). Returns (n,) int64.

    ``sim``: (n, N) point-cluster similarities. First a deferred-acceptance round (points
    propose to clusters in order of similarity; a cluster over ``upper`` keeps its most similar
    proposers, ties to the lower index) gives a stable assignment with sizes ≤ upper, in at most
    N rounds. Then each cluster below ``lower``, in index order, takes the points that lose the
    least similarity by moving, from clusters that stay at ≥ ``lower``.
    """
    n, k = sim.shape
    if not k * lower <= n <= k * upper:
        raise ValueError(f"no assignment of {n} points to {k} clusters of {lower}..{upper}")
    rows = np.arange(n)
    preference = np.argsort(-sim, axis=1, kind="stable")
    proposals = np.zeros(n, dtype=np.int64)
    assign = np.full(n, -1, dtype=np.int64)
    while (free := np.flatnonzero(assign < 0)).size:
        assign[free] = preference[free, proposals[free]]
        proposals[free] += 1
        if np.bincount(assign, minlength=k).max() <= upper:
            break
        order = np.lexsort((rows, -sim[rows, assign], assign))  # by cluster, best first
        clusters = assign[order]
        rank = np.arange(n) - np.searchsorted(clusters, clusters)
        assign[order[rank >= upper]] = -1
    counts = np.bincount(assign, minlength=k)
    for c in np.flatnonzero(counts < lower):
        cost = sim[rows, assign] - sim[:, c]
        candidates = np.flatnonzero(counts[assign] > lower)
        candidates = candidates[np.lexsort((candidates, cost[candidates]))]
        donors = assign[candidates]
        by_donor = np.argsort(donors, kind="stable")
        rank = np.empty(len(candidates), dtype=np.int64)
        sorted_donors = donors[by_donor]
        rank[by_donor] = np.arange(len(candidates)) - np.searchsorted(sorted_donors, sorted_donors)
        moved = candidates[rank < counts[donors] - lower][: lower - counts[c]]
        assign[moved] = c
        counts = np.bincount(assign, minlength=k)
    return assign


class KMeansResult(NamedTuple):
    """Outcome of :func:`balanced_spherical_kmeans`; ``converged``: the last assignment repeated."""

    centroids: np.ndarray  # (N, d) unit rows
    assignment: np.ndarray  # (n,) int64
    n_iter: int
    converged: bool


def balanced_spherical_kmeans(
    x: np.ndarray, n_clusters: int, *, tolerance: float = 0.0, max_iter: int = 100, seed: int = 0
) -> KMeansResult:
    """Spherical k-means of ``x`` ((n, d), unit or zero rows) with capacity-constrained
    assignments: every cluster holds between the :func:`capacity_bounds` sizes, i.e.
    floor(n/N) or ceil(n/N) points when ``tolerance`` is 0 (guaranteed, not approximate).

    Seeding is k-means++ (squared Euclidean distance, Philox stream keyed by ``seed``); each
    iteration assigns with :func:`balanced_assign` on cosine similarity and moves every centroid
    to the normalised mean of its points, until the assignment repeats or ``max_iter``.
    """
    n, d = x.shape
    if not 1 <= n_clusters <= n:
        raise ValueError(f"cannot make {n_clusters} clusters of {n} points")
    lower, upper = capacity_bounds(n, n_clusters, tolerance)
    basis = np.eye(d)[np.arange(n_clusters) % d]  # stands in for a zero seed row
    centroids = unit_rows(x[_kmeanspp(x, n_clusters, seed)], fallback=basis)
    assign = np.full(n, -1, dtype=np.int64)
    for iteration in range(1, max_iter + 1):
        new = balanced_assign(x @ centroids.T, lower, upper)
        if np.array_equal(new, assign):
            return KMeansResult(centroids, assign, iteration, True)
        assign = new
        members = scipy.sparse.csr_matrix((np.ones(n), (assign, np.arange(n))), (n_clusters, n))
        centroids = unit_rows(np.asarray(members @ x), fallback=centroids)
    return KMeansResult(centroids, assign, max_iter, False)


def _kmeanspp(x: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k-means++ seed indices: the first uniform, each next with probability ∝ squared
    distance to the nearest seed so far (uniform when all distances are 0)."""
    rng = np.random.Generator(np.random.Philox(seed))
    sq = np.einsum("ij,ij->i", x, x)
    seeds = [int(rng.integers(len(x)))]
    dist = np.full(len(x), np.inf)
    for _ in range(1, k):
        c = x[seeds[-1]]
        dist = np.minimum(dist, np.maximum(sq + sq[seeds[-1]] - 2 * (x @ c), 0.0))
        dist[seeds] = 0.0
        total = dist.sum()
        p = dist / total if total > 0 else np.where(np.isin(np.arange(len(x)), seeds), 0.0, 1.0)
        seeds.append(int(rng.choice(len(x), p=p / p.sum())))
    return np.asarray(seeds)


def unit_rows(m: np.ndarray, fallback: np.ndarray) -> np.ndarray:
    """Rows of ``m`` scaled to unit length; a zero row takes the fallback's row instead."""
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    return np.where(norms > 0, m / np.where(norms > 0, norms, 1.0), fallback)
