"""What a study of ``megatron-ext bench paper`` hands back, and its report: JSON, Markdown table
shaped like the paper's (the paper's figure beside ours, the seed spread, the verdict) and the
study's plots, all under the run folder."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.bench.paper.claims import SMOKE, VERDICT_RULE, Claim, Fact

__all__ = ["StudyResult", "markdown", "payload"]


@dataclass
class StudyResult:
    """A study's outcome.

    Args:
        claims: one :class:`Claim` per comparison, in the paper's order.
        settings: the scale the study ran at (model sizes, steps, tokens, ...), JSON-able.
        arms: every run's own figures, ``arms[arm][seed] = {...}`` (losses, counts, times,
            curves), JSON-able: what the claims were computed from.
        plots: the PNGs the study wrote, relative to its run folder.
        notes: what departs from the paper's setting, in words (printed under the table).
        facts: measured comparisons that hold by construction (no verdict).
    """

    claims: list[Claim]
    settings: dict[str, Any]
    arms: dict[str, Any]
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    facts: list[Fact] = field(default_factory=list)


def payload(
    study: str,
    paper: str,
    result: StudyResult,
    seeds: list[int],
    size: str,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The JSON report (keys: :data:`megatron_ext.bench.paper.JSON_KEYS`); ``meta`` is the run's
    (:func:`megatron_ext.bench.common.run_meta`: command, date, machine, anchor). A ``quick``
    run is a smoke run: its claims carry no verdict and its rule is :data:`SMOKE`."""
    smoke = size == "quick"
    return {
        "study": study,
        "paper": paper,
        "size": size,
        "seeds": seeds,
        "settings": result.settings,
        "meta": meta,
        "verdict_rule": SMOKE if smoke else VERDICT_RULE,
        "claims": [c.to_json(smoke) for c in result.claims],
        "facts": [f.to_json() for f in result.facts],
        "arms": result.arms,
        "plots": result.plots,
        "notes": result.notes,
    }


def _num(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def _interval(c: dict[str, Any]) -> str:
    ti = c.get("t_interval")
    finite = all(math.isfinite(v) for v in c["values"])
    if "t_interval" not in c and len(c["values"]) >= 2 and finite:  # an older report's
        from megatron_ext.bench.paper.claims import t_interval

        ti = t_interval(c["values"])
    return f"[{_num(ti[0])}, {_num(ti[1])}]" if ti else "—"


def _precondition(c: dict[str, Any]) -> str:
    pre = c.get("precondition", "absent")
    if pre == "absent":
        return "not recorded (run before preconditions were checked)"
    if pre is None:
        return "none (no training involved)"
    return f"{pre['what']}: worst {_num(pre['worst'])} — **{'met' if pre['met'] else 'not met'}**"


def markdown(report: dict[str, Any], title: str) -> str:
    """The report as a Markdown page: provenance, the claims table, the facts, the notes and the
    plots. A smoke (``quick``) report's page says so first and prints no verdicts."""
    from megatron_ext.bench.common import provenance

    smoke = report["size"] == "quick"
    lines = [f"# {title}", ""]
    if smoke:
        lines += [f"**{SMOKE}**: tiny settings, the figures are no evidence either way.", ""]
    if any("precondition" not in c for c in report["claims"]):
        lines += [
            "**Superseded rules**: this report was written before every claim carried a "
            "precondition and a t-interval verdict over >= 3 seeds (issue 39); its verdicts follow "
            "the older rule printed below, and the interval column is computed from its values.",
            "",
        ]
    lines += [
        *provenance(report["meta"]),
        f"Size `{report['size']}`, seeds {report['seeds']} (paper: `{report['paper']}`).",
        "",
        "| claim | paper | paper's figure | Q (what is measured) | ours: mean | 95% t-interval "
        "| range | per seed | precondition | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in report["claims"]:
        per_seed = ", ".join(_num(v) for v in c["values"])
        quantity = c["quantity"] + (
            f" (≈ 0 within {_num(c['tolerance'])})" if c["expect"] == "equal" else ""
        )
        verdict = f"**{c['verdict']}**" if c["verdict"] else "—"
        lines.append(
            f"| {c['claim']} | {c['source']} | {c['paper']} | {quantity} | {_num(c['mean'])} | "
            f"{_interval(c)} | {_num(c['spread'])} | {per_seed} | {_precondition(c)} | "
            f"{verdict} |"
        )
    lines += ["", f"Verdict rule: {report['verdict_rule']}", ""]
    facts = report.get("facts", [])
    if facts:
        lines += ["Facts (hold by construction or are no claim of the paper; no verdict):", ""]
        lines += [
            f"- {f['id']}: {f['statement']}: "
            + ", ".join(_num(v) for v in f["values"])
            + f" ({f['unit']}, per seed)"
            for f in facts
        ]
        lines.append("")
    notes = [*report["notes"], *(f"{c['id']}: {c['note']}" for c in report["claims"] if c["note"])]
    if notes:
        lines += ["Notes:", "", *(f"- {n}" for n in notes), ""]
    settings = ", ".join(f"{k} = {v}" for k, v in report["settings"].items())
    lines += [f"Settings: {settings}.", ""]
    lines += [f"![{Path(p).stem}]({p})" for p in report["plots"]]
    return "\n".join(lines).rstrip() + "\n"
