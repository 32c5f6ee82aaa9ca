"""The verdict rule of ``megatron-ext bench paper`` and its report: every verdict is reachable and
decided by the seed spread as documented; the report carries every claim's figures."""

from __future__ import annotations

import pytest

from megatron_ext.bench.paper import JSON_KEYS
from megatron_ext.bench.paper.claims import Claim, verdict
from megatron_ext.bench.paper.report import StudyResult, markdown, payload
from megatron_ext.errors import ConfigError
from tests.test_docs_results import fake_meta


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ((0.30, 0.50), "reproduced"),  # m = 0.4 > r = 0.2
        ((0.10, 0.40), "within noise"),  # m = 0.25 < r = 0.3
        ((0.01, 0.50), "within noise"),  # both positive, but spread larger than the mean
        ((-0.01, 0.50), "within noise"),
        ((-0.30, -0.50), "not reproduced"),
        ((0.0, 0.0), "within noise"),  # no difference at all
        ((0.2, 0.2, 0.2), "reproduced"),  # identical seeds, positive: r = 0
        ((1.0, 2.0, 3.5), "within noise"),  # m = 2.17 < r = 2.5
        ((3.0, 3.5, 4.0), "reproduced"),  # m = 3.5 > r = 1
    ],
)
def test_positive_claims(values: tuple[float, ...], expected: str) -> None:
    assert verdict(values, "positive") == expected


@pytest.mark.parametrize(
    ("values", "tolerance", "expected"),
    [
        ((0.01, -0.01), 0.0, "reproduced"),  # |m| = 0 <= r
        ((0.10, 0.12), 0.0, "not reproduced"),  # |m| = 0.11 > r = 0.02
        ((0.10, 0.12), 0.15, "reproduced"),  # ... but within the tolerance
        ((-0.5, 0.6), 0.0, "reproduced"),  # noisy: |m| = 0.05 <= r
    ],
)
def test_equal_claims(values: tuple[float, ...], tolerance: float, expected: str) -> None:
    assert verdict(values, "equal", tolerance) == expected


def test_one_seed_is_refused() -> None:
    with pytest.raises(ConfigError, match=">= 2 seeds"):
        verdict((0.5,), "positive")
    with pytest.raises(ValueError, match="expect"):
        verdict((0.5, 0.6), "larger")  # type: ignore[arg-type]


def test_report_holds_every_claim() -> None:
    claims = [
        Claim("a.x", "A beats B", "Fig. 1", "0.10 nats", "loss(B) − loss(A), nats", (0.3, 0.5)),
        Claim(
            "a.y",
            "C equals D",
            "Tab. 2",
            "equal",
            "loss(C) − loss(D)",
            (0.1, 0.12),
            "equal",
            tolerance=0.05,
            note="shorter runs than the paper's",
        ),
    ]
    result = StudyResult(claims, {"steps": 10}, {"A": {1: {"loss": 1.0}}}, ["curves.png"], ["n1"])
    meta = fake_meta("paper", "megatron-ext bench paper toy", "each claim's baseline arm")
    report = payload("toy", "toy.txt", result, [1, 2], "quick", meta)
    assert tuple(report) == JSON_KEYS
    assert [c["verdict"] for c in report["claims"]] == ["reproduced", "not reproduced"]
    assert report["claims"][0]["mean"] == pytest.approx(0.4)
    assert report["claims"][0]["spread"] == pytest.approx(0.2)
    page = markdown(report, "Toy")
    assert "- command: `megatron-ext bench paper toy`" in page
    assert "- machine: Test CPU, 2 cores, no GPU; torch 2.9" in page
    assert "| A beats B | Fig. 1 | 0.10 nats |" in page
    assert "**reproduced**" in page and "**not reproduced**" in page
    assert "0.3, 0.5" in page and "(≈ 0 within 0.05)" in page
    assert "a.y: shorter runs than the paper's" in page and "- n1" in page
    assert "![curves](curves.png)" in page and "Test CPU, 2 cores, no GPU" in page
