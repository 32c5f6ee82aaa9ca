"""SOMA's clustering router: tf-idf → truncated SVD → centre → L2-normalise → balanced spherical
k-means into N clusters; texts are routed to their most cosine-similar centroids.

    router, assignment = fit_router(window_texts(windows), RouterConfig(n_clusters=8))
    router.save("runs/soma/router.pkl")                      # one file, written atomically
    top = Router.load("runs/soma/router.pkl").route(window_texts(test, prefix_bytes=256))

The tf-idf is word level (sklearn's default token pattern, lower-cased, English stop words
removed, sublinear tf). The paper used max_features=50,000 and min_df=5 on a large corpus; when
``RouterConfig`` leaves them None they scale with the number of fitting texts n
(:func:`scaled_max_features`, :func:`scaled_min_df`) so that a 1k-window corpus keeps a
useful vocabulary and a 1M-document one gets the paper's values.

The artifact is a pickle: load only files you wrote yourself.
"""

from __future__ import annotations

import math
import os
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.sparse
import sklearn
from sklearn.decomposition import TruncatedSVD
from sklearn.feature_extraction.text import TfidfVectorizer

from megatron_ext.atomic import atomic_path
from megatron_ext.data.clustering import (  # noqa: F401  (re-exported: the tests import them here)
    KMeansResult,
    balanced_assign,
    balanced_spherical_kmeans,
    capacity_bounds,
    unit_rows,
)
from megatron_ext.errors import ConfigError

ROUTER_FORMAT = "megatron-ext/soma-router"
ROUTER_VERSION = 1
DEFAULT_TOP_K = 4  # route to min(4, N) experts unless told otherwise
PAPER_MAX_FEATURES = 50_000
PAPER_MIN_DF = 5
HOW_TO_MAKE = (
    "train the run first (`megatron-ext launch RECIPE` fits and saves the router before the "
    "seed run), or set soma.router to an existing artifact"
)


def scaled_max_features(n_docs: int) -> int:
    """Vocabulary size for ``n_docs`` fitting texts: 50·√n clamped to [1,000, 50,000].

    Vocabulary grows roughly like √(corpus size) (Heaps' law), and 50·√n reaches the paper's
    50,000 at n = 1M: 1.6k windows → 2,000 words, 100k → 15,811."""
    return min(PAPER_MAX_FEATURES, max(1_000, int(50 * math.sqrt(n_docs) + 0.5)))


def scaled_min_df(n_docs: int) -> int:
    """Minimum document frequency for ``n_docs`` fitting texts: 1 below 100 texts, else
    round(n / 20,000) clamped to [2, 5] (the paper's 5 from 90k texts on).

    A word seen in one text cannot make two texts similar, so from 100 texts on it is dropped."""
    if n_docs < 100:
        return 1
    return min(PAPER_MIN_DF, max(2, int(n_docs / 20_000 + 0.5)))


@dataclass(frozen=True)
class RouterConfig:
    """How to fit the router.

    n_clusters: N, the number of experts. svd_dim: embedding size (the SVD keeps
    min(svd_dim, n_features − 1) components). max_features / min_df: tf-idf vocabulary limits,
    None = scaled with the corpus (see the module docstring). balance_tolerance: relative slack
    τ of the cluster sizes, every cluster gets between floor(n/N·(1−τ)) and ceil(n/N·(1+τ))
    texts; 0 = exact balance, floor(n/N) or ceil(n/N). max_iter: k-means iterations at most.
    seed: k-means++ seeding and the randomized SVD.
    """

    n_clusters: int
    svd_dim: int = 128
    max_features: int | None = None
    min_df: int | None = None
    balance_tolerance: float = 0.0
    max_iter: int = 100
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n_clusters < 1:
            raise ConfigError(f"n_clusters={self.n_clusters}: need at least one cluster")
        if self.svd_dim < 1 or self.max_iter < 1:
            raise ConfigError(f"svd_dim={self.svd_dim} and max_iter={self.max_iter} must be ≥ 1")
        if not 0.0 <= self.balance_tolerance < 1.0:
            raise ConfigError(f"balance_tolerance={self.balance_tolerance} must be in [0, 1)")


