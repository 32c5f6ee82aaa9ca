"""``megatron-ext bench paper soma``: every comparison's baseline is built as the paper defines
it, on tiny settings (in process, seconds)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ext.bench._soma_inference import D_EMBED, body_numel, width_for_total
from megatron_ext.bench.paper import _soma_measure as meas
from megatron_ext.bench.paper import _soma_train as tr
from megatron_ext.bench.paper.soma import SCALES, _compute_matched_updates

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SC = tr.with_scale(SCALES["quick"]["scale"], seed_updates=2, updates=2)


def test_forward_flops_are_the_papers_count():
    """App. H: 'A width-32 expert uses 81.9k arithmetic operations per token' (D=2, V=256)."""
    from megatron_ext.bench.soma import forward_flops_per_token

    assert forward_flops_per_token(32, 32, 2) == 81_920


def test_monolith_and_soma_n2_are_equal_size_wide_controls_at_equal_compute():
    """Fig. 1 / Table 2: both arms are wide controls (d != d_E: own tied head, projections) of
    about the same total size; Eq. 21 with the seed runs counted: the monolith's (seed + s_1)
    updates at F_1 = SOMA's seed run at F_2 plus N·s_N updates at F_2, at equal T, n_pert, B."""
    full = SCALES["full"]["scale"]
    w1 = SCALES["full"]["mono_width"]
    w2 = width_for_total(2, full.layout(w1).numel, 2, d_embed=full.d_embed, wide_only=True)
    assert w1 != full.d_embed and w2 != full.d_embed
    d_e, v = full.d_embed, 256
    count = lambda n, d: n * (32 * d * d + 5 * d + 2 * d_e * d + v * d_e)  # noqa: E731 Table 2
    assert full.layout(w1).numel == count(1, w1) and 2 * full.layout(w2).numel == count(2, w2)
    assert abs(count(2, w2) / count(1, w1) - 1) < 0.02
    s2 = _compute_matched_updates(full, w1, w2, 2)
    f = lambda d: 2 * (2 * 16 * d * d + 2 * d * d_e + v * d_e)  # noqa: E731 2·multiply-adds
    per_update = 2 * full.seq * full.n_pert * full.batch
    c1 = per_update * f(w1) * (full.seed_updates + full.updates)
    c2 = per_update * f(w2) * (full.seed_updates + 2 * s2)
    assert abs(c2 / c1 - 1) < 0.01  # rounding to whole updates


def test_n_sweep_experts_copy_one_seed_body_at_fixed_width():
    """Fig. 7 left / Sec. 4: every N copies the same seed body and E at one width; N = 1 trains
    on the whole pool; the clusters partition the training windows."""
    theta, emb = tr.seed_run(SC, 8, 1)
    for n in (1, 2):
        ens = tr.ensemble(SC, n, 8, 1, updates=0)
        assert all(torch.equal(st.theta, theta) for st in ens.states)
        assert torch.equal(ens.emb, emb)
        _, shards = tr.corpus(SC, 1).split(n, SC.val_fraction)
        every = np.sort(np.concatenate([np.concatenate([s.train, s.val]) for s in shards]))
        assert np.array_equal(every, np.arange(len(tr.corpus(SC, 1).windows)))
    trained = tr.ensemble(SC, 2, 8, 1)
    assert all(st.update == SC.updates for st in trained.states)
    assert not torch.equal(trained.states[0].theta, trained.states[1].theta)


