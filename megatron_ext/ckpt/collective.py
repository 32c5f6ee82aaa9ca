"""Manifests written and checked by every rank of a job (torch.distributed), for any trainer.

Each rank hashes (and verifies) the files it wrote itself (:func:`.manifest.file_owner`), right
after writing them, while they are still in its page cache; the results meet on rank 0 (write)
or on every rank (verify, so that every rank takes the same decision). Collective: every rank
of the default group calls these functions, with the same folder.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch.distributed as dist

from megatron_ext.ckpt.manifest import (
    Verify,
    build_manifest,
    checkpoint_files,
    file_owner,
    hash_files,
    write_manifest,
)
from megatron_ext.ckpt.select import Verdict, split_check

__all__ = ["verify_collectively", "write_manifest_collectively"]


def write_manifest_collectively(
    folder: Path, *, step: int, recipe_hash: str, layout: Mapping[str, int]
) -> None:
    """Hash ``folder``'s files (each rank its own) and write its manifest on rank 0. Call after
    every rank finished writing (a barrier) and before publishing the folder."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = [n for n in checkpoint_files(folder) if file_owner(n, world) == rank]
    parts: list[dict | None] = [None] * world
    dist.all_gather_object(parts, hash_files(folder, mine))
    if rank == 0:
        files = {name: entry for part in parts for name, entry in (part or {}).items()}
        write_manifest(
            folder, build_manifest(files, step=step, recipe_hash=recipe_hash, layout=layout)
        )


def verify_collectively(folder: Path, mode: Verify = "checksums") -> Verdict:
    """:func:`.select.inspect` of ``folder`` with the files shared out over the ranks; every
    rank returns the same verdict."""
    rank, world = dist.get_rank(), dist.get_world_size()
    local = split_check(
        folder, mode, lambda name: file_owner(name, world) == rank, with_unlisted=rank == 0
    )
    verdicts: list[Verdict | None] = [None] * world
    dist.all_gather_object(verdicts, local)
    problems = sorted(
        {p for v in verdicts if v is not None for p in v.problems}, key=lambda p: p.file
    )
    return Verdict(folder, problems, manifest=local.manifest)
