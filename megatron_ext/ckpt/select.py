"""Which checkpoints a run directory holds, which are intact, which to resume from, which to
prune: the policy, free of torch (the trainers verify collectively with :mod:`.collective`;
``megatron-ext ckpt verify`` and pruning use :func:`inspect` in one process).

Layout (every trainer that writes step checkpoints)::

    <run_dir>/checkpoints/step_000040/   a published checkpoint (its files + manifest.json)
    <run_dir>/checkpoints/latest         names the newest one written
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.ckpt.manifest import (
    MANIFEST,
    Problem,
    Progress,
    Verify,
    read_manifest,
    unlisted,
    verify,
)

__all__ = [
    "LATEST",
    "Verdict",
    "checkpoint_dirs",
    "inspect",
    "is_checkpoint",
    "prune_plan",
    "resume_order",
    "step_of",
]

LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d+)")


@dataclass(frozen=True)
class Verdict:
    """The state of one checkpoint: ``problems`` (empty: intact); ``manifest`` False for a
    checkpoint written before manifests (loaded unverified, with a note)."""

    path: Path
    problems: list[Problem] = field(default_factory=list)
    manifest: bool = True

    @property
    def intact(self) -> bool:
        return not self.problems

    def report(self) -> str:
        """One line: the checkpoint, and each damaged file with what is wrong with it."""
        if self.intact:
            return f"{self.path}: intact" + (
                "" if self.manifest else f" (no {MANIFEST}: unverified)"
            )
        listed = "; ".join(str(p) for p in self.problems[:4])
        more = f"; and {len(self.problems) - 4} more" if len(self.problems) > 4 else ""
        return f"{self.path} is damaged: {listed}{more}"


def step_of(path: Path) -> int | None:
    """The step of a ``step_NNNNNN`` folder, else None."""
    match = _STEP_DIR.fullmatch(path.name)
    return int(match[1]) if match else None


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is one checkpoint's folder: a ``step_*`` folder, or any folder holding a
    manifest or dist_checkpointing's ``metadata.json`` (e.g. an upgraded one, named freely)."""
    return path.is_dir() and (
        step_of(path) is not None
        or (path / MANIFEST).is_file()
        or (path / "metadata.json").is_file()
    )


def checkpoint_dirs(ckpt_dir: Path) -> list[Path]:
    """The published checkpoints (``step_*`` folders) in ``ckpt_dir``, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=lambda p: step_of(p) or 0)


def resume_order(ckpt_dir: Path) -> list[Path]:
    """Where ``load: auto`` looks, in order: the checkpoint ``latest`` names, then every other
    one newest first (a damaged one is skipped for the next)."""
    dirs = checkpoint_dirs(ckpt_dir)
    pointer = ckpt_dir / LATEST
    named = ckpt_dir / pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None
    first = [named] if named in dirs else []
    return first + [d for d in reversed(dirs) if d != named]


def split_check(
    folder: Path,
    mode: Verify,
    mine: Callable[[str], bool],
    with_unlisted: bool,
    progress: Progress | None = None,
) -> Verdict:
    """The checks of ``folder`` one process makes: the listed files ``mine`` selects (all, in
    one process), and files the manifest does not list when ``with_unlisted``; ``progress``
    is called with the bytes checksummed."""
    try:
        manifest = read_manifest(folder)
    except ValueError as exc:
        return Verdict(folder, [Problem(MANIFEST, str(exc))])
    if manifest is None:
        problems = [] if (folder / "metadata.json").is_file() else [_no_metadata()]
        return Verdict(folder, problems, manifest=False)
    names = [n for n in manifest["files"] if mine(n)]
    problems = verify(folder, manifest, names, mode, progress)
    if with_unlisted:
        problems += unlisted(folder, manifest)
    return Verdict(folder, problems)


def _no_metadata() -> Problem:
    return Problem("metadata.json", f"missing, and no {MANIFEST}: not a complete checkpoint")


def inspect(folder: Path, mode: Verify = "checksums", progress: Progress | None = None) -> Verdict:
    """Every check of ``folder``, in this process (``progress``: the bytes checksummed)."""
    return split_check(folder, mode, lambda _: True, with_unlisted=True, progress=progress)


def prune_plan(dirs: Sequence[Path], keep_last: int, intact: Callable[[Path], bool]) -> list[Path]:
    """The checkpoints to delete so that the newest ``keep_last`` *intact* ones stay (``dirs``
    oldest first): everything older than the oldest kept. A damaged checkpoint newer than it
    stays (it is reported when a run tries it), and the only intact checkpoint is never
    deleted, however many damaged ones are newer."""
    kept = [d for d in dirs if intact(d)][-keep_last:]
    if not kept:
        return []
    oldest = dirs.index(kept[0])
    return [d for d in dirs[:oldest] if d not in kept]
