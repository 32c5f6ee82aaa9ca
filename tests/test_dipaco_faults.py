"""DiPaCo under faults, with real worker processes (megatron_ext.bench._dipaco_faults and
tests/support/dipaco_faults.py: each worker stops itself where the scenario needs), on a small
corpus; every faulty run ends with the final global modules (and outer momenta) of a clean run
of the same recipe, bit for bit:

- a worker SIGKILLed holding an outer task and a zombie SIGSTOPped past its lease, on the
  SQLite queue (the executor killed after writing its module file: that file equals the
  re-run's, the outer step is idempotent) and on the PostgreSQL queue of a throwaway server
  (the executor killed half-way through writing its module file);
- the whole job killed mid-phase (two train tasks of phase 0 done, two held) and relaunched
  through the launcher: it continues, nothing done is done again;
- workers sent a stop signal (SIGTERM) mid-task and after a task: the first gives its task back
  unfinished, the second completes its task; both exit 0 with the stop line.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_ext.bench._dipaco_faults import fault_run, max_abs_difference, stopped_job_run
from megatron_ext.bench._dipaco_measure import small_overrides, small_run, write_small_corpus
from megatron_ext.config import load_recipe
from megatron_ext.dipaco.run.store import attempt_dir, load_tensors
from tests.support.dipaco_faults import signalled_run
from tests.support.postgres import postgres_server

RECIPE = "dipaco_tiny"
FAST_LEASES = ["dipaco.lease_seconds=4", "dipaco.heartbeat_seconds=1"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return write_small_corpus(tmp_path_factory.mktemp("dipaco_fault_data"))


@pytest.fixture(scope="module")
def clean(data: Path, tmp_path_factory):
    """The recipe run by one worker, no faults: the reference."""
    overrides = small_overrides(data, tmp_path_factory.mktemp("clean") / "run")
    small_run(RECIPE, overrides)
    return load_recipe(RECIPE, overrides)


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as server:
        yield server


@pytest.mark.parametrize(
    ("backend", "mid_write"),
    [("sqlite", False), ("postgresql", True)],
    ids=["sqlite", "postgresql"],
)
def test_killed_and_zombie_workers_change_nothing(
    backend: str, mid_write: bool, data: Path, clean, tmp_path, request
) -> None:
    """A worker SIGKILLed holding an outer task and one SIGSTOPped past its lease holding a
    train task; a third takes both over once their leases expire and finishes the run; the
    stopped one, continued, has its completion rejected and its files discarded.

    On SQLite the executor is killed after writing its module file (not completed): that file
    equals the re-run's bit for bit (the outer step is idempotent). On PostgreSQL it is killed
    half-way through the write: its attempt folder holds only the half-written temporary file
    (no module.pt, never read), and the re-run writes the whole file in its own folder."""
    overrides = [*small_overrides(data, tmp_path / "run"), *FAST_LEASES]
    if backend == "postgresql":
        overrides.append(f"dipaco.queue={request.getfixturevalue('postgres').new_database()}")
    recipe = load_recipe(RECIPE, overrides)
    figures = fault_run(RECIPE, overrides, recipe, tmp_path / "logs", mid_write=mid_write)
    assert "completion rejected" in figures["zombie_log"]
    events = figures["events"]
    outer, killed_token = figures["killed_outer"]
    rejected = [e for e in events if e[4] == "rejected"]
    assert len(rejected) == 1 and rejected[0][2] == "zombie"
    task, token = rejected[0][1], rejected[0][3]
    # the killed worker's outer task and the zombie's train task were both taken over
    history = [e[4] for e in events if e[1] == outer]
    assert history == ["claim", "take-over", "complete"]
    takeover = next(e for e in events if e[1] == outer and e[4] == "take-over")
    assert takeover[2] == "helper" and takeover[3] != killed_token
    assert any(e[4] == "take-over" and e[1] == task and e[2] != "zombie" for e in events)
    assert task.startswith("train/") and not attempt_dir(recipe.run_dir, task, token).exists()
    assert figures["rejected_zombie_completions"] == 1 and figures["inner_steps_lost"] >= 3
    killed_dir = attempt_dir(recipe.run_dir, outer, killed_token)
    rerun = attempt_dir(recipe.run_dir, outer, takeover[3]) / "module.pt"
    left = figures["killed_left_files"]
    if mid_write:
        assert len(left) == 1 and left[0].startswith(".module.tmp"), left
        assert (killed_dir / left[0]).stat().st_size == rerun.stat().st_size // 2
    else:
        assert left == ["module.pt"]
        first, again = load_tensors(killed_dir / "module.pt"), load_tensors(rerun)
        for part in ("params", "momentum"):
            assert first[part].keys() == again[part].keys()
            assert all(torch.equal(first[part][k], again[part][k]) for k in first[part])
    assert max_abs_difference(recipe, clean) == 0.0


def test_a_job_killed_mid_phase_and_relaunched_ends_bit_identical(
    data: Path, clean, tmp_path
) -> None:
    """Every process of the job is SIGKILLed with two of phase 0's train tasks done and two
    held; ``megatron-ext launch`` of the same recipe continues the run: it takes the two held
    tasks over once their leases expire and redoes nothing that was done."""
    overrides = [*small_overrides(data, tmp_path / "run"), *FAST_LEASES]
    recipe = load_recipe(RECIPE, overrides)
    figures = stopped_job_run(RECIPE, overrides, recipe, tmp_path / "logs")
    done_before = {e[1] for e in figures["before"] if e[4] == "complete"}
    phase0 = {f"train/0000/{p:04d}" for p in range(4)}
    assert done_before == {"prepare", "base", "route/0000"} | set(sorted(phase0)[:2])
    held = {e[1]: e[2] for e in figures["before"] if e[4] == "claim" and e[1] not in done_before}
    assert held == {"train/0000/0002": "a", "train/0000/0003": "b"} or held == {
        "train/0000/0002": "b",
        "train/0000/0003": "a",
    }
    after = figures["events"][len(figures["before"]) :]
    assert not {e[1] for e in after} & done_before  # nothing done is claimed again
    takeovers = {e[1] for e in after if e[4] == "take-over"}
    assert takeovers == set(held)
    assert {e[2] for e in after if e[4] == "complete"} <= {"rank0", "rank1"}
    assert max_abs_difference(recipe, clean) == 0.0


def test_signalled_workers_give_back_or_finish_their_task_and_exit_cleanly(
    data: Path, clean, tmp_path
) -> None:
    """SIGTERM to a worker in the middle of a train task: the task is released (no attempt
    spent, its files discarded) and the worker exits 0; to a worker that has done its task
    but not completed it: it completes it, then exits 0. Another worker finishes the run,
    bit-identical to the clean one."""
    overrides = small_overrides(data, tmp_path / "run")  # 30 s leases: a release is at once
    recipe = load_recipe(RECIPE, overrides)
    figures = signalled_run(RECIPE, overrides, recipe, tmp_path / "logs")
    assert figures["codes"] == {"mid": 0, "end": 0}, figures["logs"]
    events = figures["events"]
    claimed = {n: [e for e in events if e[2] == n and e[4] == "claim"][-1] for n in ("mid", "end")}
    released = [e for e in events if e[4] == "released"]
    assert [(e[1], e[2], e[3], e[5]) for e in released] == [
        (claimed["mid"][1], "mid", claimed["mid"][3], "SIGTERM")
    ]
    assert not attempt_dir(recipe.run_dir, claimed["mid"][1], claimed["mid"][3]).exists()
    redo = [e for e in events if e[1] == claimed["mid"][1] and e[4] == "claim"][-1]
    assert redo[2] != "mid" and redo[3].startswith("1:")  # the next claim is attempt 1 again
    completes = {(e[1], e[2], e[3]) for e in events if e[4] == "complete"}
    assert (claimed["end"][1], "end", claimed["end"][3]) in completes
    for name in ("mid", "end"):
        (line,) = [x for x in figures["logs"][name].splitlines() if "stopped at task" in x]
        assert line.startswith("megatron-ext: stopped at task ") and "(SIGTERM)" in line, line
        assert f"Resume with: megatron-ext dipaco worker {RECIPE}" in line
    assert "given back unfinished (SIGTERM)" in figures["logs"]["mid"]
    assert max_abs_difference(recipe, clean) == 0.0
