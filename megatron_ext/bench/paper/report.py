"""What a study of ``megatron-ext bench paper`` hands back, and its report: JSON, Markdown table
shaped like the paper's (the paper's figure beside ours, the seed spread, the verdict) and the
study's plots, all under the run folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_ext.bench.paper.claims import VERDICT_RULE, Claim

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
    """

    claims: list[Claim]
    settings: dict[str, Any]
    arms: dict[str, Any]
    plots: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def payload(
    study: str,
    paper: str,
    result: StudyResult,
    seeds: list[int],
    size: str,
    meta: dict[str, Any],
) -> dict[str, Any]:
    """The JSON report (keys: :data:`megatron_ext.bench.paper.JSON_KEYS`); ``meta`` is the run's
    (:func:`megatron_ext.bench.common.run_meta`: command, date, machine, anchor)."""
    return {
        "study": study,
        "paper": paper,
        "size": size,
        "seeds": seeds,
        "settings": result.settings,
        "meta": meta,
        "verdict_rule": VERDICT_RULE,
        "claims": [c.to_json() for c in result.claims],
        "arms": result.arms,
        "plots": result.plots,
        "notes": result.notes,
    }


def _num(x: float) -> str:
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def markdown(report: dict[str, Any], title: str) -> str:
    """The report as a Markdown page: provenance, the claims table, the notes and the plots."""
    from megatron_ext.docs.render import provenance

    lines = [
        f"# {title}",
        "",
        *provenance(report["meta"]),
        f"Size `{report['size']}`, seeds {report['seeds']} (paper: `{report['paper']}`).",
        "",
        "| claim | paper | paper's figure | Q (what is measured) | ours: mean | spread | "
        "per seed | verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in report["claims"]:
        per_seed = ", ".join(_num(v) for v in c["values"])
        quantity = c["quantity"] + (
            f" (≈ 0 within {_num(c['tolerance'])})" if c["expect"] == "equal" else ""
        )
        lines.append(
            f"| {c['claim']} | {c['source']} | {c['paper']} | {quantity} | {_num(c['mean'])} | "
            f"{_num(c['spread'])} | {per_seed} | **{c['verdict']}** |"
        )
    lines += ["", f"Verdict rule: {report['verdict_rule']}", ""]
    notes = [*report["notes"], *(f"{c['id']}: {c['note']}" for c in report["claims"] if c["note"])]
    if notes:
        lines += ["Notes:", "", *(f"- {n}" for n in notes), ""]
    settings = ", ".join(f"{k} = {v}" for k, v in report["settings"].items())
    lines += [f"Settings: {settings}.", ""]
    lines += [f"![{Path(p).stem}]({p})" for p in report["plots"]]
    return "\n".join(lines).rstrip() + "\n"
