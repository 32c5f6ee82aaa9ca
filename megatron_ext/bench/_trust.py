"""Ratios a user can trust: interleaved arms, repeated until the spread is small, load checked.

Every benchmark that reports a time ratio (``bench optimizers``, ``bench layerwise``, ``bench
soma``, ``bench precision``) measures it the same way, through this module:

* **interleaved**: one *round* times every arm once, in alternating order (A B, then B A, ...:
  :func:`round_order`), so a slow minute of a shared machine falls on both arms, not on one;
* **repeated**: rounds continue (:func:`timed_rounds`, :func:`run_interleaved`, or a
  benchmark's own loop over :func:`round_order` and :class:`Repeat`) until the ratio's spread is
  at most ``--spread`` (default
  :data:`DEFAULT_SPREAD`, ±5 %) or the time budget ``--budget`` runs out
  (:class:`Repeat`); at least ``min_rounds`` rounds (the benchmark's ``--steps``) are kept;
* **spread**: the ratio is the median of the per-round ratios (arm time / baseline time, the
  same round), and its spread the half-width of a distribution-free ≈95 % confidence interval
  of that median (order statistics n/2 ± 0.98·√n), relative to the median
  (:func:`ratio_spread`); printed with every ratio and written to the JSON;
* **load**: the 1-minute load average is compared with the cores the benchmark uses; above it
  a warning is printed and recorded (:func:`load_check`): other processes then share the cores
  and times stretch (same-round ratios suffer least).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_SPREAD = 0.05
DEFAULT_BUDGET_S = 120.0


def add_trust_arguments(
    parser: argparse.ArgumentParser, budget_s: float = DEFAULT_BUDGET_S
) -> None:
    """``--spread``, ``--budget`` and ``--max-rounds`` (the stopping rule of :class:`Repeat`)."""
    parser.add_argument(
        "--spread",
        type=float,
        default=DEFAULT_SPREAD,
        help=f"repeat until every ratio's ≈95%% CI half-width / median is at most this "
        f"(default {DEFAULT_SPREAD})",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=budget_s,
        help=f"seconds of timed rounds at most, per comparison (default {budget_s:g})",
    )
    parser.add_argument("--max-rounds", type=int, default=200, help="rounds at most (default 200)")


@dataclasses.dataclass(frozen=True)
class RatioSpread:
    """A ratio as the median of per-round ratios with its ≈95 % CI (:func:`ratio_spread`)."""

    median: float
    low: float
    high: float
    rounds: int

    @property
    def spread(self) -> float:
        """Half-width of the CI over the median (0.05: ±5 %)."""
        if not self.median or self.rounds < 2:
            return math.inf
        return (self.high - self.low) / (2 * abs(self.median))

    def as_dict(self) -> dict[str, Any]:
        spread = self.spread
        return {
            "median": self.median,
            "low": self.low,
            "high": self.high,
            "rounds": self.rounds,
            "spread": None if math.isinf(spread) else spread,
        }

    def __str__(self) -> str:
        spread = self.spread
        shown = "n/a" if math.isinf(spread) else f"±{100 * spread:.1f}%"
        return f"{self.median:.3f} ({shown}, {self.rounds} rounds)"


def ratio_spread(ratios: Sequence[float]) -> RatioSpread:
    """The median of ``ratios`` and the order statistics that bound it with ≈95 % confidence
    (ranks n/2 ± 0.98·√n, clipped to the sample: with few rounds, the min and max)."""
    if not ratios:
        raise ValueError("ratio_spread needs at least one ratio")
    xs = sorted(ratios)
    n = len(xs)
    lo = max(0, math.floor(n / 2 - 0.98 * math.sqrt(n)))
    hi = min(n - 1, math.ceil(n / 2 + 0.98 * math.sqrt(n)) - 1)
    return RatioSpread(statistics.median(xs), xs[lo], xs[hi], n)


def round_order(names: Sequence[Any], round_index: int) -> list[Any]:
    """The arms' order in round ``round_index``: as given on even rounds, reversed on odd."""
    return list(names) if round_index % 2 == 0 else list(reversed(names))


