"""Results pages from the benchmarks' JSON: ``docs/results/<name>/<name>.md`` and the index
``docs/results/README.md``.

Every JSON a benchmark writes carries ``meta`` (:func:`megatron_ext.bench.common.begin_run`:
command, UTC date, machine, load average, anchor). A results folder ``docs/results/<name>/``
holds one or more such JSON files and the PNGs the benchmark drew; its page is, per JSON, the
run's provenance (:func:`~megatron_ext.bench.common.provenance`) followed by its tables, then
the folder's PNGs. The tables are drawn from the JSON alone (:func:`tables`), so a page changes
only when a JSON does; a study of ``bench paper`` keeps its own claims page
(:func:`megatron_ext.bench.paper.report.markdown`). Numbers are printed by
:func:`~megatron_ext.bench.common.fmt`, the one formatter a docs page's quote must match.
Torch-free: the pages render in well under a second.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_ext.bench.common import fmt, machine_words, provenance
from megatron_ext.errors import ConfigError

__all__ = ["INDEX", "fmt", "provenance", "render_all", "render_folder", "tables"]

#: the index page of a results folder tree
INDEX = "README.md"
#: a list of numbers longer than this is a curve: said by its length, shown in the PNG
LONGEST_INLINE_LIST = 8


def _nested_rows(value: Any, prefix: str) -> list[tuple[str, dict[str, dict[str, Any]]]]:
    """``(dotted key, rows)`` of every list of records nested in ``value`` (a sweep's rows in
    a dict of settings): each gets a table of its own, where the leaf table says its length."""
    if isinstance(value, dict):
        found: list[tuple[str, dict[str, dict[str, Any]]]] = []
        for key, sub in value.items():
            found += _nested_rows(sub, f"{prefix}.{key}")
        return found
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [(prefix, {str(i): v for i, v in enumerate(value)})]
    return []


def _records_table(title: str, records: dict[str, dict[str, Any]]) -> list[str]:
    """A table with a row per record and a column per leaf (in first-seen order)."""
    columns: list[str] = []
    cells: dict[str, dict[str, str]] = {}
    for name, record in records.items():
        cells[name] = dict(_leaves(record))
        columns += [c for c in cells[name] if c not in columns]
    rows = [[name, *(row.get(c, "") for c in columns)] for name, row in cells.items()]
    return [f"**{title}**", "", *_table([title.rsplit(".", 1)[-1], *columns], rows)]


def _leaves(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """``(dotted key, printed value)`` of every leaf; short lists inline, curves by length."""
    if isinstance(value, dict):
        out: list[tuple[str, str]] = []
        for key, sub in value.items():
            out += _leaves(sub, f"{prefix}.{key}" if prefix else str(key))
        return out
    if isinstance(value, list):
        if len(value) > LONGEST_INLINE_LIST or any(isinstance(v, dict | list) for v in value):
            return [(prefix, f"{len(value)} values (in the JSON)")]
        return [(prefix, ", ".join(fmt(v) for v in value) or "none")]
    return [(prefix, fmt(value))]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def _records(value: Any) -> dict[str, dict[str, Any]] | None:
    """``value`` as rows (a dict of dicts, or a list of dicts keyed by position), else None."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return {str(k): v for k, v in value.items()}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return {str(i): v for i, v in enumerate(value)}
    return None


def _own_tables(benchmark: str) -> dict[str, Any]:
    """The benchmark module's ``RESULTS_TABLES`` (top-level key -> its own Markdown table of that
    value), where it defines one; the generic tables draw every other key."""
    from megatron_ext.bench import benchmarks

    module = benchmarks().get(benchmark)
    return dict(getattr(module, "RESULTS_TABLES", {}))


