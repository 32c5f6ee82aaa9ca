"""The shared timing rules of the benchmarks (``megatron_ext.bench._trust``): interleaved order,
the median ratio's confidence interval, when repeating stops, the load warning."""

from __future__ import annotations

import math

import pytest

from megatron_ext.bench import _trust as trust
from megatron_ext.bench._trust import Repeat, load_check, ratio_spread, round_order, run_interleaved


def _coverage(n: int, lo: int, hi: int) -> float:
    """P(X_(lo+1) <= median <= X_(hi+1)) for n draws of a continuous variable: the number of
    draws below the median is Binomial(n, 1/2), and the interval holds the median when that
    number is in [lo + 1, hi]."""
    return sum(math.comb(n, k) for k in range(lo + 1, hi + 1)) / 2**n


@pytest.mark.parametrize("n", [10, 25, 100, 400])
def test_the_interval_is_order_statistics_with_about_95_percent_coverage(n: int) -> None:
    xs = [float(i) for i in range(n)]
    est = ratio_spread(list(reversed(xs)))
    lo, hi = int(est.low), int(est.high)  # the values are their own ranks
    assert est.median == (n - 1) / 2 and est.rounds == n
    assert 0.93 <= _coverage(n, lo, hi) <= 0.985, (n, lo, hi, _coverage(n, lo, hi))
    assert est.spread == pytest.approx((est.high - est.low) / (2 * est.median))


def test_few_rounds_give_the_whole_range_and_one_round_no_spread() -> None:
    est = ratio_spread([1.0, 0.9, 1.2, 1.1, 1.0])
    assert (est.low, est.median, est.high) == (0.9, 1.0, 1.2)
    assert math.isinf(ratio_spread([1.0]).spread)
    assert ratio_spread([1.0]).as_dict()["spread"] is None


def test_rounds_alternate_their_order() -> None:
    assert round_order(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert round_order(["a", "b", "c"], 1) == ["c", "b", "a"]


def test_repeat_stops_on_spread_budget_or_rounds_never_before_the_minimum() -> None:
    tight = [[1.0, 1.0, 1.0]]
    assert not Repeat(spread=0.05, min_rounds=4).done(3, tight)
    stop = Repeat(spread=0.05, min_rounds=3)
    assert stop.done(3, tight) and stop.reason.startswith("spread 0.0%")
    loose = [[0.5, 1.0, 2.0, 0.7]]
    assert not Repeat(spread=0.05, budget_s=1e9, min_rounds=2).done(4, loose)
    spent = Repeat(spread=0.05, budget_s=0.0, min_rounds=2)
    assert spent.done(4, loose) and "budget" in spent.reason
    capped = Repeat(spread=0.05, budget_s=1e9, min_rounds=2, max_rounds=4)
    assert capped.done(4, loose) and capped.reason.startswith("4 rounds")


def test_run_interleaved_times_in_rounds_and_reports_each_ratio() -> None:
    calls: list[str] = []
    seconds = {"ours": 1.0, "theirs": 2.0}

    def arm(name: str):
        def timed() -> float:
            calls.append(name)
            return seconds[name]

        return timed

    out = run_interleaved(
        {"ours": arm("ours"), "theirs": arm("theirs")}, "theirs", Repeat(min_rounds=3)
    )
    assert calls == ["ours", "theirs", "theirs", "ours", "ours", "theirs"]
    assert out["ratios"]["ours"]["median"] == 0.5 and out["ratios"]["ours"]["spread"] == 0.0
    assert out["repeat"]["stopped"].startswith("spread")


def test_load_above_the_cores_used_is_warned(monkeypatch, capsys) -> None:
    monkeypatch.setattr(trust.os, "getloadavg", lambda: (6.0, 5.0, 4.0))
    loaded = load_check(2, "bench x")
    assert loaded["warning"] and "6.00 exceeds the 2 core(s)" in capsys.readouterr().out
    monkeypatch.setattr(trust.os, "getloadavg", lambda: (1.5, 1.0, 1.0))
    assert load_check(2, "bench x")["warning"] is None
