"""allgather_v backends on CPU: gloo (torchrun, 2 and 4 ranks) and MPI (mpiexec, 2 ranks).

Each rank checks every gathered segment against the deterministic expected buffer (zero-length
and uneven segments, fp32 and bf16, four gathers in flight at once) and reports its payload
bytes, which must be exactly its own segments sent and everyone else's received: no padding.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import DIST, ROOT, rank_base_env, run_torchrun

SCRIPT = DIST / "allgather_v_check.py"


def _payload(world: int, rank: int) -> tuple[int, int]:
    """(sent, received) bytes of the script's four cases on ``rank``."""
    cases = [
        [3] * world,
        [5, 0, 7, 1][:world],
        [0] * (world - 1) + [11],
        [(r + 1) * 17 for r in range(world)],
    ]
    sent = received = 0
    for i, counts in enumerate(cases):
        item = 4 if i % 2 == 0 else 2
        sent += counts[rank] * item
        received += (sum(counts) - counts[rank]) * item
    return sent, received


def _check(out: Path, world: int, backend: str) -> None:
    for rank in range(world):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["backend"] == backend and report["world"] == world
        assert (report["sent"], report["received"]) == _payload(world, rank)


@pytest.mark.parametrize("world", [2, 4])
def test_gloo(tmp_path, world):
    run_torchrun(SCRIPT, world, "gloo", str(tmp_path))
    _check(tmp_path, world, "gloo")


def test_mpi(tmp_path):
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        mpiexec = shutil.which("mpiexec")
    assert mpiexec, "mpiexec (from the mpich wheel) is part of the install"
    proc = subprocess.run(
        [str(mpiexec), "-n", "2", sys.executable, str(SCRIPT), "mpi", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=rank_base_env(),  # the rank scripts import tests.dist.ending
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check(tmp_path, 2, "mpi")
