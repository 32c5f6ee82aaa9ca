"""The warm-rank harness (:mod:`tests.warm`) starts a rank as torchrun would, and fails as
torchrun does."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import DIST, run_torchrun, warm_zygote
from tests.warm import differs_at_startup


def _facts(proc: subprocess.CompletedProcess) -> list[dict]:
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda r: int(r["env"]["RANK"]))


def test_a_warm_rank_starts_as_a_cold_one(tmp_path: Path, monkeypatch) -> None:
    """The same script under the zygote and under torchrun sees the same variables, argv,
    sys.path[0], working directory, thread count, ``__name__`` and all-reduce; both draw their
    random numbers (Python's, torch's) from a seed of each rank's own."""
    warm = _facts(run_torchrun(DIST / "rank_facts.py", 2, "a", cwd=tmp_path, env={"EXTRA": "x"}))
    monkeypatch.setenv("MEGATRON_EXT_TEST_COLD", "1")
    cold = _facts(run_torchrun(DIST / "rank_facts.py", 2, "a", cwd=tmp_path, env={"EXTRA": "x"}))
    assert len(warm) == len(cold) == 2
    for run in (warm, cold):
        for key in ("py_random", "initial_seed", "rand"):
            assert run[0].pop(key) != run[1].pop(key), key
    assert warm == cold
    assert warm[0]["sum"] == 3.0 and warm[0]["threads"] == 1 and warm[0]["name"] == "__main__"
    assert warm[0]["env"]["EXTRA"] == "x" and warm[0]["cwd"] == str(tmp_path)


def test_a_failing_rank_stops_the_others_and_the_launch_exits_1() -> None:
    started = time.monotonic()
    proc = run_torchrun(DIST / "rank_facts.py", 2, "fail", check=False, timeout=120)
    assert proc.returncode == 1
    assert "warm ranks: rank 1 exited 3" in proc.stderr
    # rank 0 waits in a barrier (gloo's 30-minute timeout) unless stopped: a bound far below
    # that and far above a launch on a loaded host (two suites side by side: ~45 s seen)
    assert time.monotonic() - started < 300


def test_start_up_variables_decide_cold() -> None:
    zygote = warm_zygote()
    assert zygote is not None
    base = zygote.env
    assert differs_at_startup(dict(base), base) == []
    assert differs_at_startup({**base, "OMP_NUM_THREADS": "2", "EXTRA": "1"}, base) == []
    assert differs_at_startup({**base, "PYTHONHASHSEED": "7"}, base) == ["PYTHONHASHSEED"]
    assert differs_at_startup({**base, "MKL_NUM_THREADS": "3"}, base) == ["MKL_NUM_THREADS"]


def test_a_launch_past_its_timeout_is_killed_whole() -> None:
    with pytest.raises(subprocess.TimeoutExpired):
        run_torchrun(DIST / "rank_facts.py", 2, "fail", env={"RANK_FACTS_HANG": "1"}, timeout=1)
