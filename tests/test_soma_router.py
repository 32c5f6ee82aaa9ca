"""SOMA router: tf-idf → SVD → balanced spherical k-means; routing, artifact, balance."""

from __future__ import annotations

import pickle
import string

import numpy as np
import pytest
from sklearn.cluster import KMeans
from sklearn.feature_extraction.text import TfidfVectorizer
from threadpoolctl import threadpool_limits

from megatron_ext.errors import ConfigError
from megatron_ext.soma.data import window_texts
from megatron_ext.soma.router import (
    Router,
    RouterConfig,
    balanced_assign,
    balanced_spherical_kmeans,
    capacity_bounds,
    fit_router,
    scaled_max_features,
    scaled_min_df,
)

TOPICS = 4
WINDOW = 512


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    """numpy and scipy each bring an OpenBLAS pool; on a busy 2-core host their spinning
    threads slow the small SVDs here ~100x (seconds instead of ms). Results do not depend on it."""
    with threadpool_limits(limits=1):
        yield


def _pseudo_words(rng: np.random.Generator, count: int) -> list[str]:
    letters = np.array(list(string.ascii_lowercase))
    return ["".join(rng.choice(letters, size=rng.integers(4, 9))) for _ in range(count)]


def _topic_windows(sizes: list[int], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(n, WINDOW) uint8 byte windows of synthetic documents and their (n,) topic labels.

    Topic t draws 85% of its words from its own list of 80 pseudo-words (the lists are
    disjoint) and 15% from a list of 200 words shared by all topics."""
    rng = np.random.default_rng(0)  # the vocabulary is fixed; ``seed`` picks the documents
    words = list(dict.fromkeys(_pseudo_words(rng, 2000)))
    lists = [words[80 * t : 80 * (t + 1)] for t in range(TOPICS)]
    shared = words[80 * TOPICS : 80 * TOPICS + 200]
    rng = np.random.default_rng(seed)
    rows, labels = [], []
    for topic, size in enumerate(sizes):
        for _ in range(size):
            own = rng.random(120) < 0.85
            text = " ".join(
                lists[topic][rng.integers(80)] if o else shared[rng.integers(200)] for o in own
            )
            data = text.encode("utf-8")[:WINDOW].ljust(WINDOW, b" ")
            rows.append(np.frombuffer(data, dtype=np.uint8))
            labels.append(topic)
    return np.stack(rows), np.asarray(labels)


@pytest.fixture(scope="module")
def fitted():
    windows, labels = _topic_windows([101, 100, 100, 100], seed=1)
    texts = window_texts(windows)
    router, assignment = fit_router(texts, RouterConfig(n_clusters=TOPICS, seed=0))
    return router, assignment, labels, texts


def test_topics_are_recovered_with_balanced_sizes(fitted):
    router, assignment, labels, _ = fitted
    assert assignment.shape == labels.shape
    sizes = np.bincount(assignment, minlength=TOPICS)
    assert sizes.min() >= 100 and sizes.max() <= 101  # floor / ceil of 401 / 4
    majority = sum(np.bincount(labels[assignment == c]).max() for c in range(TOPICS))
    assert majority / len(labels) >= 0.95
    assert router.centroids.shape == (TOPICS, router.mean.shape[0])
    assert np.allclose(np.linalg.norm(router.centroids, axis=1), 1.0)


def test_fit_is_deterministic(fitted):
    router, assignment, _, texts = fitted
    again, assignment2 = fit_router(texts, RouterConfig(n_clusters=TOPICS, seed=0))
    assert np.array_equal(assignment, assignment2)
    assert np.array_equal(router.centroids, again.centroids)


def _reference_routes(
    router: Router, fit_texts: list[str], texts: list[str], k: int
) -> list[list[int]]:
    """Route with numpy from scratch: a freshly fitted sklearn tf-idf with the documented
    settings, projection on the saved SVD components, centring by the saved mean, cosine
    similarity to the saved centroids, ranked best first with ties to the lower index."""
    fresh = TfidfVectorizer(
        sublinear_tf=True,
        stop_words="english",
        max_features=scaled_max_features(len(fit_texts)),
        min_df=scaled_min_df(len(fit_texts)),
    )
    fresh.fit(fit_texts)
    assert fresh.vocabulary_ == router.vectorizer.vocabulary_
    tfidf = fresh.transform(texts).toarray().astype(np.float64)
    routes = []
    for row in tfidf:
        if not row.any():  # no known word: the zero embedding, every similarity 0
            sims = np.zeros(len(router.centroids))
        else:
            z = row @ router.svd.components_.T - router.mean
            z /= np.sqrt((z * z).sum())
            sims = router.centroids @ z / np.sqrt((router.centroids**2).sum(axis=1))
        routes.append(sorted(range(len(sims)), key=lambda c: (-sims[c], c))[:k])
    return routes


def test_route_matches_bruteforce_cosine_ranking(fitted, tmp_path):
    router, _, _, texts = fitted
    path = router.save(tmp_path / "router.pkl")
    loaded = Router.load(path)
    queries = window_texts(_topic_windows([5, 5, 5, 5], seed=2)[0], prefix_bytes=256)
    queries += ["", "qqqq zzzz unseen words only", "the and of"]
    for k in (1, 3, 4):
        got = loaded.route(queries, k)
        assert got.shape == (len(queries), k) and got.dtype == np.int64
        assert got.tolist() == _reference_routes(loaded, texts, queries, k)
    assert loaded.route(queries)[-3:].tolist() == [[0, 1, 2, 3]] * 3  # zero vectors: by index


def test_save_load_round_trip(fitted, tmp_path):
    router, _, _, texts = fitted
    path = router.save(tmp_path / "sub" / "router.pkl")
    assert sorted(p.name for p in path.parent.iterdir()) == ["router.pkl"]  # no temp left
    loaded = Router.load(path)
    queries = [*texts[:50], "", "unrelated"]
    assert np.array_equal(loaded.route(queries), router.route(queries))
    assert np.array_equal(loaded.embed(queries), router.embed(queries))
    assert np.array_equal(loaded.centroids, router.centroids)
    router.save(path)  # overwrite in place
    assert np.array_equal(Router.load(path).mean, router.mean)


def test_bad_artifacts(fitted, tmp_path):
    router, *_ = fitted
    missing = tmp_path / "nope.pkl"
    with pytest.raises(ConfigError, match=r"nope\.pkl not found.*megatron-ext launch"):
        Router.load(missing)
    good = router.save(tmp_path / "router.pkl").read_bytes()
    corrupt = tmp_path / "corrupt.pkl"
    for data in (good[: len(good) // 2], b"\x00garbage" * 10, b""):
        corrupt.write_bytes(data)
        with pytest.raises(ConfigError, match=r"corrupt\.pkl is corrupt"):
            Router.load(corrupt)
    payload = pickle.loads(good)
    other = tmp_path / "other.pkl"
    other.write_bytes(pickle.dumps({**payload, "version": 99}))
    with pytest.raises(ConfigError, match="version 99"):
        Router.load(other)
    other.write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(ConfigError, match="not a SOMA router"):
        Router.load(other)
    other.write_bytes(pickle.dumps({**payload, "centroids": payload["centroids"][:, :3]}))
    with pytest.raises(ConfigError, match="inconsistent"):
        Router.load(other)


def test_top_k_bounds_and_default(fitted):
    router, *_ = fitted
    assert router.route(["x"]).shape == (1, 4)  # min(4, N)
    for k in (0, 5):
        with pytest.raises(ConfigError, match=f"top-k={k}.*N=4"):
            router.route(["x"], k)
    assert router.route([], 2).shape == (0, 2)


def test_single_cluster_and_too_few_texts():
    windows, _ = _topic_windows([10, 10, 0, 0], seed=3)
    texts = window_texts(windows)
    router, assignment = fit_router(texts, RouterConfig(n_clusters=1))
    assert np.array_equal(assignment, np.zeros(20))
    assert router.route([*texts[:3], ""]).tolist() == [[0]] * 4
    with pytest.raises(ConfigError, match="N=21 clusters need at least 21 texts, got 20"):
        fit_router(texts, RouterConfig(n_clusters=21))
    with pytest.raises(ConfigError, match="vocabulary"):
        fit_router(["the of and", "is it"], RouterConfig(n_clusters=1))


def test_capacity_bounds():
    assert capacity_bounds(10, 4) == (2, 3)
    assert capacity_bounds(12, 4) == (3, 3)
    assert capacity_bounds(1000, 3, 0.2) == (266, 400)


@pytest.mark.parametrize("n,k", [(1, 1), (7, 3), (100, 7), (513, 8), (64, 64)])
def test_balanced_assign_bounds_on_random_similarities(n, k):
    rng = np.random.default_rng(n * 100 + k)
    for tolerance in (0.0, 0.3):
        lower, upper = capacity_bounds(n, k, tolerance)
        # skewed: every point prefers cluster 0, so an unconstrained argmax is maximally unbalanced
        sim = rng.random((n, k)) + np.where(np.arange(k) == 0, 5.0, 0.0)
        assign = balanced_assign(sim, lower, upper)
        sizes = np.bincount(assign, minlength=k)
        assert assign.shape == (n,) and sizes.sum() == n
        assert sizes.min() >= lower and sizes.max() <= upper
        assert sizes[0] == min(upper, n)  # the cluster everyone wants is filled


def test_balanced_assign_is_argmax_when_argmax_is_balanced():
    rng = np.random.default_rng(0)
    best = rng.permutation(np.arange(90) % 3)
    sim = rng.random((90, 3)) * 0.1
    sim[np.arange(90), best] += 1.0
    assert np.array_equal(balanced_assign(sim, 30, 30), best)


def test_balance_matters_on_skewed_unit_vectors():
    rng = np.random.default_rng(0)
    centers = rng.normal(size=(3, 16))
    labels = rng.choice(3, size=1000, p=[0.7, 0.2, 0.1])
    x = centers[labels] + 0.3 * rng.normal(size=(1000, 16))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    plain = KMeans(n_clusters=3, n_init=4, random_state=0).fit(x).labels_
    plain_sizes = np.sort(np.bincount(plain, minlength=3))
    assert plain_sizes[-1] - plain_sizes[0] > 400  # unconstrained: clusters of the true sizes
    result = balanced_spherical_kmeans(x, 3, seed=0)
    assert sorted(np.bincount(result.assignment, minlength=3).tolist()) == [333, 333, 334]
    assert np.allclose(np.linalg.norm(result.centroids, axis=1), 1.0)
    loose = balanced_spherical_kmeans(x, 3, tolerance=0.2, seed=0)
    sizes = np.bincount(loose.assignment, minlength=3)
    assert sizes.min() >= 266 and sizes.max() <= 400


def test_vocabulary_scaling_rule():
    assert [scaled_max_features(n) for n in (50, 1_643, 100_000, 10**6, 10**8)] == [
        1_000,
        2_027,
        15_811,
        50_000,
        50_000,
    ]
    assert [scaled_min_df(n) for n in (50, 1_643, 60_000, 10**6)] == [1, 2, 3, 5]
