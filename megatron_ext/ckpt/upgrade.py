"""``megatron-ext ckpt upgrade SRC DST``: a checkpoint in an older layout
(:mod:`megatron_ext.ckpt.legacy`) rewritten once in today's, so that every load is one plain
``dist_checkpointing.load``.

``SRC`` is a checkpoint (a ``step_*`` folder, or any folder holding a manifest or
``metadata.json``), or a run directory or its ``checkpoints/`` folder: then the
checkpoint ``checkpoint.load: auto`` would resume from (named on stderr). ``DST`` is the new
checkpoint's folder and must not exist. Exit 2, with nothing written, when ``DST`` exists, when
``SRC`` is no checkpoint or is damaged (against its manifest), and when ``SRC`` is in today's
layout already (nothing to upgrade: load it as it is).

One process, in a 1-rank gloo group: ``SRC`` is read whole into memory (its tensors' bytes),
each older layout found is upgraded in :data:`~.legacy.LAYOUTS` order, and the result is written
with ``dist_checkpointing.save`` into ``.<DST name>.upgrade-<pid>`` beside ``DST``, with its
manifest written as the trainers write theirs (:func:`~.collective.write_manifest_collectively`);
the files are flushed to disk, the folder is checked to be in today's layout, and renamed to
``DST``. Any error removes the temporary folder: ``DST`` appears whole or not at all (a killed
upgrade leaves only the dot-folder). ``SRC`` is only read.

What ``DST`` holds is what today's trainer writes: the model's weights with the chunks ``SRC``
had, the optimizer's state name-keyed (whole tensors, one chunk each), the RNG streams and loop
state of ``SRC``'s ranks (``world`` unchanged, so a run of that size restores them), and
``metadata.json``. Its manifest's step is the loop's; its ``recipe_hash`` and ``layout`` are
``SRC``'s manifest's when it has one. A checkpoint from before manifests records neither: the
hash is left empty and the layout is ``SRC``'s world size with the tensor-parallel size its
name-keyed state shows (1 for model-laid-out AdamW, which is written as at tensor-parallel size
1), pipeline, context and expert sizes 1 (not recorded by such checkpoints).

The top level of this module imports no torch (``megatron-ext`` command modules stay light).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_ext.ckpt.manifest import read_manifest
from megatron_ext.ckpt.select import checkpoint_dirs, inspect, is_checkpoint, resume_order
from megatron_ext.errors import ConfigError
from megatron_ext.progress import bar, step

if TYPE_CHECKING:
    from megatron_ext.ckpt.contents import Contents

__all__ = ["resolve_source", "upgrade", "upgrade_main"]


def upgrade_main(args: argparse.Namespace) -> int:
    """Run ``megatron-ext ckpt upgrade`` (see the module docstring); returns the exit code."""
    dst = Path(args.dst)
    _check_paths(Path(args.src), dst)  # as given: a run directory's inside is its too
    src = resolve_source(Path(args.src))
    names = upgrade(src, dst)
    print(f"{dst}: {src} upgraded ({'; '.join(names)}); resume with checkpoint.load={dst}")
    return 0


def resolve_source(path: Path) -> Path:
    """The checkpoint ``path`` names: itself (:func:`~.select.is_checkpoint`), or the one
    ``checkpoint.load: auto`` resumes from in a run directory or ``checkpoints/`` folder."""
    if is_checkpoint(path):
        return path
    for folder in (path / "checkpoints", path):
        if checkpoint_dirs(folder):
            usable = [d for d in resume_order(folder) if inspect(d).intact]
            if not usable:
                raise ConfigError(f"{folder}: no intact checkpoint to upgrade")
            print(f"megatron-ext: upgrading {usable[0]} (checkpoint.load=auto's)", file=sys.stderr)
            return usable[0]
    raise ConfigError(
        f"{path}: no checkpoint here (expected a step_* folder, or a run directory whose "
        f"checkpoints/ folder holds them)"
    )


def upgrade(src: Path, dst: Path) -> list[str]:
    """Write ``src``, a checkpoint in older layouts, into the new checkpoint ``dst`` in today's
    layout, atomically; returns the names of the layouts upgraded. ``ConfigError`` for bad
    input (``dst`` exists, ``src`` damaged or already in today's layout)."""
    _check_paths(src, dst)
    # each phase reads or writes the whole checkpoint (minutes for a large model): a status
    # line on a terminal, the verification a bar of its bytes
    with bar("ckpt upgrade", f"checking {src}", unit="B") as done:
        verdict = inspect(src, progress=done)
    if not verdict.intact:
        raise ConfigError(f"{verdict.report()}: not upgraded")
    with step("ckpt upgrade", "importing torch and megatron-core"):
        from megatron_ext.ckpt import legacy

    with step("ckpt upgrade", f"reading {src}'s layout"):
        layouts = legacy.older_layouts(legacy.saved_tensors(src))
    if not layouts:
        raise ConfigError(
            f"{src} is in today's layout: nothing to upgrade (load it as it is, "
            f"checkpoint.load={src})"
        )
    tmp = dst.parent / f".{dst.name}.upgrade-{os.getpid()}"
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp.mkdir()
    try:
        with _one_process_group(), step("ckpt upgrade", f"rewriting {src} into {dst}"):
            _write_upgraded(src, tmp, layouts)
        if dst.exists():  # created while we wrote
            raise ConfigError(f"{dst} exists now (created during the upgrade): not replaced")
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(dst.parent)
    return [layout.name for layout in layouts]


def _check_paths(src: Path, dst: Path) -> None:
    if dst.exists() or dst.is_symlink():
        raise ConfigError(f"{dst} exists: the upgrade writes a new checkpoint, choose a new path")
    if dst.resolve().is_relative_to(src.resolve()):
        raise ConfigError(f"{dst} is inside {src}: the source is never written to")


def _write_upgraded(src: Path, tmp: Path, layouts: list[Any]) -> None:
    """Read ``src``, upgrade ``layouts``, write into ``tmp`` with its manifest, flushed."""
    from megatron_ext.ckpt import legacy
    from megatron_ext.ckpt.collective import write_manifest_collectively
    from megatron_ext.ckpt.contents import read_contents, write_contents

    contents = read_contents(src)
    for layout in layouts:
        layout.upgrade(contents)
    try:
        step = int(contents.common["loop"]["step"])
    except (KeyError, TypeError, ValueError):
        raise ConfigError(f"{src}: no loop state (loop.step): not a GPT checkpoint") from None
    recipe_hash, layout = _manifest_fields(src, contents)
    write_contents(contents, tmp)
    write_manifest_collectively(tmp, step=step, recipe_hash=recipe_hash, layout=layout)
    for path in sorted(tmp.rglob("*")):
        _fsync(path)
    _fsync(tmp)
    left = legacy.older_layouts(legacy.saved_tensors(tmp))
    if left:  # a bug of an upgrade, not of the input
        raise RuntimeError(f"the upgrade left {[x.name for x in left]} in {tmp}")


def _manifest_fields(src: Path, contents: Contents) -> tuple[str, dict[str, int]]:
    """``(recipe_hash, layout)`` of the upgraded checkpoint's manifest (module docstring)."""
    manifest = read_manifest(src)
    if manifest is not None:
        return manifest.get("recipe_hash", ""), dict(manifest["layout"])
    world = int(contents.common.get("world", 1))
    tp = _tensor_parallel_size(contents)
    return "", {
        "world_size": world,
        "tensor_model_parallel_size": tp,
        "pipeline_model_parallel_size": 1,
        "context_parallel_size": 1,
        "expert_model_parallel_size": 1,
        "data_parallel_size": world // tp,
    }


def _tensor_parallel_size(contents: Contents) -> int:
    """How many shards each parameter's Adam moment is of its model weight, at most (1 when
    every ``exp_avg`` is a whole parameter)."""
    from megatron_ext.ckpt.legacy import NAMED

    prefix = f"{NAMED}exp_avg."
    ratios = [1]
    for key, moment in contents.tensors.items():
        if not key.startswith(prefix):
            continue
        model_key, _, offsets = key[len(prefix) :].rpartition("@")
        weight = contents.tensors.get(model_key)
        if weight is not None:
            axes = len(offsets.split("_")) - moment.dim()
            ratios.append(math.prod(weight.shape[axes:]) // max(moment.numel(), 1))
    return max(ratios)


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A 1-rank gloo group as the default group (dist_checkpointing's collectives need one),
    torn down after; an existing default group of one rank is used as it is."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ConfigError("ckpt upgrade runs in one process, not under several ranks")
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
