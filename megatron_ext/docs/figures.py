"""Which figures a docs page quotes as measured, and whether a results file holds each.

The rule (documented in ``docs/development.md``, "Figures in the docs"):

* A **measured block** is a paragraph (lines up to the next blank line; a table written right
  under the line belongs to it) whose first line starts with ``Measured`` (or ``**Measured``)
  and links one or more results pages (``results/<name>/<name>.md``). Every number in it --
  outside link targets and inline code -- must be printed, as the same token, on one of the
  pages it links (the page :mod:`megatron_ext.docs.render` generated from the JSON). So a
  quote is exact: ``0.5201`` is found only where the page prints ``0.5201``.
* **Outside** measured blocks a page may hold configuration (``d = 512``, ``16 experts``) and a
  paper's own figures, cited in parentheses that start with ``paper``, ``Sec.``, ``Fig.``,
  ``Table``, ``Eq.`` or ``App.`` (``(paper 9.19×)``, ``(Table 12: 9.19×)``), but
  no number with a unit of measured speed or time, nor a decimal ratio (:data:`MEASURED_UNIT`:
  s/step, tokens/s, GFLOP/s, ms, ``0.52×`` -- not ``4 × 8`` ranks): such a figure is a
  measurement typed by hand; nor a table whose header names a measured quantity
  (:data:`MEASURED_HEADER`: s/step, tokens/s, loss, speedup, MFU ...). A block of a
  simulation's figures (``bench plan``) starts with ``Predicted`` instead, under the same rule.

Code blocks are neither (they show commands and their printed form). Torch-free.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MEASURED_UNIT", "NUMBER", "Problem", "check_page", "numbers"]

#: a figure as printed: 1,234,567 / 0.5201 / 3.2e-05 (not the 16 of bf16 or the 512 of d512)
NUMBER = re.compile(r"(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:e[-+]?\d+)?(?![\w])")
#: a number with the unit of a measured speed, time or ratio
MEASURED_UNIT = re.compile(
    r"(?<![\w.])\d[\d,]*(?:\.\d+)?\s*(?:[KMG]\s*)?"
    r"(?:s/step|s / step|s per step|s / update|s/update|tokens/s|tok/s|tasks/s|GFLOP/s|"
    r"TFLOP/s|ms\b)|(?<![\w.])\d+\.\d+\s*×"
)
#: the first line of a measured block (``Predicted`` for a simulation's figures, e.g. ``bench
#: plan``: the same rule), and the results pages it links
MEASURED_START = re.compile(r"^\**(?:Measured|Predicted)\b")
RESULTS_LINK = re.compile(r"\]\(((?:[^)\s]*/)?results/[^)\s#]+\.md)(?:#[^)\s]*)?\)")
#: a table header naming a measured quantity (a table of measurements, whatever its cells say)
MEASURED_HEADER = re.compile(
    r"s/step|s / update|tokens/s|tok/s|tasks/s|GFLOP/s|TFLOP/s|\bloss\b|speedup|\bMFU\b", re.I
)
_CODE_BLOCK = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
_PAPER_CITATION = re.compile(r"\((?:paper\b|Sec\. |Fig\. |Table |Eq\. |App\. )[^)]*\)")


@dataclass(frozen=True)
class Problem:
    """One figure that fails the rule: where, which, and why."""

    page: Path
    line: int
    figure: str
    why: str

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.figure!r} {self.why}"


def numbers(text: str) -> set[str]:
    """Every number token printed in ``text`` (link targets and inline code included: a
    results page prints its command in code)."""
    return set(NUMBER.findall(text))


def _blank_code(text: str) -> str:
    """``text`` with code blocks blanked (newlines kept, so line numbers stay)."""
    return _CODE_BLOCK.sub(lambda m: "\n" * m.group(0).count("\n"), text)


def _plain(line: str) -> str:
    """A line without inline code and link targets (their numbers are no quotes)."""
    return _LINK_TARGET.sub("]()", _INLINE_CODE.sub("``", line))


def check_page(page: Path) -> list[Problem]:
    """Every problem of ``page`` under the rule above (an empty list: it passes)."""
    lines = _blank_code(page.read_text()).splitlines()
    problems: list[Problem] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if MEASURED_START.match(line.strip()):
            end = i
            while end < len(lines) and lines[end].strip():
                end += 1
            block = lines[i:end]
            links = RESULTS_LINK.findall(block[0])
            if not links:
                problems.append(Problem(page, i + 1, "Measured", "links no results page"))
            held: set[str] = set()
            for link in links:
                target = (page.parent / link).resolve()
                if not target.is_file():
                    problems.append(Problem(page, i + 1, link, "is no results page"))
                    continue
                held |= numbers(target.read_text())
            for offset, text in enumerate(block):
                body = _plain(text)
                if offset == 0:
                    body = MEASURED_START.sub("", body.strip())
                for figure in NUMBER.findall(body):
                    if links and figure not in held:
                        problems.append(
                            Problem(
                                page,
                                i + offset + 1,
                                figure,
                                f"is not printed on the linked results page(s) {links}",
                            )
                        )
            i = end
            continue
        is_header = line.lstrip().startswith("|") and i + 1 < len(lines)
        if is_header and lines[i + 1].lstrip().startswith("|-") and MEASURED_HEADER.search(line):
            problems.append(
                Problem(
                    page,
                    i + 1,
                    line.strip()[:60],
                    "heads a table of measured figures outside a `Measured (...)` block",
                )
            )
        body = _PAPER_CITATION.sub("", _plain(line))
        for match in MEASURED_UNIT.finditer(body):
            problems.append(
                Problem(
                    page,
                    i + 1,
                    match.group(0),
                    "is a measured figure outside a `Measured ([...](results/...md))` block",
                )
            )
        i += 1
    return problems