def test_summed_and_independent_arms_share_start_data_and_probes(monkeypatch):
    """App. J: both arms continue the same weights and Adam states on the same batches and
    probes; only the loss rule differs."""
    from megatron_ext.soma import update

    start = tr.ensemble(SC, 2, 8, 2)
    theta0 = [st.theta.clone() for st in start.states]
    seen: dict[str, list] = {"independent": [], "summed": []}
    real = update._batch
    arm = {"now": ""}

    def spy(ctx, shard, expert, u, a):
        seen[arm["now"]].append((ctx.seed, expert, u, a))
        return real(ctx, shard, expert, u, a)

    monkeypatch.setattr(update, "_batch", spy)
    out = {}
    for mode in ("independent", "summed"):
        arm["now"] = mode
        out[mode] = tr.advance(start.clone(), 2, mode)
    assert seen["independent"] == seen["summed"] and len(seen["summed"]) == 2 * 2
    assert all(torch.equal(a.theta, b) for a, b in zip(start.states, theta0, strict=True))
    assert not torch.equal(out["independent"].states[0].theta, out["summed"].states[0].theta)


def test_variance_and_throughput_arms_are_at_equal_total_size():
    """Fig. 10: 1 vs N narrow bodies (d_E = d) of about equal total parameters; Table 12: the
    many-small arm at width d_E = 32 (shared E), the few-large arm wide (own head each) at the
    width nearest the same total."""
    for n1, nn, blocks in ((1, 4, 1), (1, 8, 2)):
        total = body_numel(64, blocks, None)
        for n in (n1, nn):
            d = width_for_total(n, total, blocks, d_embed=None)
            assert abs(n * (blocks * (2 * d + 16 * d * d) + d) / total - 1) < 0.15, (n, d)
    windows, test = tr.corpus(SC, 1).windows, tr.corpus(SC, 1).test[:4]
    tp = meas.throughput(
        (2, 8), 1, windows, test, route_bytes=SC.route_bytes, score_bytes=SC.score_bytes,
        rounds=1, seed=0,
    )  # fmt: skip
    assert tp["8"]["width"] == D_EMBED and tp["2"]["width"] != D_EMBED
    assert abs(tp["2"]["params"] / tp["8"]["params"] - 1) < 0.05
    assert tp["2"]["params"] == 2 * body_numel(tp["2"]["width"], 1)  # own head counted
    r = meas.sharded_variance(1, 8, 1, windows, batch=2, seq=16, n_pert=2, repeats=4, seed=0)
    assert r["measured"] > 0 and r["predicted"] > 0


def test_k_sweep_at_k_equal_n_averages_every_expert():
    """Fig. 16: k = N averages all experts; k = 1 one of them (the mixture is their mean)."""
    ens = tr.ensemble(SC, 2, 8, 1)
    assert tr.test_loss(ens, 1) != tr.test_loss(ens, 2)
    with pytest.raises(Exception, match="top-k"):
        tr.test_loss(ens, 3)


def test_seeds_hold_out_other_documents_and_random_shards_keep_the_cluster_sizes():
    """Each seed holds out other documents (the split varies with the seed); the random shards of
    the ablation (Fig. 9) partition the same windows into shards of the tf-idf clusters' sizes
    with other members; the precondition's reference is the unigram cross-entropy of the scored
    test bytes under the training bytes' frequencies."""
    one, two = tr.corpus(SC, 1), tr.corpus(SC, 2)
    assert not np.array_equal(one.test[: len(two.test)], two.test[: len(one.test)])
    _, tfidf = one.split(2, SC.val_fraction)
    _, rand = one.split(2, SC.val_fraction, "random")
    members = [np.sort(np.concatenate([s.train, s.val])) for s in (*tfidf, *rand)]
    assert [len(m) for m in members[:2]] == [len(m) for m in members[2:]]
    assert not np.array_equal(members[0], members[2])
    assert np.array_equal(np.sort(np.concatenate(members[2:])), np.arange(len(one.windows)))
    train = np.bincount(one.windows.ravel(), minlength=256) + 1.0
    s = SC.route_bytes
    scored = one.test[:, s + 1 : s + 1 + SC.score_bytes].ravel()
    want = -np.mean(np.log(train[scored] / train.sum()))
    assert tr.test_unigram_entropy(SC, 1) == pytest.approx(want, rel=1e-12)