@dataclasses.dataclass
class Repeat:
    """When to stop adding rounds: after ``min_rounds``, once every ratio's spread is at most
    ``spread``, or when ``budget_s`` seconds have passed since the start, or at ``max_rounds``.
    ``reason`` says which."""

    spread: float = DEFAULT_SPREAD
    budget_s: float = DEFAULT_BUDGET_S
    min_rounds: int = 3
    max_rounds: int = 200
    started: float = dataclasses.field(default_factory=time.perf_counter)
    reason: str = ""

    def done(self, rounds: int, ratios: Sequence[Sequence[float]]) -> bool:
        """Whether to stop after ``rounds`` rounds; ``ratios``: per compared arm, its
        per-round ratios so far."""
        if rounds < self.min_rounds:
            return False
        worst = max((ratio_spread(r).spread for r in ratios if r), default=0.0)
        if worst <= self.spread:
            self.reason = f"spread {100 * worst:.1f}% <= {100 * self.spread:.1f}%"
        elif time.perf_counter() - self.started >= self.budget_s:
            self.reason = (
                f"time budget {self.budget_s:g} s spent (spread {100 * worst:.1f}% > "
                f"{100 * self.spread:.1f}%)"
            )
        elif rounds >= self.max_rounds:
            self.reason = f"{self.max_rounds} rounds (spread {100 * worst:.1f}%)"
        else:
            return False
        return True

    def as_dict(self) -> dict[str, Any]:
        return {
            "spread_bound": self.spread,
            "budget_s": self.budget_s,
            "min_rounds": self.min_rounds,
            "max_rounds": self.max_rounds,
            "stopped": self.reason,
        }


def timed_rounds(
    fns: Sequence[Callable[[], Any]],
    repeat: Repeat,
    ratios_of: Callable[[list[list[float]]], Sequence[Sequence[float]]],
    sync: Callable[[], Any] = lambda: None,
) -> list[list[float]]:
    """Wall seconds of each function in each round, called in :func:`round_order` until
    ``repeat`` stops on ``ratios_of(times so far)`` (the per-round ratios whose spread counts);
    ``sync`` waits for queued device work (CUDA) before each clock reading."""
    times: list[list[float]] = [[] for _ in fns]
    rounds = 0
    while True:
        for i in round_order(range(len(fns)), rounds):
            sync()
            t0 = time.perf_counter()
            fns[i]()
            sync()
            times[i].append(time.perf_counter() - t0)
        rounds += 1
        if repeat.done(rounds, ratios_of(times)):
            return times


def run_interleaved(
    arms: dict[str, Callable[[], float]], baseline: str, repeat: Repeat
) -> dict[str, Any]:
    """Time ``arms`` (each call returns its own measured seconds) round by round in
    :func:`round_order` until ``repeat`` stops; per arm its times, and for every arm but
    ``baseline`` its per-round ratios to it and their :func:`ratio_spread`."""
    names = list(arms)
    times: dict[str, list[float]] = {n: [] for n in names}
    others = [n for n in names if n != baseline]
    rounds = 0
    while True:
        for name in round_order(names, rounds):
            times[name].append(arms[name]())
        rounds += 1
        ratios = {
            n: [a / b for a, b in zip(times[n], times[baseline], strict=True)] for n in others
        }
        if repeat.done(rounds, list(ratios.values())):
            break
    return {
        "times": times,
        "ratios": {n: ratio_spread(r).as_dict() for n, r in ratios.items()},
        "repeat": repeat.as_dict(),
    }


def load_check(cores_used: int, label: str) -> dict[str, Any]:
    """The host's load averages beside the cores the benchmark uses; prints a warning when the
    1-minute load exceeds them. Returns ``{"load_average", "cores_used", "cores", "warning"}``."""
    load = [round(x, 2) for x in os.getloadavg()]
    warning = None
    if load[0] > cores_used:
        warning = (
            f"[{label}] warning: load average {load[0]:.2f} exceeds the {cores_used} core(s) "
            f"this benchmark uses (host: {os.cpu_count()} cores): other processes share them, "
            f"times stretch; compare same-run ratios, or rerun on an idle machine"
        )
        print(warning)
    return {
        "load_average": load,
        "cores_used": cores_used,
        "cores": os.cpu_count(),
        "warning": warning,
    }
