"""Atomic file replacement: write a temporary file next to the target, then rename it over.

A crash or an exception while writing leaves the previous file (or none), never a truncated
one: the rename is atomic on POSIX because the temporary file sits in the same folder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = [
    "atomic_dir",
    "atomic_path",
    "check_output_path",
    "new_parents",
    "save_figure",
    "write_json",
]


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; on success it is flushed to disk and
    renamed over ``path``, on an exception removed.

    The temporary name keeps ``path``'s suffix, for writers that choose the format from it
    (matplotlib's ``savefig``, ``numpy.save``). The parent folder is created if missing.
    """
    path = Path(path)
    created = _make_parents(path)
    tmp = path.with_name(f".{path.stem}.tmp{os.getpid()}{path.suffix}")
    try:
        yield tmp
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        _remove_empty(created)
        raise


@contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside ``path`` to fill; on success it is renamed to ``path``
    (which must not exist, or be an empty folder), on an exception removed with its contents:
    a command that writes a folder of files (a converted checkpoint) leaves all of it or none.
    """
    import shutil

    path = Path(path)
    created = _make_parents(path)
    tmp = path.with_name(f".{path.name}.partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        yield tmp
        if path.is_dir():
            path.rmdir()  # empty (an OSError otherwise: nothing of it is touched)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(created)
        raise


def check_output_path(path: str | Path, flag: str, *, folder: bool = False) -> Path:
    """Refuse, before any work, an output ``path`` that cannot be written: a file (or, unless
    ``folder``, a folder) already there in the wrong kind, or a file where a parent folder
    belongs. Raises ``ConfigError`` naming ``flag``; returns ``path``."""
    from megatron_ext.errors import ConfigError

    path = Path(path)
    if path.is_dir() and not folder:
        raise ConfigError(f"{flag} {path} is a folder: give a file name (e.g. {path}/out)")
    if path.exists() and folder and not path.is_dir():
        raise ConfigError(f"{flag} {path} is a file: give a folder")
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder; give another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: {parent} is not writable; give another path")
    return path


@contextmanager
def new_parents(path: str | Path) -> Iterator[None]:
    """Create ``path``'s missing parent folders for a writer that manages its own files
    (``data build``'s temporary names); on an exception remove those it created, if empty."""
    created = _make_parents(Path(path))
    try:
        yield
    except BaseException:
        _remove_empty(created)
        raise


def _make_parents(path: Path) -> list[Path]:
    """Create ``path``'s missing parent folders; returns those created, deepest first."""
    missing = []
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    path.parent.mkdir(parents=True, exist_ok=True)
    return missing


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders :func:`_make_parents` created, where still empty (a failed write
    leaves no empty folder behind)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def write_json(path: str | Path, data: Mapping[str, Any]) -> None:
    """Write ``data`` as indented JSON (one trailing newline) to ``path``, atomically: the one
    JSON writer of the trainers' summaries and the benchmarks' reports."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def save_figure(fig: Any, path: str | Path, *, dpi: int = 110) -> Path:
    """Lay ``fig`` out (``tight_layout``), write it as PNG to ``path`` atomically and close it
    (pyplot keeps every open figure alive): the one writer of the plots. Returns ``path``."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=dpi)
    plt.close(fig)
    return Path(path)