@dataclass
class Router:
    """A fitted router. ``mean``: (d,) mean SVD embedding of the fitting texts;
    ``centroids``: (N, d) unit rows; d = ``svd.n_components``."""

    vectorizer: TfidfVectorizer
    svd: TruncatedSVD
    mean: np.ndarray
    centroids: np.ndarray

    @property
    def n_clusters(self) -> int:
        return self.centroids.shape[0]

    def embed(self, texts: list[str]) -> np.ndarray:
        """(n, d) float64 embeddings: tf-idf → SVD → minus ``mean`` → unit length. A text with
        no vocabulary word (e.g. empty) has no evidence for any cluster and embeds as the zero
        vector (so :meth:`route` ranks it 0, 1, 2, ...)."""
        if not texts:  # sklearn refuses an empty batch
            return np.zeros((0, self.mean.shape[0]))
        return _embed(self.vectorizer.transform(texts), self.svd, self.mean)

    def route(self, texts: list[str], k: int | None = None) -> np.ndarray:
        """(n, k) int64 cluster ids of the k centroids most cosine-similar to each text, best
        first, ties to the lower id. ``k`` defaults to min(4, N); k outside 1..N raises
        ``ConfigError``."""
        k = min(DEFAULT_TOP_K, self.n_clusters) if k is None else k
        if not 1 <= k <= self.n_clusters:
            raise ConfigError(
                f"top-k={k} must be between 1 and the number of experts N={self.n_clusters}"
            )
        sim = self.embed(texts) @ self.centroids.T
        return np.argsort(-sim, axis=1, kind="stable")[:, :k].astype(np.int64)

    def save(self, path: str | os.PathLike) -> Path:
        """Write the router to ``path`` as one pickle file (a temporary file in the same
        folder, then renamed over ``path``, so a crash never leaves a half-written router)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": ROUTER_FORMAT,
            "version": ROUTER_VERSION,
            "sklearn_version": sklearn.__version__,
            "vectorizer": self.vectorizer,
            "svd": self.svd,
            "mean": self.mean,
            "centroids": self.centroids,
        }
        with atomic_path(path) as tmp, open(tmp, "wb") as stream:
            pickle.dump(payload, stream, protocol=pickle.HIGHEST_PROTOCOL)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Router:
        """Read a router written by :meth:`save`; ``ConfigError`` when the file is missing,
        unreadable, not a router, or of another format version."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"router artifact {path} not found; {HOW_TO_MAKE}")
        try:
            with path.open("rb") as stream:
                payload = pickle.load(stream)
        except Exception as exc:  # a damaged pickle can raise almost anything
            raise ConfigError(
                f"router artifact {path} is corrupt ({type(exc).__name__}: {exc}); {HOW_TO_MAKE}"
            ) from exc
        if not isinstance(payload, dict) or payload.get("format") != ROUTER_FORMAT:
            raise ConfigError(f"{path} is not a SOMA router artifact; {HOW_TO_MAKE}")
        if payload.get("version") != ROUTER_VERSION:
            raise ConfigError(
                f"router artifact {path} has format version {payload.get('version')}, this code "
                f"reads version {ROUTER_VERSION}; refit it: {HOW_TO_MAKE}"
            )
        router = cls(payload["vectorizer"], payload["svd"], payload["mean"], payload["centroids"])
        if not router._consistent():
            raise ConfigError(
                f"router artifact {path} is corrupt (inconsistent parts); {HOW_TO_MAKE}"
            )
        return router

    def _consistent(self) -> bool:
        if not isinstance(self.vectorizer, TfidfVectorizer) or not isinstance(
            self.svd, TruncatedSVD
        ):
            return False
        if not hasattr(self.vectorizer, "vocabulary_") or not hasattr(self.svd, "components_"):
            return False
        d = self.svd.components_.shape[0]
        c, m = self.centroids, self.mean
        return (
            isinstance(c, np.ndarray)
            and isinstance(m, np.ndarray)
            and c.ndim == 2
            and c.shape[0] >= 1
            and c.shape[1] == d
            and m.shape == (d,)
            and bool(np.all(np.isfinite(c)) and np.all(np.isfinite(m)))
            and np.allclose(np.linalg.norm(c, axis=1), 1.0)
        )


def _embed(tfidf: scipy.sparse.spmatrix, svd: TruncatedSVD, mean: np.ndarray) -> np.ndarray:
    z = svd.transform(tfidf) - mean
    z[tfidf.getnnz(axis=1) == 0] = 0.0
    return unit_rows(z, fallback=np.zeros_like(z))


def fit_router(texts: list[str], cfg: RouterConfig) -> tuple[Router, np.ndarray]:
    """Fit the router on ``texts`` and cluster them; returns (router, (n,) int64 cluster id of
    each text). Cluster sizes obey :func:`capacity_bounds` (floor(n/N) or ceil(n/N) at
    ``balance_tolerance`` 0). Raises ``ConfigError`` when there are fewer texts than clusters or
    too little vocabulary to embed."""
    n = len(texts)
    if n < cfg.n_clusters:
        raise ConfigError(
            f"N={cfg.n_clusters} clusters need at least {cfg.n_clusters} texts, got {n}"
        )
    vectorizer = TfidfVectorizer(
        sublinear_tf=True,
        stop_words="english",
        max_features=cfg.max_features or scaled_max_features(n),
        min_df=cfg.min_df or scaled_min_df(n),
        dtype=np.float64,
    )
    try:
        tfidf = vectorizer.fit_transform(texts)
    except ValueError as exc:  # empty vocabulary, min_df above the number of texts
        raise ConfigError(f"cannot build the router's tf-idf vocabulary: {exc}") from exc
    n_features = tfidf.shape[1]
    if n_features < 2:
        raise ConfigError(f"the router's vocabulary has {n_features} word(s); add text")
    svd = TruncatedSVD(n_components=min(cfg.svd_dim, n_features - 1), random_state=cfg.seed)
    z = svd.fit_transform(tfidf)
    mean = z[tfidf.getnnz(axis=1) > 0].mean(axis=0)
    x = _embed(tfidf, svd, mean)
    result = balanced_spherical_kmeans(
        x, cfg.n_clusters, tolerance=cfg.balance_tolerance, max_iter=cfg.max_iter, seed=cfg.seed
    )
    return Router(vectorizer, svd, mean, result.centroids), result.assignment
