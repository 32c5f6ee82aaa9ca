"""In-process SOMA training for ``megatron-ext bench paper soma``: the trainer's own update
(:func:`megatron_ext.soma.update.spsa_update` / :func:`~megatron_ext.soma.update.head_update`)
on a corpus split by document, without the launcher (one process, the study runs many small
ensembles).

An ensemble is trained the paper's way (Sec. 4, App. D): a seed run (N = 1, the whole training
pool; a narrow body's shared tied E, or a wide body's own head, by the delta rule), then N experts
that copy the seed and train on their own tf-idf cluster (a narrow body's E frozen, a wide
body's own head still updated by the delta rule: the paper's wide N = 1, 2, 8 controls). The
seed of a run changes the initialisation, the sampled batches and the probes, the held-out
documents (the train/test split) and the routers (k-means seeding); the shards are either the
tf-idf clusters (the paper's) or a random disjoint partition of the same sizes (the paper's
ablation, Sec. 6 / Fig. 9: "semantically clustered shards outperform random disjoint shards").
"""

from __future__ import annotations

import copy
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np

SEED_EXPERT = -1


@dataclass(frozen=True)
class Scale:
    """One size of the study (every number of its runs). ``d_embed``: the tied embedding width;
    bodies of another width are the paper's wide controls (own head, projections)."""

    d_embed: int
    blocks: int
    n_pert: int
    batch: int
    seq: int
    window_bytes: int
    route_bytes: int
    score_bytes: int
    seed_updates: int
    updates: int
    corpus_bytes: int
    lr: float = 1e-3  # Table 1
    eps: float = 1e-3  # Table 1
    seed_lr: float = 2.5e-3  # App. D
    head_lr: float = 2.5e-3  # (ours) App. D gives the seed one lr
    weight_decay: float = 1e-4  # Table 1 / App. E
    test_fraction: float = 0.1
    val_fraction: float = 0.02

    def cfg(self, d_model: int, loss_mode: str = "independent") -> Any:
        from megatron_ext.soma import SomaConfig

        return SomaConfig(
            d_embed=self.d_embed, d_model=d_model, num_blocks=self.blocks, n_pert=self.n_pert,
            batch_size=self.batch, seq_length=self.seq, lr=self.lr, eps=self.eps,
            head_lr=self.head_lr, weight_decay=self.weight_decay, loss_mode=loss_mode,
            window_bytes=self.window_bytes, route_bytes=self.route_bytes,
            score_bytes=self.score_bytes,
        )  # fmt: skip

    def layout(self, d_model: int) -> Any:
        from megatron_ext.soma import BodyLayout, ExpertShape

        return BodyLayout.from_shape(ExpertShape(256, self.d_embed, d_model, self.blocks))


ShardMode = Literal["tfidf", "random"]


@dataclass
class Corpus:
    """Training windows (held-out documents excluded), the test windows (one per held-out
    document) and, per (N, shard mode), the router and its shards (cached). ``seed``: the
    split's, also the routers' k-means seeding and the random partition's."""

    windows: np.ndarray
    test: np.ndarray
    seed: int
    routers: dict[tuple[int, str], Any] = field(default_factory=dict)
    shards: dict[tuple[int, str], list[Any]] = field(default_factory=dict)
    assign: dict[int, np.ndarray] = field(default_factory=dict)  # N -> tf-idf cluster per window

    def split(
        self, n: int, val_fraction: float, mode: ShardMode = "tfidf"
    ) -> tuple[Any, list[Any]]:
        """(router, shards) of N experts: the tf-idf router and its clusters, or (``random``) the
        same router with a random disjoint partition of the same cluster sizes."""
        from megatron_ext.soma import RouterConfig, expert_shards, fit_router, window_texts

        if (n, "tfidf") not in self.routers:
            cfg = RouterConfig(n, svd_dim=32, seed=self.seed)
            router, assign = fit_router(window_texts(self.windows), cfg)
            self.routers[n, "tfidf"] = self.routers[n, "random"] = router
            self.assign[n] = np.asarray(assign)
        key = (n, mode)
        if key not in self.shards:
            assign = self.assign[n]
            if mode == "random":  # the same cluster sizes, members drawn at random
                assign = np.random.default_rng((self.seed, n, 5)).permutation(assign)
            pool = np.arange(len(self.windows), dtype=np.int64)
            self.shards[key] = expert_shards(
                assign, pool, n, val_fraction=val_fraction, seed=self.seed
            )
        return self.routers[key], self.shards[key]


@functools.cache
def corpus(scale: Scale, seed: int = 0) -> Corpus:
    """The python-stdlib docstrings (first ``corpus_bytes``), split by document with ``seed``
    (each study seed holds out other documents)."""
    from megatron_ext.soma import split_documents

    split = split_documents(
        ["python-stdlib"], scale.test_fraction, seed, scale.window_bytes, scale.corpus_bytes
    )
    return Corpus(split.train.windows, split.test, seed)


@dataclass
class Ensemble:
    """Trained experts: ``states`` (ExpertState each), the shared ``emb`` (V, d_E), ``n``,
    ``d_model`` and the updates per expert run so far."""

    scale: Scale
    d_model: int
    states: list[Any]
    emb: Any
    seed: int
    shards: ShardMode = "tfidf"

    @property
    def n(self) -> int:
        return len(self.states)

    def clone(self) -> Ensemble:
        return copy.deepcopy(self)


