"""A paper's claim against our runs: per-seed values of one quantity, the precondition a run must
meet for them to say anything, and a verdict decided by a t-interval over the seeds (never by
hand).

Every study of ``megatron-ext bench paper`` reduces each of its comparisons to one number per seed,
signed so that the paper's claim reads ``Q > 0`` ("AdamW's loss rises with the batch more than
Muon's": Q = rise(AdamW) − rise(Muon)), or ``Q ≈ 0`` within a tolerance fixed in the study's code
before any run ("MOP within 1% of Muon"). With ``m`` the mean of Q over the ``n >= 3`` seeds,
``s`` their standard deviation and ``[lo, hi] = m ± t(0.975, n − 1)·s/√n`` the two-sided 95%
Student-t interval of the mean:

- a claim whose **precondition** is not met (the runs it reads are not trained far enough to be
  informative, the routing targets are uniform, ...) is **not testable here**, whatever Q says;
  so is one where a seed's Q is not finite (a run diverged, or never reached the loss a
  tokens-to-target quantity counts to): there is no interval to decide by;
- ``expect="positive"``: **reproduced** when ``lo > 0``, **not reproduced** when ``hi < 0``,
  **within noise** otherwise;
- ``expect="equal"`` (tolerance ``τ > 0``): **reproduced** when ``[lo, hi] ⊂ [−τ, τ]`` (the
  difference is shown to be small), **not reproduced** when ``[lo, hi]`` lies outside
  ``[−τ, τ]`` (shown to be large), **within noise** otherwise. The tolerance is never widened
  by the spread: a noisy "equal" is not evidence of equality.

A ``--quick`` (smoke) run states no verdict at all: its claims carry ``verdict = None``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megatron_ext.errors import ConfigError

__all__ = [
    "CONFIDENCE",
    "MIN_SEEDS",
    "SMOKE",
    "UNIGRAM_MARGIN",
    "VERDICTS",
    "VERDICT_RULE",
    "Claim",
    "Expect",
    "Fact",
    "Precondition",
    "Verdict",
    "below_unigram",
    "byte_unigram_entropy",
    "t_interval",
    "verdict",
]

Expect = Literal["positive", "equal"]
Verdict = Literal["reproduced", "not reproduced", "within noise", "not testable here"]
VERDICTS: tuple[Verdict, ...] = (
    "reproduced",
    "not reproduced",
    "within noise",
    "not testable here",
)
#: the fewest seeds a verdict is decided on (a t-interval from 2 seeds has t = 12.7: no power)
MIN_SEEDS = 3
#: the two-sided confidence of the interval
CONFIDENCE = 0.95
#: how far (nats per token) below the corpus' unigram entropy a model's held-out loss must be
#: before its comparisons say anything: a model at the unigram entropy has learned only the
#: symbol frequencies, and differences between such models are differences in how fast they
#: fit those (issue 39: SOMA's ensembles at 3.33–3.36 vs 3.28 nats/byte). 0.3 nats is ~10% of the
#: byte corpora's unigram entropies here (3.26 nats/byte for the Language Reference prose, 3.30
#: for the stdlib docstrings' test set, measured 2026-12-05).
UNIGRAM_MARGIN = 0.3
#: what a smoke (``--quick``) run prints instead of a verdict
SMOKE = "smoke run: no verdicts"

#: the rule, as the reports print it
VERDICT_RULE = (
    f"Q per seed (n >= {MIN_SEEDS} seeds), signed so that the paper's claim is Q > 0 (or Q ≈ 0 "
    "within a tolerance τ fixed in the code before the run); [lo, hi] = the 95% Student-t "
    "interval of the mean. Precondition not met: not testable here. Q > 0 claims: reproduced if "
    "lo > 0, not reproduced if hi < 0, else within noise. Q ≈ 0 claims: reproduced if [lo, hi] "
    "lies inside [−τ, τ], not reproduced if it lies outside, else within noise."
)


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float]:
    """The two-sided Student-t confidence interval ``(lo, hi)`` of the mean of ``values``
    (``>= 2`` values; zero width when they are all equal)."""
    from scipy.stats import t

    n = len(values)
    if n < 2:
        raise ConfigError(f"a t-interval needs >= 2 values, got {n}")
    m = statistics.fmean(values)
    half = float(t.ppf(0.5 + confidence / 2, n - 1)) * statistics.stdev(values) / math.sqrt(n)
    return m - half, m + half


def verdict(
    values: Sequence[float],
    expect: Expect,
    tolerance: float = 0.0,
    precondition_met: bool = True,
) -> Verdict:
    """The verdict of a claim whose quantity took ``values`` (one per seed); see the module."""
    if len(values) < MIN_SEEDS:
        raise ConfigError(
            f"a verdict needs the values of >= {MIN_SEEDS} seeds, got {len(values)}: run the "
            f"study with --seeds {MIN_SEEDS} or more"
        )
    if expect not in ("positive", "equal"):
        raise ValueError(f"expect must be 'positive' or 'equal', got {expect!r}")
    if expect == "equal" and not tolerance > 0:
        raise ValueError(f"an 'equal' claim needs a tolerance > 0, got {tolerance}")
    if not precondition_met:
        return "not testable here"
    if not all(math.isfinite(v) for v in values):
        return "not testable here"  # a diverged seed or an unreached target: no interval
    lo, hi = t_interval(values)
    if expect == "positive":
        if lo > 0:
            return "reproduced"
        return "not reproduced" if hi < 0 else "within noise"
    if -tolerance <= lo and hi <= tolerance:
        return "reproduced"
    return "not reproduced" if lo > tolerance or hi < -tolerance else "within noise"


@dataclass(frozen=True)
class Precondition:
    """What the runs a claim reads must reach to be informative, and what they reached.

    Args:
        what: the condition in words, with its threshold and unit.
        measured: the figure it is checked on, per seed (e.g. the worst held-out loss among the
            arms the claim reads, nats/byte).
        threshold: the bound on ``measured``.
        below: ``True``: met when every seed's value is <= threshold; ``False``: >= threshold.
    """

    what: str
    measured: tuple[float, ...]
    threshold: float
    below: bool = True
    met: bool = field(init=False)

    def __post_init__(self) -> None:
        vals = tuple(float(v) for v in self.measured)
        object.__setattr__(self, "measured", vals)
        ok = all(math.isfinite(v) and (v <= self.threshold if self.below else v >= self.threshold)
                 for v in vals)  # fmt: skip
        object.__setattr__(self, "met", bool(vals) and ok)

    @property
    def worst(self) -> float:
        """The seed furthest from meeting it."""
        finite = [v for v in self.measured if math.isfinite(v)]
        if len(finite) < len(self.measured) or not finite:
            return math.nan
        return max(finite) if self.below else min(finite)

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "measured": list(self.measured),
            "worst": self.worst,
            "threshold": self.threshold,
            "met": self.met,
        }


def below_unigram(
    what: str, losses: Sequence[float], entropy: float, unit: str = "nats/byte"
) -> Precondition:
    """The precondition "held-out loss >= :data:`UNIGRAM_MARGIN` below the corpus' unigram
    entropy", on ``losses`` (per seed: the worst loss among the arms a claim reads)."""
    return Precondition(
        f"{what} <= unigram entropy {entropy:.3f} − {UNIGRAM_MARGIN} {unit}",
        tuple(losses),
        entropy - UNIGRAM_MARGIN,
    )


