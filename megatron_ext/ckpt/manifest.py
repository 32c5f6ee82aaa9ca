"""A checkpoint's manifest: what its writers wrote, so that a reader can tell whether it is whole.

``manifest.json`` sits beside the checkpoint's files. It is written after every rank has written
its files and before the rename that publishes the checkpoint, so a published checkpoint either
has a manifest that lists its files or predates manifests::

    {"format": 1, "step": 40, "recipe_hash": "sha256:…", "layout": {"world_size": 2, ...},
     "checksum": "crc32", "bytes": 1234567,
     "files": {"__0_0.distcp": {"bytes": 1000, "crc32": "8d1f0a3c"}, ...}}

The checksum is CRC-32 (zlib, the fastest checksum in the standard library; it catches truncation,
flipped bytes and torn writes, not tampering). Each rank hashes the files it wrote itself
(:func:`file_owner`), right after writing them, so the cost is spread over the ranks.
:func:`verify` checks a checkpoint against its manifest (sizes, and checksums unless ``sizes``
only): it returns the problems found, one per file, each naming the file and what is wrong.

Nothing here imports torch: the launcher and ``megatron-ext ckpt verify`` use it offline.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from megatron_ext.atomic import write_json

__all__ = [
    "MANIFEST",
    "Problem",
    "build_manifest",
    "file_crc32",
    "file_owner",
    "read_manifest",
    "recipe_hash",
    "unlisted",
    "verify",
]

MANIFEST = "manifest.json"
FORMAT = 1
CHUNK = 16 << 20  # bytes read per crc32 update
Verify = Literal["checksums", "sizes"]
#: called with a count of bytes just checked (a progress bar's ``update``)
Progress = Callable[[int], object]
_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp$")  # torch DCP: __<rank>_<index>.distcp


@dataclass(frozen=True)
class Problem:
    """What is wrong with one file of a checkpoint (``file`` relative to the checkpoint)."""

    file: str
    what: str

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"


def file_crc32(path: Path, progress: Progress | None = None) -> tuple[int, str]:
    """``(bytes, crc32 as 8 hex digits)`` of the file at ``path``; ``progress`` is called
    with the bytes of each chunk read (a progress bar's ``update``)."""
    crc, size = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
            size += len(chunk)
            if progress is not None:
                progress(len(chunk))
    return size, f"{crc:08x}"


def file_owner(name: str, world_size: int) -> int:
    """The rank that hashes (and verifies) file ``name``: the rank that wrote a
    ``__<rank>_<i>.distcp`` file (modulo ``world_size``, for a reader of another size), rank 0
    for everything else (metadata)."""
    match = _RANK_FILE.search(name)
    return int(match[1]) % world_size if match else 0


def checkpoint_files(folder: Path) -> list[str]:
    """Every file under ``folder`` but the manifest, as sorted relative POSIX paths."""
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if p.is_file() and p.name != MANIFEST
    )


def hash_files(folder: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": n, "crc32": hex}}`` for ``names`` under ``folder``."""
    out = {}
    for name in names:
        size, crc = file_crc32(folder / name)
        out[name] = {"bytes": size, "crc32": crc}
    return out


def build_manifest(
    files: Mapping[str, Mapping[str, Any]],
    *,
    step: int,
    recipe_hash: str,
    layout: Mapping[str, int],
) -> dict[str, Any]:
    """The manifest of a checkpoint whose hashed files are ``files`` (from :func:`hash_files`)."""
    ordered = {name: dict(files[name]) for name in sorted(files)}
    return {
        "format": FORMAT,
        "step": step,
        "recipe_hash": recipe_hash,
        "layout": dict(layout),
        "checksum": "crc32",
        "bytes": sum(f["bytes"] for f in ordered.values()),
        "files": ordered,
    }


def write_manifest(folder: Path, manifest: Mapping[str, Any]) -> None:
    write_json(folder / MANIFEST, manifest)


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of the checkpoint ``folder``, or None when it has none (older checkpoints).
    A manifest that is not valid JSON raises ``ValueError``."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{MANIFEST} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{MANIFEST} has no file list")
    return manifest


def verify(
    folder: Path,
    manifest: Mapping[str, Any],
    names: Iterable[str],
    mode: Verify = "checksums",
    progress: Progress | None = None,
) -> list[Problem]:
    """Check the files ``names`` of ``folder`` against ``manifest``: each must exist with its
    size and (``checksums``) its CRC-32. Returns the problems found, [] if they are whole.
    ``progress``: called with the bytes checksummed, chunk by chunk."""
    problems = []
    for name in sorted(names):
        expected = manifest["files"][name]["bytes"]
        path = folder / name
        if not path.is_file():
            problems.append(Problem(name, f"missing (the manifest lists {expected} bytes)"))
            continue
        size = path.stat().st_size
        if size != expected:
            kind = "truncated" if size < expected else "longer than written"
            problems.append(Problem(name, f"{size} bytes, the manifest says {expected} ({kind})"))
        elif mode == "checksums":
            crc, listed = file_crc32(path, progress)[1], manifest["files"][name]["crc32"]
            if crc != listed:
                problems.append(
                    Problem(name, f"checksum {crc}, the manifest says {listed} (bytes changed)")
                )
    return problems


def unlisted(folder: Path, manifest: Mapping[str, Any]) -> list[Problem]:
    """Files of ``folder`` its manifest does not list (written after it, or by another save)."""
    extra = sorted(set(checkpoint_files(folder)) - set(manifest["files"]))
    return [Problem(name, "not in the manifest") for name in extra]


def recipe_hash(fields: Mapping[str, Any]) -> str:
    """``sha256:<16 hex>`` of a recipe's fields as plain data
    (``megatron_ext.config.schema.recipe_dict(recipe)``; this layer knows no recipe type), as
    sorted JSON: which recipe wrote a checkpoint (any change, ``training.steps`` included,
    changes it)."""
    text = json.dumps(fields, sort_keys=True, default=str)
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
