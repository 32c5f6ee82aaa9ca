"""Every study of ``megatron-ext bench paper`` in its ``--quick`` form, as a user runs it: exit 0,
the report's JSON keys, every claim the study declares (``CLAIM_IDS``) with a verdict decided by
its seed spread, the Markdown page and every plot it lists. The study that the benchmark's
``EXAMPLE`` runs is smoke-run by ``tests/test_smoke.py`` already and is not run twice; its figure
checks live here too (``STUDY_CHECKS``) and are called from there."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.bench.paper import EXAMPLE, JSON_KEYS, STUDIES, study_module
from megatron_ext.bench.paper.claims import VERDICTS, verdict

#: the study the benchmark's EXAMPLE runs (smoke-run by tests/test_smoke.py)
EXAMPLE_STUDY = shlex.split(EXAMPLE)[3]


def check_dipaco(report: dict[str, Any], stdout: str, out: Path) -> None:
    """The figures hold what they measure: DiLoCo's 4 workers and the dense arm share every
    parameter, so re-routing cannot change their perplexity (exactly); the early-stopping
    perplexity recomputed by the study equals the trainer's own once-per-sequence figure;
    every arm ran for every seed."""
    arms, seeds = report["arms"], [str(s) for s in report["seeds"]]
    for arm in ("diloco", "dense"):
        for s in seeds:
            figures = arms[arm][s]
            assert figures["once"] == figures["w64"] == figures["w16"], (arm, s)
    for s in seeds:
        assert arms["early_stopping"][s]["on"] == pytest.approx(
            arms["dipaco_2x2"][s]["once"], rel=1e-6
        )
        assert all(s in figures for figures in arms.values())
    assert "[dipaco] seed" in stdout and report["settings"]["size"] == "quick"


#: study -> a check of its quick run's figures (report, stdout, run folder)
STUDY_CHECKS: dict[str, Callable[[dict[str, Any], str, Path], None]] = {"dipaco": check_dipaco}


def check_report(study: str, report: dict[str, Any], stdout: str, out: Path) -> None:
    """What every study's report holds; then the study's own check."""
    module = study_module(study)
    assert tuple(report) == JSON_KEYS
    assert report["study"] == study and report["size"] == "quick" and len(report["seeds"]) >= 2
    assert tuple(c["id"] for c in report["claims"]) == module.CLAIM_IDS
    for c in report["claims"]:
        assert len(c["values"]) == len(report["seeds"]), c["id"]
        assert c["verdict"] in VERDICTS and c["verdict"] == verdict(
            c["values"], c["expect"], c["tolerance"]
        ), c["id"]
        assert c["paper"] and c["source"] and c["quantity"], c["id"]
    for plot in report["plots"]:
        assert (out / plot).stat().st_size > 5_000, plot
    page = (out / f"paper_{study}.md").read_text()
    assert all(f"| {c['claim']} |" in page for c in report["claims"])
    assert f"[{study}] --quick" in stdout
    if study in STUDY_CHECKS:
        STUDY_CHECKS[study](report, stdout, out)


def run_quick(study: str, tmp: Path) -> tuple[dict[str, Any], str, Path]:
    """``megatron-ext bench paper STUDY --quick`` in a subprocess; (report, stdout, run folder)."""
    out = tmp / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore"}
    argv = [
        "bench",
        "paper",
        study,
        "--quick",
        "--out",
        str(out),
        "--json",
        str(tmp / "report.json"),
    ]
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.launch.cli", *argv],
        capture_output=True,
        text=True,
        cwd=tmp,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads((tmp / "report.json").read_text()), done.stdout, out


@pytest.mark.parametrize("study", [s for s in STUDIES if s != EXAMPLE_STUDY])
def test_study_quick_run(study: str, tmp_path: Path) -> None:
    report, stdout, out = run_quick(study, tmp_path)
    check_report(study, report, stdout, out)