def byte_unigram_entropy(counts: Sequence[int]) -> float:
    """Entropy (nats per symbol) of the unigram distribution with ``counts`` per symbol: the
    loss of a model that has learned only the symbol frequencies."""
    total = sum(counts)
    if total <= 0:
        raise ValueError("byte_unigram_entropy: no symbols counted")
    return -sum(c / total * math.log(c / total) for c in counts if c > 0)


@dataclass(frozen=True)
class Fact:
    """A measured comparison that holds by construction (or is not a claim of the paper): reported
    beside the claims with its figures, never given a verdict."""

    id: str
    statement: str
    values: tuple[float, ...]
    unit: str

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "values": list(self.values)}


@dataclass(frozen=True)
class Claim:
    """One claim of a paper and what our runs say of it.

    Args:
        id: short stable key (``"batch.adamw_degrades"``), unique within a study.
        claim: the claim in words, as the paper makes it.
        source: where the paper makes it (``"Sec. 5.3, Fig. 2"``).
        paper: the paper's own figure(s) for it, as the paper prints them (a string: tables and
            figures are quoted, not re-derived).
        quantity: what Q is, with its unit, signed so the claim is ``Q > 0`` (or ``Q ≈ 0``).
        values: Q for each seed, in the order of the study's seeds.
        expect: ``"positive"`` or ``"equal"``.
        tolerance: for ``"equal"``: the half-width of "equal" (Q's unit), a constant of the
            study's code with its reason (never derived from the run).
        note: what the reader should know (a setting that differs from the paper's, ...).
        precondition: what the runs must reach for Q to be informative (``None``: the claim's
            quantity needs no training, e.g. a measurement at fixed weights).
    """

    id: str
    claim: str
    source: str
    paper: str
    quantity: str
    values: tuple[float, ...]
    expect: Expect = "positive"
    tolerance: float = 0.0
    note: str = ""
    precondition: Precondition | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        if self.expect == "equal" and not self.tolerance > 0:
            raise ValueError(f"{self.id}: an 'equal' claim needs a tolerance > 0")

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def spread(self) -> float:
        """Range over the seeds (max − min)."""
        return max(self.values) - min(self.values)

    @property
    def verdict(self) -> Verdict:
        met = self.precondition is None or self.precondition.met
        return verdict(self.values, self.expect, self.tolerance, met)

    def to_json(self, smoke: bool = False) -> dict[str, Any]:
        """The claim's JSON; ``smoke``: a ``--quick`` run's, with ``verdict = None``."""
        out = {k: v for k, v in asdict(self).items() if k != "precondition"}
        n = len(self.values)
        return {
            **out,
            "values": list(self.values),
            "mean": self.mean,
            "spread": self.spread,
            # none for one seed, or a seed's value not finite (a diverged run, an unreached
            # target: the verdict is then "not testable here")
            "t_interval": list(t_interval(self.values))
            if n >= 2 and all(math.isfinite(v) for v in self.values)
            else None,
            "precondition": self.precondition.to_json() if self.precondition else None,
            "verdict": None if smoke else self.verdict,
        }
