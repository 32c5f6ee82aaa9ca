"""The GPUs of this machine as the NVIDIA driver reports them, without CUDA or torch: the one
place that runs and parses ``nvidia-smi`` and reads ``CUDA_VISIBLE_DEVICES``.

The launcher (:mod:`megatron_ext.launch.hosts`: GPU count and model) and the precision gate
(:mod:`megatron_ext.run.hardware`: compute capabilities) both read one
:func:`query_gpus` answer. ``nvidia-smi --query-gpu`` is the driver's own answer: no CUDA
context is created, so it takes no GPU memory, works on a GPU in exclusive-process mode and
answers in a fraction of a second.

Torch-free: the launcher imports it before any rank exists.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["GpuRow", "SmiAnswer", "count_visible_devices", "query_gpus", "visible_gpus"]

#: ``--query-gpu`` fields, newest first: drivers before R510 lack ``compute_cap``
_FIELDS = ("index,uuid,name,compute_cap", "index,uuid,name")
_TIMEOUT_S = 20


@dataclass(frozen=True)
class GpuRow:
    """One GPU: its driver index, UUID (``GPU-...``), name (``NVIDIA H100 80GB HBM3``) and
    compute capability (major, minor); None when the driver does not report it."""

    index: int
    uuid: str
    name: str
    compute_capability: tuple[int, int] | None


@dataclass(frozen=True)
class SmiAnswer:
    """What ``nvidia-smi`` said: every GPU of the machine (not yet filtered by
    ``CUDA_VISIBLE_DEVICES``) and a note when something is missing ("" when nothing is)."""

    rows: tuple[GpuRow, ...] = ()
    note: str = ""


def query_gpus(nvidia_smi: str | None = None) -> SmiAnswer:
    """Every GPU ``nvidia-smi`` lists (``nvidia_smi``: its path, default the one on PATH).

    One ``nvidia-smi --query-gpu`` run; a driver that lacks the ``compute_cap`` field (older
    than R510) is asked again without it and its GPUs' capabilities are None (unknown). A
    missing or broken nvidia-smi is no GPU, with the reason in the note: the CPU path still
    works."""
    smi = nvidia_smi or shutil.which("nvidia-smi")
    if smi is None:
        return SmiAnswer(note="not on PATH")
    note = ""
    for fields in _FIELDS:
        try:
            done = subprocess.run(
                [smi, f"--query-gpu={fields}", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=_TIMEOUT_S,
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return SmiAnswer(note=f"failed to run: {exc}")
        if done.returncode == 0:
            break
        note = f"exited {done.returncode}: {(done.stderr or done.stdout).strip()[:120]}"
    else:
        return SmiAnswer(note=note)
    if fields != _FIELDS[0]:
        note = "this driver does not report compute_cap (older than R510?)"
    return SmiAnswer(rows=tuple(_parse_rows(done.stdout)), note=note)


def _parse_rows(csv: str) -> list[GpuRow]:
    """``index, uuid, name[, major.minor]`` lines; anything else (a warning line) is skipped."""
    rows = []
    for line in csv.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[0].isdigit():
            continue
        cc = _major_minor(parts[3]) if len(parts) > 3 else None
        rows.append(GpuRow(int(parts[0]), parts[1], parts[2], cc))
    return rows


def _major_minor(text: str) -> tuple[int, int] | None:
    """``"9.0"`` -> (9, 0); None for ``[N/A]`` or anything that does not start ``N.N``."""
    match = re.match(r"\s*(\d+)\.(\d+)", text)
    return (int(match[1]), int(match[2])) if match else None


def visible_gpus(rows: Sequence[GpuRow], cuda_visible_devices: str | None) -> list[GpuRow]:
    """The rows ``CUDA_VISIBLE_DEVICES`` selects (None: not set, every row), read as CUDA reads
    it: indices or GPU UUID prefixes up to the first entry that is neither. MIG UUIDs do not
    name a row: every GPU is kept, so the lowest compute capability on the node applies."""
    if cuda_visible_devices is None:
        return list(rows)
    chosen: list[GpuRow] = []
    for item in (s.strip() for s in cuda_visible_devices.split(",")):
        if item.isdigit():
            chosen += [r for r in rows if r.index == int(item)]
        elif item.startswith("GPU-"):
            chosen += [r for r in rows if r.uuid.startswith(item)]
        elif item.startswith("MIG-"):
            return list(rows)
        else:
            break
    return chosen


def count_visible_devices(value: str) -> int:
    """Devices named by CUDA_VISIBLE_DEVICES, without asking the driver.

    Like CUDA, count up to the first entry that is not a device (an index >= 0 or a GPU/MIG
    UUID): ``""``, ``-1`` and SLURM's ``NoDevFiles`` hide every GPU; ``0,1,-1,2`` shows two.
    """
    count = 0
    for item in value.split(","):
        item = item.strip()
        if not (item.isdigit() or item.startswith(("GPU-", "MIG-"))):
            break
        count += 1
    return count