def tables(report: dict[str, Any]) -> list[str]:
    """Markdown tables of a benchmark's figures, one per top-level key of its JSON (``meta``
    aside): the benchmark's own table for a key it names in ``RESULTS_TABLES``; else rows of
    records (a dict or list of dicts) become a table with a column per leaf, any other value a
    two-column table of its leaves."""
    lines: list[str] = []
    scalars: list[tuple[str, str]] = []
    own = _own_tables(report["meta"]["benchmark"])
    for key, value in report.items():
        if key == "meta":
            continue
        if key in own:
            lines += [f"**{key}**", "", *own[key](value).rstrip("\n").splitlines(), ""]
            continue
        records = _records(value)
        if records is None:
            scalars += _leaves(value, key)
            for path, rows in _nested_rows(value, key):
                lines += _records_table(path, rows)
            continue
        lines += _records_table(key, records)
    if scalars:
        pairs = [[k, v] for k, v in scalars]
        lines = ["**settings and figures**", "", *_table(["key", "value"], pairs), *lines]
    return lines


def _load(path: Path) -> dict[str, Any]:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{path} is not valid JSON ({exc}): rerun the benchmark that wrote it "
            "(`megatron-ext bench NAME --json PATH`) or remove it"
        ) from None
    if not isinstance(report, dict) or not isinstance(report.get("meta"), dict):
        raise ConfigError(
            f"{path}: no `meta` (command, date, machine, anchor); write it through "
            "`megatron-ext bench NAME --json PATH`"
        )
    provenance(report["meta"])  # refuses a meta that lacks a key, naming it
    return report


def render_folder(folder: Path) -> str:
    """The page of one results folder (``<folder>/<folder.name>.md``): per JSON its provenance
    and tables, then the folder's PNGs. A ``bench paper`` study's single JSON keeps its own
    claims page."""
    jsons = sorted(p for p in folder.glob("*.json"))
    if not jsons:
        raise ConfigError(f"{folder}: no results JSON")
    reports = {p: _load(p) for p in jsons}
    if len(reports) == 1 and next(iter(reports.values()))["meta"]["benchmark"] == "paper":
        from megatron_ext.bench.paper import study_module
        from megatron_ext.bench.paper.report import markdown

        report = next(iter(reports.values()))
        return markdown(report, study_module(report["study"]).TITLE)
    lines = [f"# Results: {folder.name}", ""]
    lines += [
        "Generated by `megatron-ext docs results` from the JSON beside this page; do not edit.",
        "",
    ]
    for path, report in reports.items():
        lines += [f"## {path.name}", "", *provenance(report["meta"]), *tables(report)]
    lines += [f"![{p.stem}]({p.name})" for p in sorted(folder.glob("*.png"))]
    return "\n".join(lines).rstrip() + "\n"


def _index(root: Path, folders: list[Path]) -> str:
    rows = []
    for folder in folders:
        for path in sorted(folder.glob("*.json")):
            meta = _load(path)["meta"]
            rows.append(
                [
                    f"[{folder.name}]({folder.name}/{folder.name}.md)",
                    f"`{meta['command']}`",
                    meta["date"],
                    machine_words(meta["machine"]),
                    meta["anchor"],
                ]
            )
    lines = [
        "# Results",
        "",
        "Every measured figure in these docs comes from a JSON here, written by the benchmark's "
        "run (`megatron-ext bench NAME --json ...`); `megatron-ext docs results` (`make results`)"
        " renders the pages. One row per results file:",
        "",
        *_table(["results", "command", "date", "machine", "anchor"], rows),
    ]
    return "\n".join(lines).rstrip() + "\n"


def render_all(root: Path) -> dict[Path, str]:
    """Every page under ``root`` (``docs/results``): path -> its text."""
    if not root.is_dir():
        raise ConfigError(f"no results folder {root}")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and any(p.glob("*.json")))
    if not folders:
        raise ConfigError(
            f"{root} holds no benchmark JSON (expected {root}/NAME/*.json): give the results "
            "folder (default docs/results), or write some with `megatron-ext bench NAME --json`"
        )
    pages = {folder / f"{folder.name}.md": render_folder(folder) for folder in folders}
    pages[root / INDEX] = _index(root, folders)
    return pages
