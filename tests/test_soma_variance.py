"""SPSA gradient variance of a small expert against the small-ε theory (float64, ε = 1e-5).

The measurements run the real estimator path (probe_matrix keys, perturb, batched_loss,
spsa_estimate) and compare with the exact gradient from autograd. Every run is seeded, so the
numbers are fixed; the tests also check that the estimates' own sampling noise is a small part of
each tolerance, so agreement is not luck."""

from __future__ import annotations

import csv

import pytest
import torch

from megatron_ext.soma.layout import BodyLayout, ExpertShape, init_body, init_embedding
from megatron_ext.soma.model import batched_loss
from megatron_ext.soma.variance import (
    estimator_samples,
    exact_gradient,
    predicted_variance,
    relative_centered_variance,
    relative_standard_error,
    summed_vs_independent,
    write_report,
)
from megatron_ext.zo.probes import probe_matrix, second_moments

SHAPE = ExpertShape(vocab=32, d_embed=8, d_model=8, num_blocks=1)
EPS = 1e-5
PROBES_PER_POINT = 4800  # repeats × n_pert: about 2% standard error per variance


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def expert():
    gen = torch.Generator().manual_seed(0)
    layout = BodyLayout.from_shape(SHAPE)
    theta = init_body(SHAPE, gen, dtype=torch.float64)
    theta[layout.gain_mask] += 0.2 * torch.randn(int(layout.gain_mask.sum()), generator=gen,
                                                 dtype=torch.float64)  # fmt: skip
    emb = init_embedding(SHAPE, gen, dtype=torch.float64)
    tokens = torch.randint(0, SHAPE.vocab, (2, 9), generator=gen)
    g = exact_gradient(theta, emb, tokens, layout)
    return layout, theta, emb, tokens, g


@pytest.fixture(scope="module")
def n_pert_law(expert):
    layout, theta, emb, tokens, g = expert
    q = second_moments(layout.gain_mask)
    out = {}
    for k in (1, 8):
        repeats = PROBES_PER_POINT // k
        samples = estimator_samples(
            theta, emb, tokens, layout, n_pert=k, eps=EPS, repeats=repeats, seed=3
        )
        out[k] = dict(
            samples=samples,
            measured=relative_centered_variance(samples, g),
            predicted=predicted_variance(g, q, k),
            repeats=repeats,
        )
    return out


def test_exact_gradient_matches_finite_differences(expert):
    layout, theta, emb, tokens, g = expert
    for i in (0, 9, 300, layout.numel - 1):  # a gain, w_ih, w_hh, the final gain
        e = torch.zeros(layout.numel, dtype=torch.float64)
        e[i] = 1e-6
        both = batched_loss(torch.stack([theta + e, theta - e]), emb, tokens, layout)
        fd = float(both[0] - both[1]) / 2e-6
        assert abs(fd - float(g[i])) < 1e-7 + 1e-6 * abs(float(g[i])), i


def test_samples_use_the_keyed_probes(expert):
    """Repeat r, n_pert = 1: ĝ is a multiple of probe (seed, expert, r, 0, 0)."""
    layout, theta, emb, tokens, _ = expert
    samples = estimator_samples(
        theta, emb, tokens, layout, n_pert=1, eps=EPS, repeats=3, seed=5, expert=2
    )
    for r in range(3):
        z = probe_matrix(5, 2, r, 0, [0], layout.gain_mask, dtype=torch.float64)[0]
        assert torch.equal(samples[r] != 0, z != 0)
        ratio = samples[r][z != 0] / z[z != 0]
        torch.testing.assert_close(ratio, ratio[0].expand_as(ratio))


def test_variance_matches_small_eps_prediction(n_pert_law):
    for k, point in n_pert_law.items():
        assert relative_standard_error(point["samples"]) < 0.03, k
        assert point["measured"] == pytest.approx(point["predicted"], rel=0.10), k


