"""Coarse routing: documents to paths from features of their prefix (base model hidden states).

- Generative: product k-means (paper: Sec. 7.3 / Table 5, the multi-level baseline). The
  centred features are split into contiguous sub-vectors, one per level with K_l > 1 (a level of
  one module chooses nothing and gets no columns); level l's sub-vectors
  (unit-normalised) get their own balanced spherical k-means with k = K_l
  (:mod:`megatron_ext.data.clustering`, the one k-means of every router), whose cluster e is
  module (l, e). Path p = (e_0, ..., e_{L-1}) is the product of its modules' clusters; a
  document's score for p is the sum over levels of its sub-vector's cosine similarity to
  centroid (l, e_l). So the paths that share a module share that level's cluster, and which
  documents a module sees follows cluster similarity. With one level it is flat k-means, k = P.
- Discriminative: every path scores every router document; its target is the path with the
  lowest loss; a multinomial logistic regression (scikit-learn) on the standardised features
  predicts it; then a per-path bias (:func:`fit_frequency_bias`) makes the predicted path
  frequencies (argmax) match the targets' frequencies. Without the bias a regression trained on
  imbalanced targets predicts the minority paths for almost no document, so they get no data.

:meth:`Router.route` gives each document its top-k paths (best first; ties to the lower id):
top-2 overlapping shards for training, top-1 at evaluation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from sklearn.linear_model import LogisticRegression

from megatron_ext.data.clustering import balanced_spherical_kmeans, unit_rows

__all__ = ["Router", "fit_discriminative", "fit_frequency_bias", "fit_generative", "shards"]

_NEVER = -1e9  # the bias of a path that no router document prefers


@dataclass
class Router:
    """``mean``/``scale``: (h,) feature standardisation. Generative: ``weights`` (P, h), row p
    the unit centroids of p's modules side by side (level l's in columns ``segments[l] ..
    segments[l+1]``), ``intercept`` and ``bias`` zero. Discriminative: ``weights`` (P, h)
    regression coefficients, ``intercept`` (P,), ``bias`` (P,) the frequency correction.
    ``segments``: (L + 1,) column bounds of the sub-vectors each normalised on its own
    (generative; discriminative: [0, h], unused)."""

    kind: str
    mean: np.ndarray
    scale: np.ndarray
    weights: np.ndarray
    intercept: np.ndarray
    bias: np.ndarray
    segments: np.ndarray

    @property
    def num_paths(self) -> int:
        return self.weights.shape[0]

    def scores(self, features: np.ndarray, *, with_bias: bool = True) -> np.ndarray:
        """(n, P) float64 scores of (n, h) features (higher = better path)."""
        x = (np.asarray(features, dtype=np.float64) - self.mean) / self.scale
        if self.kind == "generative":
            x = _unit_segments(x, self.segments)
        z = x @ self.weights.T + self.intercept
        return z + self.bias if with_bias else z

    def route(self, features: np.ndarray, k: int = 1, *, with_bias: bool = True) -> np.ndarray:
        """(n, k) int64 best paths per document, best first."""
        z = self.scores(features, with_bias=with_bias)
        return np.argsort(-z, axis=1, kind="stable")[:, :k].astype(np.int64)

    def to_arrays(self) -> dict[str, np.ndarray]:
        return {
            "kind": np.array(self.kind),
            **{k: getattr(self, k) for k in _ARRAYS},
        }

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Router:
        return cls(str(arrays["kind"]), *(np.asarray(arrays[k]) for k in _ARRAYS))


_ARRAYS = ("mean", "scale", "weights", "intercept", "bias", "segments")


def _unit_segments(x: np.ndarray, segments: np.ndarray) -> np.ndarray:
    """(n, h) rows with each column segment scaled to unit norm (zero segments stay zero)."""
    out = np.empty_like(x)
    for a, b in itertools.pairwise(segments.tolist()):
        out[:, a:b] = unit_rows(x[:, a:b], fallback=np.zeros_like(x[:, a:b]))
    return out


def fit_generative(
    features: np.ndarray, modules_per_level: Sequence[int], *, max_iter: int, seed: int
) -> tuple[Router, np.ndarray]:
    """Product k-means of (n, h) features over the levels' K_l (see the module docstring);
    returns (router, (n,) path of each fitting document: the product of its balanced cluster at
    each level, so every module (l, e) gets floor(n/K_l) or ceil(n/K_l) of them)."""
    x = np.asarray(features, dtype=np.float64)
    n, h = x.shape
    ks = [int(k) for k in modules_per_level]
    # the columns go to the levels that choose (K_l > 1); a level of one module gets none
    choosing = [level for level, k in enumerate(ks) if k > 1] or [0]
    if h < len(choosing):
        raise ValueError(f"{h} feature columns cannot be split over {len(choosing)} levels")
    widths = dict(zip(choosing, map(len, np.array_split(np.arange(h), len(choosing))), strict=True))
    segments = np.array([0, *np.cumsum([widths.get(level, 0) for level in range(len(ks))])])
    mean = x.mean(0)
    unit = _unit_segments(x - mean, segments)
    num_paths = math.prod(ks)
    weights, path = np.zeros((num_paths, h)), np.zeros(n, dtype=np.int64)
    # digit of level l in path p: (p // stride_l) % K_l, level 0 most significant (layout)
    strides = [math.prod(ks[level + 1 :]) for level in range(len(ks))]
    for level, (k, (a, b)) in enumerate(zip(ks, itertools.pairwise(segments), strict=True)):
        if k == 1:  # one module: every document's digit is 0, nothing to cluster
            continue
        result = balanced_spherical_kmeans(unit[:, a:b], k, max_iter=max_iter, seed=seed + level)
        digits = (np.arange(num_paths) // strides[level]) % k
        weights[:, a:b] = result.centroids[digits]
        path += result.assignment * strides[level]
    zeros = np.zeros(num_paths)
    router = Router("generative", mean, np.ones(h), weights, zeros, zeros.copy(), segments)
    return router, path


def fit_discriminative(
    features: np.ndarray, losses: np.ndarray, *, max_iter: int, seed: int
) -> Router:
    """Logistic regression from (n, h) router-document features to each document's best path
    ((n, P) ``losses``: every path's loss on every router document), with the frequency bias."""
    x = np.asarray(features, dtype=np.float64)
    n, num_paths = losses.shape
    targets = np.argmin(losses, axis=1)
    mean, scale = x.mean(0), x.std(0) + 1e-8
    weights, intercept = np.zeros((num_paths, x.shape[1])), np.full(num_paths, _NEVER)
    classes = np.unique(targets)
    if len(classes) == 1:  # one path wins everywhere: nothing to regress
        intercept[classes[0]] = 0.0
    else:
        lr = LogisticRegression(max_iter=max_iter, random_state=seed)
        lr.fit((x - mean) / scale, targets)
        coef, icpt = lr.coef_, lr.intercept_
        if len(classes) == 2:  # sklearn's binary form: one row for the second class
            coef, icpt = np.vstack([-coef / 2, coef / 2]), np.array([-icpt[0] / 2, icpt[0] / 2])
        weights[lr.classes_], intercept[lr.classes_] = coef, icpt
    segments = np.array([0, x.shape[1]])
    router = Router(
        "discriminative", mean, scale, weights, intercept, np.zeros(num_paths), segments
    )
    target_freq = np.bincount(targets, minlength=num_paths) / n
    router.bias = fit_frequency_bias(router.scores(x, with_bias=False), target_freq)
    return router


def fit_frequency_bias(
    logits: np.ndarray, target_freq: np.ndarray, *, sweeps: int = 50
) -> np.ndarray:
    """A (P,) bias b such that the frequencies of argmax(logits + b) over the n rows match
    ``target_freq`` (P,) as closely as found (to one row per path when reachable).

    Coordinate sweeps: for each path j in turn, with the other biases fixed, path j wins row i
    iff its margin z_ij + b_j − max_{k≠j}(z_ik + b_k) is positive, so b_j is set between the
    c-th and (c+1)-th largest margins, c = round(f_j · n) (the dual variables of a
    capacity-constrained assignment, found as in an auction). The bias with the smallest
    Σ|q − f| over the sweeps is returned; a path with f = 0 never wins a row."""
    z = np.asarray(logits, dtype=np.float64)
    n, p = z.shape
    f = np.asarray(target_freq, dtype=np.float64)
    want = np.rint(f * n).astype(np.int64)
    bias = np.zeros(p)
    if p == 1:  # one path takes every row
        return bias

    def error(b: np.ndarray) -> float:
        q = np.bincount(np.argmax(z + b, axis=1), minlength=p) / n
        return float(np.abs(q - f).sum())

    best, best_err = bias.copy(), error(bias)
    for _ in range(sweeps):
        for j in range(p):
            others = np.delete(z + bias, j, axis=1).max(axis=1)
            margin = np.sort(z[:, j] - others)[::-1]  # without b_j, descending
            c = want[j]
            if c <= 0:
                bias[j] = -margin[0] - 1.0
            elif c >= n:
                bias[j] = -margin[-1] + 1.0
            else:
                bias[j] = -(margin[c - 1] + margin[c]) / 2
        err = error(bias)
        if err < best_err:
            best, best_err = bias.copy(), err
        if best_err <= p / n:
            break
    return best


def shards(routes: np.ndarray, docs: np.ndarray, num_paths: int) -> list[np.ndarray]:
    """Each path's documents: ``routes`` (n, k) top-k paths of the documents ``docs`` (n,)."""
    return [np.sort(docs[(routes == p).any(axis=1)]) for p in range(num_paths)]