def _state(scale: Scale, expert: int, theta: Any, d_model: int, lr: float) -> Any:
    from megatron_ext.soma import ExpertState
    from megatron_ext.zo import PlateauHalving, ZOAdam

    layout = scale.layout(d_model)
    head = ZOAdam(theta.numel() - layout.spsa_numel) if layout.shape.wide else None
    # patience above every run's length: the paper's 1,000-update plateau never triggers here
    plateau = PlateauHalving(lr=lr, eps=scale.eps, patience=10**9)
    return ExpertState(expert, theta.clone(), ZOAdam(layout.spsa_numel), plateau, head_adam=head)


def _ctx(scale: Scale, d_model: int, seed: int, emb: Any, loss_mode: str = "independent") -> Any:
    from megatron_ext.soma import UpdateContext
    from megatron_ext.zo import DirectionSplit

    return UpdateContext(
        cfg=scale.cfg(d_model, loss_mode),
        layout=scale.layout(d_model),
        emb=emb,
        windows=corpus(scale, seed).windows,
        seed=seed,
        split=DirectionSplit(scale.n_pert),
    )


def advance(ens: Ensemble, updates: int, loss_mode: str = "independent") -> Ensemble:
    """``updates`` more updates of every expert, in place (``summed``: one finite difference of
    the sum of all N losses, the paper's summed-loss arm, App. J)."""
    from megatron_ext.soma import head_update, spsa_update

    ctx = _ctx(ens.scale, ens.d_model, ens.seed, ens.emb, loss_mode)
    _, shards = corpus(ens.scale, ens.seed).split(ens.n, ens.scale.val_fraction, ens.shards)
    wide = ctx.layout.shape.wide
    for _ in range(updates):
        u = ens.states[0].update
        spsa_update(ctx, ens.states, shards)
        if wide:  # each wide expert's own head, by the delta rule (App. E)
            for st, shard in zip(ens.states, shards, strict=True):
                head_update(ctx, st, shard, st.head_adam, u)
    return ens


@functools.cache
def seed_run(scale: Scale, d_model: int, seed: int) -> tuple[Any, Any]:
    """The N = 1 seed run (paper Sec. 4, App. D): (body (numel,), E (V, d_E)) after
    ``scale.seed_updates`` updates at ``seed_lr``; cached, every N at this width starts here."""
    import torch

    from megatron_ext.soma import ExpertShard, head_update, init_body, init_embedding, spsa_update
    from megatron_ext.zo import ZOAdam

    gen = torch.Generator().manual_seed(seed)
    layout = scale.layout(d_model)
    theta = init_body(layout.shape, gen)
    emb = init_embedding(layout.shape, gen)
    st = _state(scale, SEED_EXPERT, theta, d_model, scale.seed_lr)
    ctx = _ctx(scale, d_model, seed, emb)
    pool = np.arange(len(corpus(scale, seed).windows), dtype=np.int64)
    shard = ExpertShard(0, pool, pool[:0])
    adam = st.head_adam if layout.shape.wide else ZOAdam(emb.numel())
    for u in range(scale.seed_updates):
        spsa_update(ctx, [st], [shard])
        head_update(ctx, st, shard, adam, u)
    return st.theta.clone(), emb.clone()


def ensemble(
    scale: Scale,
    n: int,
    d_model: int,
    seed: int,
    updates: int | None = None,
    shards: ShardMode = "tfidf",
) -> Ensemble:
    """N experts copied from the seed run at width ``d_model``, trained ``updates`` (default
    ``scale.updates``) updates each on their own shard (``shards``: tf-idf or random)."""
    theta, emb = seed_run(scale, d_model, seed)
    states = [_state(scale, e, theta, d_model, scale.lr) for e in range(n)]
    ens = Ensemble(scale, d_model, states, emb.clone(), seed, shards)
    return advance(ens, scale.updates if updates is None else updates)


def test_loss(ens: Ensemble, k: int | None = None) -> float:
    """Routed top-k test loss (nats/byte) on the held-out documents (k default min(4, N))."""
    import torch

    from megatron_ext.soma import routed_eval

    sc = ens.scale
    router, _ = corpus(sc, ens.seed).split(ens.n, sc.val_fraction, ens.shards)
    k = min(4, ens.n) if k is None else k
    with torch.inference_mode():
        r = routed_eval(
            corpus(sc, ens.seed).test, router, [st.theta for st in ens.states], ens.emb,
            sc.layout(ens.d_model), k, sc.route_bytes, sc.score_bytes,
        )  # fmt: skip
    return r.nats_per_byte


def with_scale(scale: Scale, **changes: Any) -> Scale:
    return replace(scale, **changes)


def test_unigram_entropy(scale: Scale, seed: int) -> float:
    """Byte-unigram entropy (nats/byte) of the scored bytes of the test windows under the
    training windows' byte frequencies (the cross-entropy of a model that learned only those):
    the reference of the studies' precondition."""
    train = np.bincount(corpus(scale, seed).windows.ravel(), minlength=256).astype(np.float64)
    p = (train + 1) / (train.sum() + 256)  # add-one: a test byte unseen in training is finite
    s = scale.route_bytes
    test = corpus(scale, seed).test[:, s + 1 : s + 1 + scale.score_bytes]
    return float(-np.log(p[test.ravel()]).mean())
