"""Routed inference grouped by expert shape against the path it replaced, and against float64.

``by_expert_reference`` is the previous routed-inference code (experts one group each, padded to
the largest group, full log-probabilities of every position), kept here as the reference the
grouped path must reproduce; ``float64_pair_loop`` scores every (window, expert) pair alone in
float64 with the single-body forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ext.soma.evaluate import mixture_target_probs, pack_pairs, slot_size
from megatron_ext.soma.layout import BodyLayout, ExpertShape, init_body, init_embedding
from megatron_ext.soma.model import log_probs, target_log_probs

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ROUTE, SCORE = 5, 9


def by_expert_reference(windows, routes, experts, emb, layout, route_bytes, score_bytes):
    """The previous path: requests grouped by expert, experts side by side with each group
    padded to the largest by repeating its windows, full log-probabilities then sliced."""
    n_in = route_bytes + score_bytes
    tokens = torch.from_numpy(windows[:, : n_in + 1].astype(np.int64))
    acc = torch.zeros(len(windows), score_bytes, dtype=torch.float64)
    groups = {int(e): np.flatnonzero((routes == e).any(axis=1)) for e in np.unique(routes)}
    width = max(len(rows) for rows in groups.values())
    ids = sorted(groups)
    idx = torch.from_numpy(np.stack([np.resize(groups[e], width) for e in ids]))
    thetas = torch.stack([experts[e] for e in ids])
    lp = log_probs(thetas, emb, tokens[idx, :n_in], layout)[:, :, route_bytes:]
    tgt = tokens[idx, route_bytes + 1 : n_in + 1]
    p = lp.gather(-1, tgt[..., None])[..., 0].double().exp()
    for i, e in enumerate(ids):
        real = len(groups[e])
        acc[idx[i, :real]] += p[i, :real]
    return acc / routes.shape[1]


def float64_pair_loop(windows, routes, experts, emb, layout, route_bytes, score_bytes):
    n_in = route_bytes + score_bytes
    out = torch.zeros(len(windows), score_bytes, dtype=torch.float64)
    for w, row in enumerate(routes):
        tokens = torch.from_numpy(windows[w, : n_in + 1].astype(np.int64))[None]
        for e in row:
            lp = log_probs(experts[e][None].double(), emb.double(), tokens[:, :n_in], layout)
            tgt = tokens[0, route_bytes + 1 : n_in + 1]
            out[w] += lp[0, 0, route_bytes:].gather(-1, tgt[:, None])[:, 0].exp()
    return out / routes.shape[1]


def _mixture(n_experts: int, n_windows: int, k: int, shape: ExpertShape, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    layout = BodyLayout.from_shape(shape)
    experts = [init_body(shape, gen) for _ in range(n_experts)]
    emb = init_embedding(shape, gen)
    windows = rng.integers(0, 256, (n_windows, ROUTE + SCORE + 3)).astype(np.uint8)
    # Skewed routes (expert 0 in most windows), so groups differ in size and need padding.
    routes = np.stack(
        [rng.choice(n_experts, k, replace=False, p=_skew(n_experts)) for _ in range(n_windows)]
    )
    return windows, routes, experts, emb, layout


def _skew(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1)
    return w / w.sum()


@pytest.mark.parametrize(
    "shape", [ExpertShape(d_embed=8, d_model=8), ExpertShape(d_embed=8, d_model=12)]
)
def test_grouped_inference_matches_the_by_expert_path_and_float64(shape):
    windows, routes, experts, emb, layout = _mixture(7, 11, 3, shape)
    with torch.inference_mode():
        got = mixture_target_probs(windows, routes, experts, emb, layout, ROUTE, SCORE)
        old = by_expert_reference(windows, routes, experts, emb, layout, ROUTE, SCORE)
    ref = float64_pair_loop(windows, routes, experts, emb, layout, ROUTE, SCORE)
    assert got.shape == (11, SCORE) and got.dtype == torch.float64
    torch.testing.assert_close(got, old, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-9)
    loss = float(-got.log().mean())
    assert loss == pytest.approx(float(-old.log().mean()), abs=1e-6)
    assert loss == pytest.approx(float(-ref.log().mean()), abs=1e-6)


@pytest.mark.parametrize("slot, max_weight_bytes", [(1, 2**30), (3, 2**30), (None, 1)])
def test_unit_size_and_call_split_do_not_change_the_mixture(slot, max_weight_bytes):
    """One window per unit, three, or the chosen size; one call or one unit per call."""
    windows, routes, experts, emb, layout = _mixture(5, 9, 2, ExpertShape(d_embed=8, d_model=8))
    with torch.inference_mode():
        want = mixture_target_probs(windows, routes, experts, emb, layout, ROUTE, SCORE)
        got = mixture_target_probs(
            windows,
            routes,
            experts,
            emb,
            layout,
            ROUTE,
            SCORE,
            slot=slot,
            max_weight_bytes=max_weight_bytes,
        )
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_every_pair_is_packed_once_with_padding_from_its_own_expert():
    rng = np.random.default_rng(3)
    routes = np.stack([rng.choice(6, 3, replace=False, p=_skew(6)) for _ in range(20)])
    for slot in (1, 2, 4, None):
        pack = pack_pairs(routes, slot)
        assert pack.rows.shape == pack.real.shape == (len(pack.expert), pack.slot)
        pairs = sorted(
            (int(w), int(e))
            for e, rows, real in zip(pack.expert, pack.rows, pack.real, strict=True)
            for w in rows[real]
        )
        assert pairs == sorted((w, int(e)) for w in range(20) for e in routes[w])
        for e, rows in zip(pack.expert, pack.rows, strict=True):
            assert all(e in routes[w] for w in rows)  # padding repeats the expert's own window
        # Padding only in an expert's last unit.
        assert int((~pack.real).sum()) < pack.slot * len(np.unique(routes))


def test_slot_size_trades_padding_against_units():
    assert slot_size(np.array([64, 64, 64, 64])) == 64  # equal groups: one unit each
    assert slot_size(np.array([1, 1, 1, 1, 0])) == 1
    # One large group among singletons: the chosen size is the cheapest of all candidates.
    sizes = np.array([10, 1, 1, 1])
    s = slot_size(sizes)
    cost = {c: np.ceil(sizes / c).sum() * (c + 1.0) for c in range(1, 11)}
    assert cost[s] == min(cost.values())


def test_target_log_probs_start_and_per_body_batches():
    shape = ExpertShape(d_embed=8, d_model=12)
    layout = BodyLayout.from_shape(shape)
    gen = torch.Generator().manual_seed(5)
    thetas = torch.stack([init_body(shape, gen, dtype=torch.float64) for _ in range(3)])
    emb = init_embedding(shape, gen, dtype=torch.float64)
    tokens = torch.randint(0, 256, (3, 2, 10), generator=gen)
    full = log_probs(thetas, emb, tokens[..., :-1], layout)  # (3, 2, 9, V)
    picked = full.gather(-1, tokens[..., 1:, None])[..., 0]
    for start in (0, 4, 8):
        got = target_log_probs(thetas, emb, tokens, layout, start=start, max_chunk_bytes=1)
        torch.testing.assert_close(got, picked[..., start:], rtol=1e-12, atol=1e-12)
    shared = target_log_probs(thetas, emb, tokens[0], layout, start=2)
    torch.testing.assert_close(shared[1], target_log_probs(thetas[1:2], emb, tokens[0], layout,
                                                           start=2)[0])  # fmt: skip
    with pytest.raises(ValueError, match="start=9"):
        target_log_probs(thetas, emb, tokens, layout, start=9)
    with pytest.raises(ValueError, match="per-body"):
        target_log_probs(thetas, emb, tokens[:2], layout)


def test_equal_total_sweep_widths_match_the_total():
    """The bench's equal-total widths: each N's total is the nearest any width gets to the
    target, and the default sweep (N = 8, 32, 256 against 8 experts of width 128) stays within
    5% of it."""
    from megatron_ext.bench._soma_inference import body_numel, width_for_total

    total = 8 * body_numel(128, 2)
    for n in (8, 32, 256):
        d = width_for_total(n, total, 2)
        gap = abs(n * body_numel(d, 2) - total)
        assert gap <= min(abs(n * body_numel(w, 2) - total) for w in (d - 1, d + 1) if w >= 1)
        assert gap <= 0.05 * total
    assert width_for_total(8, total, 2) == 128


def test_inference_sweeps_report_the_fastest_round_and_its_ratio():
    import argparse

    from megatron_ext.bench._soma_inference import inference_sweeps
    from megatron_ext.bench.soma import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--experts",
            "2",
            "4",
            "--windows",
            "3",
            "--inference-repeats",
            "2",
            "--d-model",
            "8",
            "--sweep-total",
            "20000",
        ]
    )
    res = inference_sweeps(args)
    for sweep in ("equal_total", "equal_expert"):
        rows = res[sweep]["rows"]
        assert [r["n_experts"] for r in rows] == [2, 4]
        for r in rows:
            assert r["tokens_per_s"] == max(r["tokens_per_s_all"]) > 0
            assert len(r["tokens_per_s_all"]) == 2 and 0 < r["routing_share"] < 1
        ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        assert res[sweep]["ratio"] == pytest.approx(ratio)
    assert all(r["d_model"] == 8 for r in res["equal_expert"]["rows"])
    from megatron_ext.soma.native import native_available

    # "auto" on CPU: the C kernels, at any width, where they build
    expected = "native" if native_available()[0] else "eager"
    for sweep in ("equal_total", "equal_expert"):
        assert {r["forward"] for r in res[sweep]["rows"]} == {expected}
