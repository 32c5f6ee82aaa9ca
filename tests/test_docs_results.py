"""Figures in the docs are generated, not typed (issue 27, item 3): the results pages are what
``megatron-ext docs results`` renders from the benchmarks' JSON, every rendered table carries
its run's command, date, machine and anchor, and every measured figure a page quotes is printed
on the results page it links. In-process, seconds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_ext.docs.cli import docs_main
from megatron_ext.docs.figures import check_page
from megatron_ext.docs.render import INDEX, fmt, render_all
from megatron_ext.launch.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def fake_meta(benchmark: str, command: str, anchor: str) -> dict:
    """A results file's ``meta`` as ``megatron-ext bench`` stamps it, for a made-up run."""
    return {
        "benchmark": benchmark,
        "command": command,
        "date": "2026-12-04 00:00 UTC",
        "machine": {"cpu": "Test CPU", "cores": 2, "torch_threads": 2, "gpu": None, "torch": "2.9"},
        "load_average": [1.0, 2.0, 3.0],
        "anchor": anchor,
    }


META = fake_meta("ramp", "megatron-ext bench ramp tiny_cpu_gpt", "the constant-batch run")


def _docs(argv: list[str]) -> int:
    """``megatron-ext docs ...`` through the real parser, in this process."""
    return docs_main(build_parser().parse_args(["docs", *argv]))


def _synthetic(tmp_path: Path) -> Path:
    """A results tree with one JSON (a ramp-shaped report) and a page quoting it."""
    folder = tmp_path / "results" / "ramp"
    folder.mkdir(parents=True)
    report = {
        "recipe": "tiny_cpu_gpt",
        "results": {
            "constant": {"steps": 300, "final_train_loss": 1.80361},
            "ramp": {"steps": 340, "final_train_loss": 1.80802},
        },
        "meta": META,
    }
    (folder / "ramp.json").write_text(json.dumps(report))
    assert _docs(["results", "--results", str(tmp_path / "results")]) == 0
    return folder / "ramp.md"


def test_the_formatter_prints_what_a_quote_must_match() -> None:
    assert [fmt(1.80361), fmt(614400), fmt(2.5e-5), fmt(1234567.8), fmt(None), fmt(True)] == [
        "1.804",
        "614,400",
        "2.500e-05",
        "1,234,568",
        "–",
        "yes",
    ]


def test_a_quoted_figure_passes_only_when_the_results_page_prints_it(tmp_path: Path) -> None:
    results_page = _synthetic(tmp_path)
    text = results_page.read_text()
    assert "| constant | 300 | 1.804 |" in text and "| ramp | 340 | 1.808 |" in text
    page = tmp_path / "page.md"
    link = "[ramp](results/ramp/ramp.md)"
    page.write_text(f"Measured ({link}): the ramp ends at 1.808 after 340 steps.\n")
    assert check_page(page) == []
    # a figure no results file holds: typed by hand (1.81), or quoted with other digits (1.80802)
    page.write_text(f"Measured ({link}): the ramp ends at 1.81, 1.80802 in full.\n")
    assert [p.figure for p in check_page(page)] == ["1.81", "1.80802"]
    # a measured unit outside a Measured block, a Measured block without a results link
    page.write_text(
        "Config: d = 512, 16 experts, 4 × 8 ranks (paper 9.19×).\nIt ran 0.5 s/step, 3.1× faster.\n"
    )
    assert [p.figure for p in check_page(page)] == ["0.5 s/step", "3.1×"]
    page.write_text(
        "| recipe | layers |\n|---|---|\n| a | 4 |\n\n| run | loss |\n|---|---|\n| a | 1.8 |\n"
    )
    assert [(p.line, p.why.split()[0]) for p in check_page(page)] == [(5, "heads")]
    page.write_text("Measured by hand: 1.808\n")
    assert [p.why for p in check_page(page)] == ["links no results page"]


def test_a_table_under_a_measured_line_is_checked_too(tmp_path: Path) -> None:
    _synthetic(tmp_path)
    page = tmp_path / "page.md"
    page.write_text(
        "Measured ([ramp](results/ramp/ramp.md)):\n| run | loss |\n|---|---|\n| ramp | 1.808 |\n"
        "| constant | 1.79 |\n\nAfter the blank line: 1.79 is no quote.\n"
    )
    assert [(p.line, p.figure) for p in check_page(page)] == [(5, "1.79")]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_measured_figure_in_the_docs_is_held_by_a_results_file(page: Path) -> None:
    problems = check_page(page)
    assert problems == [], "\n".join(map(str, problems))


