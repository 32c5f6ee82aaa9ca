"""``megatron-ext bench dipaco --faults``: what the benchmark reports from its two fault scenarios.

The scenarios themselves (real worker processes, bit-identical to a clean run) are tested in
``tests/test_dipaco_faults.py``; running them again here would add about a minute. This test runs
the benchmark's ``--faults`` step (:func:`megatron_ext.bench.dipaco._faults`) with the scenarios
replaced by recorded figures, and checks what reaches the JSON: the scenario's figures as they
came, the wall time over the clean run, and the stopped job's counts computed from its events.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from megatron_ext.bench import _dipaco_faults, dipaco

#: (time, task, worker, attempt, kind): the queue's events, as the scenarios return them
BEFORE = [
    (0.0, "train/0/0", "a", 1, "claim"),
    (1.0, "train/0/0", "a", 1, "complete"),
    (1.5, "train/0/1", "b", 1, "claim"),
    (2.0, "train/0/1", "b", 1, "complete"),
    (2.5, "train/0/2", "a", 1, "claim"),
    (2.6, "train/0/3", "b", 1, "claim"),
]
AFTER = [
    (9.0, "train/0/2", "c", 2, "take-over"),
    (9.1, "train/0/3", "d", 2, "take-over"),
    (11.0, "train/0/2", "c", 2, "complete"),
    (11.5, "outer/0/0", "c", 1, "claim"),
]


def test_faults_step_reports_the_scenarios_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, list[str], Path]] = []

    def recorded_fault(name: str, overrides: list[str], recipe: Any, logs: Path) -> dict[str, Any]:
        seen.append(("fault", list(overrides), logs))
        return {
            "tasks_re_leased": 2,
            "re_leased": ["outer/0/0", "train/1/2"],
            "inner_steps_lost": 3,
            "rejected_zombie_completions": 1,
            "wall_s": 25.0,
            "events": [],
        }

    def recorded_stopped_job(
        name: str, overrides: list[str], recipe: Any, logs: Path
    ) -> dict[str, Any]:
        seen.append(("stopped", list(overrides), logs))
        return {"before": BEFORE, "events": BEFORE + AFTER}

    differences = iter([0.0, 0.5])
    monkeypatch.setattr(_dipaco_faults, "fault_run", recorded_fault)
    monkeypatch.setattr(_dipaco_faults, "stopped_job_run", recorded_stopped_job)
    monkeypatch.setattr(_dipaco_faults, "max_abs_difference", lambda a, b: next(differences))

    out = dipaco._faults(tmp_path / "data", tmp_path, clean=None, clean_wall=10.0)

    assert [kind for kind, _, _ in seen] == ["fault", "stopped"]
    for _, overrides, _ in seen:  # short leases, so that a killed worker's task comes back soon
        assert overrides[-2:] == ["dipaco.lease_seconds=4", "dipaco.heartbeat_seconds=1"]
    assert f"run_dir={tmp_path / 'faults'}" in seen[0][1]
    assert f"run_dir={tmp_path / 'stopped_job'}" in seen[1][1]
    job = out.pop("job_killed_mid_phase")
    assert out == {
        "tasks_re_leased": 2,
        "re_leased": ["outer/0/0", "train/1/2"],
        "inner_steps_lost": 3,
        "rejected_zombie_completions": 1,
        "wall_s": 25.0,
        "extra_wall_s": 15.0,
        "max_abs_dtheta_vs_clean": 0.0,
    }
    assert job.pop("wall_s") >= 0.0
    assert job == {
        "tasks_done_before_the_kill": 2,  # train/0/0 and train/0/1
        "tasks_re_leased_after_relaunch": ["train/0/2", "train/0/3"],
        "done_tasks_claimed_again": 0,
        "max_abs_dtheta_vs_clean": 0.5,
    }
