"""Progress of slow commands: a tqdm bar on a terminal, nothing on a pipe or with ``--quiet``.

The commands run in process through ``main(argv)`` with stderr replaced by a stream that says
it is a terminal (tqdm writes to it as to one): ``data build`` (documents tokenized) and
``ckpt verify`` (bytes checksummed, on a checkpoint folder whose manifest lists its files).
The benchmarks' one bar (``bench.common.progress``) is checked here on its own; a real
benchmark shows it in ``test_smoke.py::test_benchmark_quick_run[ramp]`` (its two runs).
"""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from megatron_ext.bench.common import progress
from megatron_ext.ckpt.manifest import build_manifest, hash_files, write_manifest
from megatron_ext.launch.cli import main
from megatron_ext.progress import QUIET_VAR, on_terminal
from megatron_ext.verbosity import VERBOSE_VAR


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _stderr_of(argv: list[str], monkeypatch: pytest.MonkeyPatch, *, terminal: bool) -> str:
    """``main(argv)``'s stderr (a terminal or a pipe); exit 0 asserted. ``--quiet`` sets
    ``MEGATRON_EXT_QUIET`` for the process: monkeypatch restores it afterwards."""
    monkeypatch.setenv(QUIET_VAR, "0")
    monkeypatch.setenv(VERBOSE_VAR, "0")
    err = _Terminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    assert main(argv) == 0, err.getvalue()
    return err.getvalue()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("corpus")
    (folder / "a.txt").write_text("\n\n".join(f"document {i} " * 20 for i in range(300)))
    return folder / "a.txt"


def test_data_build_shows_a_bar_on_a_terminal_only(
    corpus: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    argv = ["data", "build", str(corpus), "--output"]
    shown = _stderr_of([*argv, str(tmp_path / "a")], monkeypatch, terminal=True)
    assert "megatron-ext: data build: tokenizing: 0doc" in shown
    assert shown.endswith("\r")  # erased: the terminal keeps the command's summary only
    assert _stderr_of([*argv, str(tmp_path / "b")], monkeypatch, terminal=False) == ""
    quiet = [*argv, str(tmp_path / "c"), "--quiet"]
    assert _stderr_of(quiet, monkeypatch, terminal=True) == ""


def test_the_build_counts_each_document_once(corpus: Path, tmp_path: Path) -> None:
    from megatron_ext.data.indexed import build_indexed_dataset
    from megatron_ext.data.tokenizers import ByteTokenizer

    calls: list[int] = []
    stats = build_indexed_dataset(
        [str(corpus)], tmp_path / "ds", ByteTokenizer(), progress=calls.append
    )
    assert calls == [1] * stats.documents and stats.documents == 300


def test_ckpt_verify_shows_the_bytes_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    (ckpt / "__0_0.distcp").write_bytes(bytes(range(256)) * 4096)  # 1 MiB
    (ckpt / "metadata.json").write_text("{}")
    files = hash_files(ckpt, ["__0_0.distcp", "metadata.json"])
    write_manifest(ckpt, build_manifest(files, step=1, recipe_hash="", layout={"world": 1}))
    shown = _stderr_of(["ckpt", "verify", str(ckpt)], monkeypatch, terminal=True)
    assert "megatron-ext: ckpt verify: checking 1 checkpoint(s)" in shown
    assert "0.00/1.05M [" in shown, shown  # the manifest lists 1 MiB + 2 bytes
    assert _stderr_of(["ckpt", "verify", str(ckpt), "--quiet"], monkeypatch, terminal=True) == ""


def _arms(names: tuple[str, ...], total: int | None = None) -> None:
    """A benchmark's loop as the benchmarks write it: a line per arm, each arm in ``running``."""
    with progress("demo", "runs", len(names) if total is None else total) as shown:
        for name in names:
            print(f"[demo] {name}: running")
            with shown.running(name):
                assert not on_terminal() and not sys.stdout.isatty()  # no second bar inside
            print(f"[demo] {name}: done", end="")  # a partial line: written when it ends
            print()


def test_a_benchmark_bar_names_each_run_and_keeps_the_figures_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(QUIET_VAR, "0")
    term, out = _Terminal(), io.StringIO()
    monkeypatch.setattr(sys, "stderr", term)
    monkeypatch.setattr(sys, "stdout", out)
    _arms(("adamw", "muon"))
    shown = term.getvalue()
    assert "megatron-ext: bench demo: runs:" in shown and "2/2 [" in shown, shown
    assert "adamw (1/2)" in shown and "muon (2/2)" in shown
    assert shown.endswith("\r")  # erased
    lines = "[demo] adamw: running\n[demo] adamw: done\n[demo] muon: running\n[demo] muon: done\n"
    assert out.getvalue() == lines  # stdout: the same bytes as without a bar
    assert sys.stdout is out and sys.stderr is term  # restored
    # stdout and stderr one terminal: each line lands whole, the bar cleared before it
    monkeypatch.setattr(sys, "stdout", term)
    term.seek(0), term.truncate()
    _arms(("adamw",))
    both = term.getvalue()
    assert "\r[demo] adamw: running\n\rmegatron-ext: bench demo" in both  # cleared, redrawn
    assert "\r[demo] adamw: done\n" in both


def test_a_benchmark_bar_is_off_on_a_pipe_and_with_quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    for quiet, err in (("0", io.StringIO()), ("1", _Terminal())):
        monkeypatch.setenv(QUIET_VAR, quiet)
        out = io.StringIO()
        monkeypatch.setattr(sys, "stderr", err)
        monkeypatch.setattr(sys, "stdout", out)
        with progress("demo", "runs", 1) as shown, shown.running("adamw"):
            assert sys.stdout is out  # the streams untouched
        assert err.getvalue() == ""


def test_side_by_side_runs_and_a_failed_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(QUIET_VAR, "0")
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    with pytest.raises(RuntimeError), progress("demo", "runs", None) as shown:
        with shown.running("a"), shown.running("b"):  # a pool's runs (bench paper)
            assert "a (1), b (2)" in term.getvalue()
        with shown.running("c"):
            raise RuntimeError("the c run failed")
    assert sys.stderr is term  # restored after the error
    assert "2run [" in term.getvalue() and "3run [" not in term.getvalue()  # c not counted
