"""The verdict rule of ``megatron-ext bench paper`` and its report: the 95% t-interval against
scipy-free arithmetic written out here, every verdict reachable as documented, a precondition
that is not met gives "not testable here" whatever Q says, "equal" claims are never widened by
the spread, and a smoke (``--quick``) report states no verdict at all."""

from __future__ import annotations

import math
import statistics

import pytest

from megatron_ext.bench.paper import JSON_KEYS
from megatron_ext.bench.paper.claims import (
    SMOKE,
    UNIGRAM_MARGIN,
    VERDICTS,
    Claim,
    Fact,
    Precondition,
    below_unigram,
    byte_unigram_entropy,
    t_interval,
    verdict,
)
from megatron_ext.bench.paper.report import StudyResult, markdown, payload
from megatron_ext.errors import ConfigError
from tests.test_docs_results import fake_meta

#: Student-t 0.975 quantiles for 2, 3 and 4 degrees of freedom (printed statistical tables)
T975 = {2: 4.302652729911275, 3: 3.182446305284263, 4: 2.7764451051977987}


def test_the_t_interval_is_the_mean_plus_minus_t_times_the_standard_error() -> None:
    for values in ((0.3, 0.5, 0.4), (1.0, 2.0, 3.5, 0.5), (0.1, -0.2, 0.05, 0.3, 0.0)):
        n = len(values)
        m = sum(values) / n
        sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
        half = T975[n - 1] * sd / math.sqrt(n)
        assert t_interval(values) == pytest.approx((m - half, m + half), rel=1e-9)
    assert t_interval((0.2, 0.2, 0.2)) == (pytest.approx(0.2), pytest.approx(0.2))


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ((0.30, 0.50, 0.40), "reproduced"),  # [0.15, 0.65]
        ((0.10, 0.40, 0.45), "within noise"),  # lo < 0 < hi
        ((-0.01, 0.50, 0.30), "within noise"),
        ((-0.30, -0.50, -0.40), "not reproduced"),
        ((0.0, 0.0, 0.0), "within noise"),  # no difference at all
        ((0.2, 0.2, 0.2), "reproduced"),  # identical seeds, positive
        ((1.0, 2.0, 3.5), "within noise"),  # old rule's m > r would also fail; t: lo = −0.8
        ((3.0, 3.5, 4.0), "reproduced"),
        ((0.05, 0.9, 0.95), "within noise"),  # every seed > 0 and m > r, but lo < 0
    ],
)
def test_positive_claims(values: tuple[float, ...], expected: str) -> None:
    assert verdict(values, "positive") == expected


@pytest.mark.parametrize(
    ("values", "tolerance", "expected"),
    [
        ((0.001, -0.001, 0.0), 0.01, "reproduced"),  # interval inside [−τ, τ]
        ((0.10, 0.12, 0.11), 0.01, "not reproduced"),  # interval above τ
        ((0.10, 0.12, 0.11), 0.15, "reproduced"),  # ... but inside a wider (fixed) tolerance
        ((-0.5, 0.6, 0.0), 0.05, "within noise"),  # noisy: the old rule called this equal
        ((0.0, 0.02, 0.04), 0.03, "within noise"),  # straddles τ
    ],
)
def test_equal_claims(values: tuple[float, ...], tolerance: float, expected: str) -> None:
    assert verdict(values, "equal", tolerance) == expected


def test_an_unmet_precondition_overrides_any_q() -> None:
    for values, expect in (((0.3, 0.5, 0.4), "positive"), ((-0.3, -0.5, -0.4), "positive")):
        assert verdict(values, expect, precondition_met=False) == "not testable here"
    pre = below_unigram("worst test loss", [3.1, 2.9, 3.0], entropy=3.28)
    assert pre.threshold == pytest.approx(3.28 - UNIGRAM_MARGIN)
    assert not pre.met and pre.worst == 3.1  # one seed short of the margin is enough
    claim = Claim("a.x", "A beats B", "Fig. 1", "0.1", "Q", (0.3, 0.5, 0.4), precondition=pre)
    assert claim.verdict == "not testable here"
    met = below_unigram("worst test loss", [2.5, 2.9, 2.7], entropy=3.28)
    assert met.met and met.worst == 2.9
    assert Claim("a.x", "A", "F", "0.1", "Q", (0.3, 0.5, 0.4), precondition=met).verdict == (
        "reproduced"
    )
    above = Precondition("routing gain >= 0.02", (0.05, 0.01, 0.03), 0.02, below=False)
    assert not above.met and above.worst == 0.01
    assert not Precondition("diverged", (1.0, math.nan, 1.0), 2.0).met
    # a seed's Q not finite (a 4× run that never reached its target: inf − inf): no interval,
    # so no verdict either way, for both kinds of claim
    for values in ((0.3, math.inf, 0.4), (math.nan, math.nan, math.nan)):
        assert verdict(values, "positive") == "not testable here"
        assert verdict(values, "equal", 0.1) == "not testable here"


def test_refusals() -> None:
    with pytest.raises(ConfigError, match=">= 3 seeds"):
        verdict((0.5, 0.6), "positive")
    with pytest.raises(ValueError, match="expect"):
        verdict((0.5, 0.6, 0.7), "larger")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="tolerance > 0"):
        Claim("a.y", "C equals D", "T", "=", "Q", (0.1, 0.1, 0.1), "equal")


