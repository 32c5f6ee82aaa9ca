"""The corpus a SOMA run sees: windows, the held-out test windows, the router and the shards.

Rank 0 fits the router once (tf-idf → SVD → balanced spherical k-means over the training pool)
and saves it with the cluster assignment; every other rank loads both. The held-out test
documents, the training windows and the per-expert 99/1 splits are deterministic functions of
the recipe, so every rank rebuilds the same ones without communication.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

from megatron_ext.atomic import atomic_path
from megatron_ext.config.schema import Recipe
from megatron_ext.soma.data import (
    ExpertShard,
    check_expert_count,
    expert_shards,
    split_documents,
    window_texts,
)
from megatron_ext.soma.recipe import SomaConfig
from megatron_ext.soma.router import Router, RouterConfig, fit_router


@dataclass
class SomaCorpus:
    """``windows``: (n, window_bytes) uint8 training-stream windows (held-out documents excluded).
    ``test``: (n_test, window_bytes) uint8, one window per held-out document (paper: Table 1 /
    App. L). ``seed_shard``: the whole training pool (N = 1). ``shards[e]``: expert e's
    train/val."""

    windows: np.ndarray
    test: np.ndarray
    seed_shard: ExpertShard
    shards: list[ExpertShard]
    router: Router


def router_path(recipe: Recipe) -> Path:
    return Path(recipe.section(SomaConfig).router or Path(recipe.run_dir) / "router.pkl")


def _assignment_path(recipe: Recipe) -> Path:
    return Path(recipe.run_dir) / "soma" / "assignment.npy"


def prepare_corpus(
    recipe: Recipe, rank: int, barrier: Callable[[], None], log: Callable[[str], None]
) -> SomaCorpus:
    """Windows, hold-out, router (fit by rank 0 when missing, then loaded everywhere), shards."""
    s, seed = recipe.section(SomaConfig), recipe.seed
    split = split_documents(recipe.data.source, s.test_fraction, seed, s.window_bytes)
    ws, test = split.train, split.test
    pool = np.arange(len(ws.windows), dtype=np.int64)
    check_expert_count(s.num_experts, len(pool))  # before spending time on a fit
    path, assign_path = router_path(recipe), _assignment_path(recipe)
    if rank == 0 and not (path.is_file() and assign_path.is_file()):
        cfg = RouterConfig(
            n_clusters=s.num_experts,
            svd_dim=s.router_svd_dim,
            max_features=s.router_max_features,
            min_df=s.router_min_df,
            seed=seed,
        )
        texts = window_texts(ws.windows[pool])
        # numpy's and scipy's BLAS pools each start one thread per core; on a shared host
        # they oversubscribe the cores (measured: 5 s instead of 0.04 s per small SVD).
        with threadpool_limits(1):
            router, assignment = fit_router(texts, cfg)
        router.save(path)
        with atomic_path(assign_path) as tmp:
            np.save(tmp, assignment)
        sizes = np.bincount(assignment, minlength=s.num_experts)
        log(
            f"router: {len(pool)} windows -> {s.num_experts} clusters "
            f"(sizes {sizes.min()}..{sizes.max()}), saved {path}"
        )
    barrier()
    router = Router.load(path)
    assignment = np.load(assign_path)
    if len(assignment) != len(pool) or router.n_clusters != s.num_experts:
        from megatron_ext.errors import ConfigError

        raise ConfigError(
            f"router {path} was fit for {router.n_clusters} clusters over {len(assignment)} "
            f"windows, but this recipe has soma.num_experts={s.num_experts} and {len(pool)} "
            f"training windows: delete {path} and {assign_path} to refit"
        )
    shards = expert_shards(assignment, pool, s.num_experts, val_fraction=s.val_fraction, seed=seed)
    seed_shard = expert_shards(
        np.zeros(len(pool), dtype=np.int64), pool, 1, val_fraction=s.val_fraction, seed=seed
    )[0]
    return SomaCorpus(ws.windows, test, seed_shard, shards, router)


def test_windows(recipe: Recipe) -> tuple[np.ndarray, Router]:
    """The held-out documents' windows (n_test, window_bytes) and the saved router, for
    evaluation: a missing router artifact is an error here (evaluation never fits one)."""
    s = recipe.section(SomaConfig)
    split = split_documents(recipe.data.source, s.test_fraction, recipe.seed, s.window_bytes)
    return split.test, Router.load(router_path(recipe))
