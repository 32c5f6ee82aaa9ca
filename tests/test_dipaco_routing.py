"""DiPaCo's coarse routing: generative (product k-means over the levels, each level the balanced
k-means shared with SOMA) and discriminative (logistic regression + a per-path frequency bias),
top-k shards."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from megatron_ext.dipaco.steps.routing import (
    Router,
    fit_discriminative,
    fit_frequency_bias,
    fit_generative,
    shards,
)


@pytest.fixture(scope="module", autouse=True)
def _one_blas_thread():
    with threadpool_limits(limits=1):
        yield


def imbalanced(n: int = 3000, seed: int = 0):
    """Three overlapping 2-D Gaussians with priors 0.6 / 0.3 / 0.1, and per-path 'losses' whose
    argmin is each point's class."""
    rng = np.random.default_rng(seed)
    target = rng.choice(3, size=n, p=[0.6, 0.3, 0.1])
    means = np.array([[0.0, 0.0], [0.6, 0.0], [0.0, 0.6]])
    x = means[target] + rng.standard_normal((n, 2))
    losses = np.ones((n, 3))
    losses[np.arange(n), target] = 0.0
    return x, target, losses


def test_bias_brings_predicted_path_frequencies_to_the_targets() -> None:
    x, target, losses = imbalanced()
    router = fit_discriminative(x, losses, max_iter=200, seed=0)
    want = np.bincount(target, minlength=3) / len(target)
    unbiased = np.bincount(router.route(x, with_bias=False)[:, 0], minlength=3) / len(x)
    biased = np.bincount(router.route(x)[:, 0], minlength=3) / len(x)
    # without the bias the minority paths get (almost) no documents ...
    assert unbiased[1:].min() < 0.02 < want[1:].min()
    # ... with it every path gets its target share
    np.testing.assert_allclose(biased, want, atol=0.01)


def test_frequency_bias_on_random_logits_and_a_path_nobody_wants() -> None:
    rng = np.random.default_rng(1)
    z = rng.standard_normal((2000, 5)) + np.array([2.0, 0.0, 0.0, -1.0, 0.0])
    f = np.array([0.1, 0.2, 0.3, 0.4, 0.0])
    b = fit_frequency_bias(z, f)
    q = np.bincount(np.argmax(z + b, axis=1), minlength=5) / len(z)
    np.testing.assert_allclose(q, f, atol=0.005)
    assert q[4] == 0.0
    assert fit_frequency_bias(z[:, :1], np.array([1.0])).tolist() == [0.0]  # one path


def test_generative_routing_gives_balanced_shards_and_consistent_routes() -> None:
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal((90, 8)) + 4 * np.eye(8)[i % 4] for i in range(4)])
    router, assignment = fit_generative(x, (6,), max_iter=50, seed=0)  # one level: flat
    counts = np.bincount(assignment, minlength=6)
    assert counts.min() == counts.max() == 60  # 360 documents, 6 paths: exactly balanced
    top2 = router.route(x, 2)
    assert (top2[:, 0] != top2[:, 1]).all()
    parts = shards(top2, np.arange(len(x)) + 1000, 6)
    assert sum(len(s) for s in parts) == 2 * len(x)  # every document in exactly two shards
    again = Router.from_arrays(router.to_arrays())
    np.testing.assert_array_equal(again.route(x, 2), top2)


def product_features(n_per: int = 40, seed: int = 3):
    """(n, 8) features whose first 4 columns fall in one of 3 well-separated groups and whose
    last 4 in one of 3 others, independently: 9 product cells of ``n_per`` documents; returns
    (features, (n,) group of the first half, (n,) group of the second half)."""
    rng = np.random.default_rng(seed)
    a, b = np.meshgrid(np.arange(3), np.arange(3), indexing="ij")
    a, b = np.repeat(a.ravel(), n_per), np.repeat(b.ravel(), n_per)
    centres = 5 * np.eye(4)[:3]
    x = np.concatenate([centres[a], centres[b]], axis=1) + rng.standard_normal((len(a), 8))
    return x, a, b