def test_the_results_pages_are_up_to_date() -> None:
    assert _docs(["results", "--results", str(RESULTS), "--check"]) == 0


def test_check_fails_after_a_json_value_changes(tmp_path: Path) -> None:
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    assert _docs(["results", "--results", str(copy), "--check"]) == 0
    target = copy / "plan" / "plan.json"  # bench plan's: torch-free, always present
    report = json.loads(target.read_text())
    report["balance"][0]["dp"] += 1
    target.write_text(json.dumps(report))
    assert _docs(["results", "--results", str(copy), "--check"]) == 1
    assert _docs(["results", "--results", str(copy)]) == 0  # rewrites the page
    assert _docs(["results", "--results", str(copy), "--check"]) == 0


def test_a_results_json_without_meta_is_refused(tmp_path: Path) -> None:
    from megatron_ext.errors import ConfigError

    folder = tmp_path / "results" / "x"
    folder.mkdir(parents=True)
    (folder / "x.json").write_text(json.dumps({"figure": 1.0}))
    with pytest.raises(ConfigError, match="no `meta`"):
        _docs(["results", "--results", str(tmp_path / "results")])
    (folder / "x.json").write_text(json.dumps({"figure": 1.0, "meta": {"command": "c"}}))
    with pytest.raises(ConfigError, match="lacks benchmark, date, machine, anchor"):
        _docs(["results", "--results", str(tmp_path / "results")])


def test_every_rendered_table_and_index_row_carries_command_date_machine_anchor() -> None:
    pages = render_all(RESULTS)
    index = pages.pop(RESULTS / INDEX).splitlines()
    rows = [line for line in index if line.startswith("| [")]
    assert len(rows) == len(list(RESULTS.glob("*/*.json")))
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert len(cells) == 5 and all(cells), row  # results, command, date, machine, anchor
        assert cells[1].startswith("`megatron-ext bench ") and cells[2].endswith("UTC"), row
        assert " cores, " in cells[3], row
    for path, text in pages.items():
        lines = text.splitlines()
        heads = [i for i, line in enumerate(lines) if line.startswith("|---")]
        assert heads, path
        for head in heads:  # the nearest provenance block above every table names all four
            above = "\n".join(lines[:head])
            block = above[above.rindex("- command: `megatron-ext bench ") :]
            for key in ("- date: ", "- machine: ", "- anchor: "):
                assert key in block, (path, head, key)
            assert " cores, " in block and "UTC" in block, (path, head)


def test_the_bench_dispatcher_stamps_every_json_with_meta(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``megatron-ext bench NAME --json`` (here ``plan --quick``, torch-free and seconds): the
    file carries ``meta`` with the command, a UTC date, the machine and the module's ANCHOR; a
    benchmark writing its JSON outside the dispatcher is refused."""
    from megatron_ext.bench import common
    from megatron_ext.bench.plan import ANCHOR
    from megatron_ext.launch.cli import main

    monkeypatch.setattr(common, "_RUN_META", None)
    with pytest.raises(RuntimeError, match="no benchmark run begun"):
        common.write_json({"figure": 1.0}, str(tmp_path / "x.json"))
    argv = ["bench", "plan", "--quick", "--out", str(tmp_path / "out")]
    assert main([*argv, "--json", str(tmp_path / "p.json")]) == 0
    meta = json.loads((tmp_path / "p.json").read_text())["meta"]
    assert meta["benchmark"] == "plan" and meta["anchor"] == ANCHOR
    # the arguments main() was given, not this process's (pytest's) command line
    assert meta["command"] == " ".join(["megatron-ext", *argv, "--json", str(tmp_path / "p.json")])
    assert meta["date"].endswith(" UTC") and len(meta["load_average"]) == 3
    assert {"cpu", "cores", "gpu", "torch", "megatron_core"} <= set(meta["machine"])
    assert meta == json.loads((tmp_path / "out" / "plan.json").read_text())["meta"]
