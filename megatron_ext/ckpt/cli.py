"""``megatron-ext ckpt verify|upgrade``: checkpoints, offline.

``verify RUN_DIR_OR_CHECKPOINT``, the load-time integrity check: checks one checkpoint (a
``step_*`` folder, or any folder with a manifest or ``metadata.json``), or every checkpoint of
a run directory (its ``checkpoints/`` folder) or of a ``checkpoints/`` folder, against their
manifests: one line per checkpoint (intact, written before manifests, or damaged: which file,
what is wrong), then which one ``checkpoint.load: auto`` would resume from. Exit 0 when every
checkpoint checked is intact, 1 when one is damaged, 3 when one has no manifest (written before
manifests: an older layout, which ``ckpt upgrade`` rewrites with one), 2 when the path holds no
checkpoint. A non-zero exit also says why in one stderr line. Torch-free.

``upgrade SRC DST``: a checkpoint in an older layout rewritten once in today's
(:mod:`megatron_ext.ckpt.upgrade`; torch is imported when it runs).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_ext.ckpt.manifest import MANIFEST, read_manifest
from megatron_ext.ckpt.select import checkpoint_dirs, inspect, is_checkpoint, resume_order
from megatron_ext.commands import Command
from megatron_ext.errors import ConfigError
from megatron_ext.progress import bar

#: ``ckpt verify``'s exit codes beyond 0 and 2 (bad input)
DAMAGED, NEEDS_UPGRADE = 1, 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="ckpt_command", metavar="ACTION", required=True)
    v = sub.add_parser("verify", help="check checkpoints against their manifests")
    v.add_argument("path", help="a run directory, its checkpoints/ folder, or one step_* folder")
    v.add_argument(
        "--sizes-only", action="store_true", help="compare file sizes only (no checksums)"
    )
    u = sub.add_parser(
        "upgrade", help="rewrite a checkpoint in an older layout in today's layout, once"
    )
    u.add_argument(
        "src",
        help="a step_* checkpoint, or a run directory / checkpoints/ folder (then the "
        "checkpoint checkpoint.load=auto resumes from)",
    )
    u.add_argument("dst", help="the upgraded checkpoint's folder (must not exist)")


def _checkpoints(path: Path) -> tuple[Path | None, list[Path]]:
    """(the folder holding checkpoints or None for a single one, the checkpoints to check)."""
    if is_checkpoint(path):
        return None, [path]
    for folder in (path / "checkpoints", path):
        found = checkpoint_dirs(folder)
        if found:
            return folder, found
    raise ConfigError(
        f"{path}: no checkpoint here (expected a step_* folder, or a run directory whose "
        f"checkpoints/ folder holds them)"
    )


def _listed_bytes(folder: Path) -> int:
    """The bytes of the files ``folder``'s manifest lists (what a check reads; 0 without a
    readable manifest: a hand-edited one is reported by the check, not here)."""
    try:
        files = (read_manifest(folder) or {"files": {}})["files"]
    except ValueError:
        return 0
    sizes = [f.get("bytes") for f in files.values() if isinstance(f, dict)]
    return sum(n for n in sizes if isinstance(n, int))


def verify_main(args: argparse.Namespace) -> int:
    """Run ``megatron-ext ckpt verify``; returns the exit code (see the module docstring)."""
    folder, dirs = _checkpoints(Path(args.path))
    mode = "sizes" if args.sizes_only else "checksums"
    # checksums read every byte (minutes for a large model's checkpoints): a bar of the bytes
    # the manifests list, on a terminal
    total = sum(_listed_bytes(d) for d in dirs) if mode == "checksums" else None
    with bar("ckpt verify", f"checking {len(dirs)} checkpoint(s)", total=total, unit="B") as done:
        verdicts = {d: inspect(d, mode, done) for d in dirs}
    for verdict in verdicts.values():
        print(verdict.report())
    if folder is not None:
        usable = [d for d in resume_order(folder) if verdicts[d].intact]
        print(f"checkpoint.load=auto resumes from: {usable[0] if usable else 'nothing intact'}")
    damaged = [d for d, v in verdicts.items() if not v.intact]
    if damaged:
        print(
            f"megatron-ext: error: {len(damaged)} of {len(dirs)} checkpoints damaged (the first: "
            f"{damaged[0]}, {verdicts[damaged[0]].problems[0]}): a run skips them; restore them "
            "or resume from an intact one",
            file=sys.stderr,
        )
        return DAMAGED
    old = [d for d, v in verdicts.items() if not v.manifest]
    if old:
        print(
            f"megatron-ext: error: {old[0]}{f' and {len(old) - 1} more' if len(old) > 1 else ''}"
            f" has no {MANIFEST} (written before manifests): it needs `megatron-ext ckpt upgrade "
            f"{old[0]} {old[0].with_name(old[0].name + '.upgraded')}` to be verified",
            file=sys.stderr,
        )
        return NEEDS_UPGRADE
    return 0


def ckpt_main(args: argparse.Namespace) -> int:
    if args.ckpt_command == "verify":
        return verify_main(args)
    if args.ckpt_command == "upgrade":
        from megatron_ext.ckpt.upgrade import upgrade_main

        return upgrade_main(args)
    raise ConfigError(f"unknown ckpt action {args.ckpt_command!r}; use verify or upgrade")


#: The ``megatron_ext.commands`` entry point ``ckpt`` (setup.py).
COMMAND = Command(
    name="ckpt",
    usage="verify|upgrade ...",
    help="check checkpoints against their manifests; upgrade older layouts",
    description="Verify checkpoints offline, as a run does before loading one; rewrite a "
    "checkpoint of an older layout in today's, once (ckpt upgrade SRC DST).",
    add_arguments=add_arguments,
    run=ckpt_main,
)