def test_mean_is_q_times_gradient(expert, n_pert_law):
    """E[ĝ] = diag(q)·g: the sample mean misses it by exactly the sampling error, whose expected
    squared size is (total variance)/R."""
    layout, _, _, _, g = expert
    q = second_moments(layout.gain_mask)
    for k, point in n_pert_law.items():
        miss = (point["samples"].mean(0) - q * g).pow(2).sum() / g.pow(2).sum()
        assert float(miss) / (point["measured"] / point["repeats"]) == pytest.approx(
            1.0, abs=0.2
        ), k


def test_variance_falls_as_one_over_n_pert(n_pert_law):
    ratio = n_pert_law[1]["measured"] / n_pert_law[8]["measured"]
    assert ratio == pytest.approx(8.0, rel=0.10)


@pytest.fixture(scope="module")
def four_experts(expert):
    layout, theta, emb, _, _ = expert
    gen = torch.Generator().manual_seed(7)
    thetas = theta + 0.1 * torch.randn(4, layout.numel, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, SHAPE.vocab, (4, 2, 9), generator=gen)
    return summed_vs_independent(
        thetas, emb, tokens, layout, n_pert=1, eps=EPS, repeats=3000, seed=11
    )


def test_summed_loss_multiplies_variance_by_number_of_experts(four_experts):
    r = four_experts
    assert r["independent_rel_se"] < 0.03 and r["summed_rel_se"] < 0.03
    assert r["independent"] == pytest.approx(r["predicted_independent"], rel=0.10)
    assert r["summed"] == pytest.approx(r["predicted_summed"], rel=0.10)
    assert r["predicted_ratio"] == pytest.approx(4.0, rel=0.01)
    assert r["ratio"] == pytest.approx(4.0, rel=0.15)
    assert r["ratio"] == pytest.approx(r["summed"] / r["independent"])


def test_report_csv_matches_measurements(tmp_path, n_pert_law, four_experts):
    rows = [
        dict(experiment="n_pert law", x=k, x_label="n_pert", measured=p["measured"],
             predicted=p["predicted"], repeats=p["repeats"])
        for k, p in n_pert_law.items()
    ] + [
        dict(experiment="4 experts", x=mode, measured=four_experts[mode],
             predicted=four_experts[f"predicted_{mode}"])
        for mode in ("independent", "summed")
    ]  # fmt: skip
    csv_path, png_path = tmp_path / "variance.csv", tmp_path / "variance.png"
    write_report(rows, csv_path, png_path)
    with open(csv_path, newline="") as f:
        back = list(csv.DictReader(f))
    assert list(back[0]) == ["experiment", "x", "x_label", "measured", "predicted", "repeats"]
    assert len(back) == 4
    for row, got in zip(rows, back, strict=True):
        assert got["experiment"] == row["experiment"] and got["x"] == str(row["x"])
        assert float(got["measured"]) == row["measured"]
        assert float(got["predicted"]) == row["predicted"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["variance.csv", "variance.png"]


def test_the_variance_command_writes_the_paper_claims(tmp_path):
    """``megatron-ext soma variance``: every measured point within 20% of its prediction at
    1,200 probes (about 4% standard error), the 1/n_pert law and the 4x of summed losses in the
    CSV, and the plot written."""
    import csv

    from megatron_ext.launch.cli import main

    assert main(["soma", "variance", "--out", str(tmp_path), "--probes", "1200"]) == 0
    rows = list(csv.DictReader((tmp_path / "variance.csv").open()))
    assert [r["x"] for r in rows] == ["1", "2", "4", "8", "independent", "summed"]
    for r in rows:
        assert float(r["measured"]) == pytest.approx(float(r["predicted"]), rel=0.2), r
    measured = {r["x"]: float(r["measured"]) for r in rows}
    assert measured["1"] / measured["8"] == pytest.approx(8, rel=0.25)
    assert measured["summed"] / measured["independent"] == pytest.approx(4, rel=0.25)
    assert (tmp_path / "variance.png").stat().st_size > 10_000
    assert main(["soma", "variance", "--out", str(tmp_path), "--probes", "1"]) == 2