def test_byte_unigram_entropy() -> None:
    assert byte_unigram_entropy([5, 5]) == pytest.approx(math.log(2))
    assert byte_unigram_entropy([1] * 256 + [0] * 3) == pytest.approx(math.log(256))
    counts = [3, 1, 0, 4]
    p = [c / 8 for c in counts if c]
    assert byte_unigram_entropy(counts) == pytest.approx(-sum(x * math.log(x) for x in p))


def _result() -> StudyResult:
    met = below_unigram("worst test loss", [1.9, 2.0, 1.8], entropy=3.0)
    claims = [
        Claim("a.x", "A beats B", "Fig. 1", "0.10 nats", "loss(B) − loss(A), nats",
              (0.3, 0.5, 0.4), precondition=met),
        Claim("a.y", "C equals D", "Tab. 2", "equal", "loss(C) − loss(D)", (0.1, 0.12, 0.11),
              "equal", tolerance=0.05, note="shorter runs than the paper's"),
        Claim("a.z", "E beats F", "Fig. 3", "0.2", "loss(F) − loss(E)", (0.3, 0.5, 0.4),
              precondition=below_unigram("worst test loss", [2.9, 2.8, 2.8], entropy=3.0)),
    ]  # fmt: skip
    facts = [Fact("f.speed", "QR step over eigh step", (0.5, 0.6, 0.55), "ratio")]
    return StudyResult(
        claims, {"steps": 10}, {"A": {1: {"loss": 1.0}}}, ["curves.png"], ["n1"], facts
    )


def test_report_holds_every_claim_its_interval_and_precondition() -> None:
    meta = fake_meta("paper", "megatron-ext bench paper toy", "each claim's baseline arm")
    report = payload("toy", "toy.txt", _result(), [1, 2, 3], "full", meta)
    assert tuple(report) == JSON_KEYS
    verdicts = [c["verdict"] for c in report["claims"]]
    assert verdicts == ["reproduced", "not reproduced", "not testable here"]
    first = report["claims"][0]
    assert first["mean"] == pytest.approx(0.4) and first["spread"] == pytest.approx(0.2)
    sd = statistics.stdev((0.3, 0.5, 0.4))
    assert first["t_interval"] == pytest.approx([0.4 - T975[2] * sd / 3**0.5,
                                                 0.4 + T975[2] * sd / 3**0.5])  # fmt: skip
    assert first["precondition"]["met"] and first["precondition"]["worst"] == 2.0
    assert report["claims"][1]["precondition"] is None
    assert report["facts"] == [
        {"id": "f.speed", "statement": "QR step over eigh step", "values": [0.5, 0.6, 0.55],
         "unit": "ratio"}
    ]  # fmt: skip
    page = markdown(report, "Toy")
    assert "- command: `megatron-ext bench paper toy`" in page
    assert "| A beats B | Fig. 1 | 0.10 nats |" in page
    assert "**reproduced**" in page and "**not reproduced**" in page
    assert "**not testable here**" in page and "**not met**" in page
    assert "[0.152, 0.648]" in page  # the t-interval beside the range
    assert "0.3, 0.5, 0.4" in page and "(≈ 0 within 0.05)" in page
    assert "f.speed: QR step over eigh step: 0.5, 0.6, 0.55" in page
    assert "a.y: shorter runs than the paper's" in page and "- n1" in page
    assert "![curves](curves.png)" in page and "Test CPU, 2 cores, no GPU" in page


def test_a_smoke_report_states_no_verdict() -> None:
    meta = fake_meta("paper", "megatron-ext bench paper toy --quick", "each claim's baseline arm")
    report = payload("toy", "toy.txt", _result(), [1], "quick", meta)
    assert all(c["verdict"] is None for c in report["claims"])
    assert report["verdict_rule"] == SMOKE
    page = markdown(report, "Toy")
    assert SMOKE in page
    for word in VERDICTS:
        assert word not in page, word


def test_an_unreached_target_is_reported_not_testable_without_an_interval() -> None:
    """A tokens-to-target claim whose run never reached its target in a seed (inf) or in both
    arms (nan): no t-interval, "not testable here", and the page renders (the full optimizers
    study of 2026-12-05 crashed here, in its report step, after all 84 runs)."""
    meta = fake_meta("paper", "megatron-ext bench paper toy", "each claim's baseline arm")
    result = _result()
    result.claims[:] = [
        Claim("t.inf", "A needs more tokens", "Fig. 7", "curves", "ln T(A) − ln T(B)",
              (math.inf, math.inf, 0.5)),
        Claim("t.nan", "A needs more tokens", "Fig. 7", "curves", "ln T(A) − ln T(C)",
              (math.nan, math.nan, math.nan)),
    ]  # fmt: skip
    report = payload("toy", "toy.txt", result, [1, 2, 3], "full", meta)
    assert [c["t_interval"] for c in report["claims"]] == [None, None]
    assert [c["verdict"] for c in report["claims"]] == ["not testable here"] * 2
    page = markdown(report, "Toy")
    assert page.count("**not testable here**") == 2 and "| inf |" in page