def test_generative_routing_is_a_product_of_one_kmeans_per_level() -> None:
    """3 x 3 paths: the documents of all paths that share module (l, e) are one cluster of
    level l's sub-vector (purity 1 against the group that made it), and those paths' router
    rows are the same centroid on level l's columns. A flat k-means with k = 9 whose cluster ids
    are read as digits fails both: its ids carry no level structure."""
    x, a, b = product_features()
    router, path = fit_generative(x, (3, 3), max_iter=50, seed=0)
    digits = np.stack([path // 3, path % 3], axis=1)
    for level, truth in enumerate((a, b)):
        for e in range(3):
            groups = np.unique(truth[digits[:, level] == e])
            assert len(groups) == 1, (level, e, groups)  # module (l, e) = one cluster
        counts = np.bincount(digits[:, level], minlength=3)
        assert counts.min() == counts.max() == 120  # each level's k-means is balanced
    lo, hi = router.segments[:2], router.segments[1:]
    for p in range(9):
        for q in range(9):
            for level in range(2):
                same = (p // 3, p % 3)[level] == (q // 3, q % 3)[level]
                cols = slice(int(lo[level]), int(hi[level]))
                assert np.array_equal(router.weights[p, cols], router.weights[q, cols]) == same
    # routing a document = the product of its nearest centroid per level, written out
    nearest = []
    for level in range(2):
        cols = slice(int(lo[level]), int(hi[level]))
        sub = x[:, cols] - x.mean(0)[cols]
        sub /= np.linalg.norm(sub, axis=1, keepdims=True)
        centroids = router.weights[[0, 1, 2] if level else [0, 3, 6], cols]
        nearest.append(np.argmax(sub @ centroids.T, axis=1))
    top = router.route(x, 1)[:, 0]
    np.testing.assert_array_equal(top, 3 * nearest[0] + nearest[1])
    assert (top == path).mean() > 0.97  # the balanced choice is the nearest but for a few
    again = Router.from_arrays(router.to_arrays())
    np.testing.assert_array_equal(again.route(x, 2), router.route(x, 2))


def test_a_level_of_one_module_takes_no_feature_columns() -> None:
    """(4, 1) routes as flat (4,): the one-module level chooses nothing (DiLoCo's data level)."""
    x, _, _ = product_features()
    flat, flat_path = fit_generative(x, (4,), max_iter=50, seed=0)
    split, split_path = fit_generative(x, (4, 1), max_iter=50, seed=0)
    assert split.segments.tolist() == [0, 8, 8]
    np.testing.assert_array_equal(split_path, flat_path)
    np.testing.assert_array_equal(split.route(x, 2), flat.route(x, 2))
    one, one_path = fit_generative(x, (1,), max_iter=50, seed=0)  # the dense arm: one path
    assert (one_path == 0).all() and (one.route(x, 1) == 0).all()


def test_an_empty_product_path_gets_its_top_scoring_documents() -> None:
    from megatron_ext.dipaco.run.tasks import _fill_empty_products

    rng = np.random.default_rng(4)
    scores = rng.standard_normal((40, 4))
    routes = np.argsort(-scores[:, :3], axis=1)[:, :2]  # path 3 never chosen
    filled, empty = _fill_empty_products(routes, scores)
    assert empty == [3] and filled.shape == (40, 3)
    np.testing.assert_array_equal(filled[:, :2], routes)
    take = max(int(np.bincount(routes.ravel(), minlength=4)[:3].min()), 8)
    got = np.flatnonzero(filled[:, 2] == 3)
    np.testing.assert_array_equal(np.sort(got), np.sort(np.argsort(-scores[:, 3])[:take]))
    same, none = _fill_empty_products(filled[:, :2], scores[:, :3])
    assert none == [] and same.shape == (40, 2)
