"""A paper's claim against our runs: per-seed values of one quantity, and a verdict decided by
the seed-to-seed spread (never by hand).

Every study of ``megatron-ext bench paper`` reduces each of its comparisons to one number per seed,
signed so that the paper's claim reads ``Q > 0`` ("AdamW's loss rises with the batch more than
Muon's": Q = rise(AdamW) − rise(Muon)), or ``Q ≈ 0`` within a stated tolerance ("the sharded
model matches the dense one"). With ``m`` the mean of Q over the seeds and ``r`` its range
(max − min, the seed-to-seed spread):

- ``expect="positive"``: **reproduced** when ``m > r`` (then every seed has Q > 0 and the mean is
  further from zero than the seeds are from each other), **not reproduced** when ``m < −r``
  (the opposite direction, as clearly), **within noise** otherwise;
- ``expect="equal"``: **reproduced** when ``|m| ≤ max(r, tolerance)``, **not reproduced**
  otherwise (the difference is larger than both the spread and the tolerance).

At least two seeds are required: with one there is no spread to decide by.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from megatron_ext.errors import ConfigError

__all__ = ["VERDICTS", "VERDICT_RULE", "Claim", "Expect", "Verdict", "verdict"]

Expect = Literal["positive", "equal"]
Verdict = Literal["reproduced", "not reproduced", "within noise"]
VERDICTS: tuple[Verdict, ...] = ("reproduced", "not reproduced", "within noise")

#: the rule, as the reports print it
VERDICT_RULE = (
    "Q per seed, signed so that the paper's claim is Q > 0 (or Q ≈ 0); m = mean, r = range over "
    "seeds. Q > 0 claims: reproduced if m > r, not reproduced if m < −r, else within noise. "
    "Q ≈ 0 claims: reproduced if |m| ≤ max(r, tolerance), else not reproduced."
)


def verdict(
    values: list[float] | tuple[float, ...], expect: Expect, tolerance: float = 0.0
) -> Verdict:
    """The verdict of a claim whose quantity took ``values`` (one per seed); see the module."""
    if len(values) < 2:
        raise ConfigError(f"a verdict needs the values of >= 2 seeds, got {len(values)}")
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    m = statistics.fmean(values)
    r = max(values) - min(values)
    if expect == "positive":
        if m > r:
            return "reproduced"
        return "not reproduced" if m < -r else "within noise"
    if expect == "equal":
        return "reproduced" if abs(m) <= max(r, tolerance) else "not reproduced"
    raise ValueError(f"expect must be 'positive' or 'equal', got {expect!r}")


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
        tolerance: for ``"equal"``: the largest |mean| that still counts as equal (Q's unit).
        note: what the reader should know (a setting that differs from the paper's, ...).
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
    verdict: Verdict = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", tuple(float(v) for v in self.values))
        object.__setattr__(self, "verdict", verdict(self.values, self.expect, self.tolerance))

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def spread(self) -> float:
        """Range over the seeds (max − min)."""
        return max(self.values) - min(self.values)

    def to_json(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "values": list(self.values),
            "mean": self.mean,
            "spread": self.spread,
        }
