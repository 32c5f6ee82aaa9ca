"""``megatron-ext launch`` does each piece of work once: one read of the recipe, one layout, one
host probe, one ``nvidia-smi`` run (issue 40, item 4).

The real command runs in-process (``--dry-run``) on a GPU host made of a fake ``nvidia-smi`` on
PATH and ``CUDA_VISIBLE_DEVICES=0``: the path with the most consumers of the recipe (the
command, the dry run's checks and report, the memory plan for the GPU, the fit check). Every
reference to the counted functions, in every loaded module, is wrapped, so a second read
through another import is counted too.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.config import load
from megatron_ext.launch import hosts, launcher
from megatron_ext.launch.cli import main
from tests.test_launcher import write_recipe

H100_ROW = "0, GPU-0f0e0d0c-aaaa-bbbb-cccc-000000000000, NVIDIA H100 80GB HBM3, 9.0"


def count_calls(
    monkeypatch: pytest.MonkeyPatch, original: Callable[..., Any], calls: Counter
) -> None:
    """Replace ``original`` by a counting wrapper wherever a loaded module holds it by name."""
    name = original.__name__

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return original(*args, **kwargs)

    for module in list(sys.modules.values()):
        if module is not None and vars(module).get(name) is original:
            monkeypatch.setattr(module, name, counted)


def test_launch_reads_the_recipe_resolves_the_layout_and_probes_the_host_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    bin_dir, runs = tmp_path / "bin", tmp_path / "smi_runs"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho \"$*\" >> {runs}\necho '{H100_ROW}'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{sys.exec_prefix}/bin:/usr/bin:/bin")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    calls: Counter = Counter()
    for function in (load.read_recipe, launcher.resolve_layout, hosts.probe_host):
        count_calls(monkeypatch, function, calls)

    recipe = write_recipe(tmp_path)
    assert main(["launch", recipe, f"run_dir={tmp_path / 'run'}", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "--standalone --nproc-per-node 1" in out  # one rank: the host's one GPU
    assert err.rstrip().endswith("FITS")  # the GPU's memory plan ran, on the same recipe
    assert calls == {"read_recipe": 1, "resolve_layout": 1, "probe_host": 1}
    assert runs.read_text().splitlines() == [
        "--query-gpu=index,uuid,name,compute_cap --format=csv,noheader"
    ]

    # MXFP8 needs the precision gate's view of the GPU too: still one probe, one nvidia-smi run
    runs.unlink()
    mxfp8 = ["training.precision=mxfp8", "--dry-run"]
    assert main(["launch", recipe, f"run_dir={tmp_path / 'run'}", *mxfp8]) == 2
    err = capsys.readouterr().err  # an H100 (9.0) never runs MXFP8: refused, naming the GPU
    assert "training.precision=mxfp8 needs" in err and "1 x NVIDIA H100 80GB HBM3" in err
    assert len(runs.read_text().splitlines()) == 1
    assert calls == {"read_recipe": 2, "resolve_layout": 2, "probe_host": 2}  # one per launch
