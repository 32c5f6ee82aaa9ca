"""DiPaCo's coarse routing: generative (balanced k-means, the one shared with SOMA) and
discriminative (logistic regression + a per-path frequency bias), top-k shards."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_limits

from megatron_ext.dipaco.routing import (
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
    router, assignment = fit_generative(x, 6, max_iter=50, seed=0)
    counts = np.bincount(assignment, minlength=6)
    assert counts.min() == counts.max() == 60  # 360 documents, 6 paths: exactly balanced
    top2 = router.route(x, 2)
    assert (top2[:, 0] != top2[:, 1]).all()
    parts = shards(top2, np.arange(len(x)) + 1000, 6)
    assert sum(len(s) for s in parts) == 2 * len(x)  # every document in exactly two shards
    again = Router.from_arrays(router.to_arrays())
    np.testing.assert_array_equal(again.route(x, 2), top2)
