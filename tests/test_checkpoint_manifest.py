"""Checkpoint manifests without torch: what verification reports for each kind of damage, which
checkpoint ``load: auto`` tries first, what pruning keeps, and ``megatron-ext ckpt verify``.

The checkpoints here are folders of real files with manifests built by the same functions the
trainers use (:mod:`megatron_ext.ckpt`); the end-to-end runs are in test_preemption.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.ckpt.manifest import (
    MANIFEST,
    build_manifest,
    checkpoint_files,
    file_owner,
    hash_files,
    recipe_hash,
    write_manifest,
)
from megatron_ext.ckpt.select import checkpoint_dirs, inspect, prune_plan, resume_order
from megatron_ext.config.schema import recipe_dict

MEGATRON_EXT = Path(sys.executable).parent / "megatron-ext"


def fake_checkpoint(ckpt_dir: Path, step: int, manifest: bool = True) -> Path:
    """``step_NNNNNN`` with two ranks' data files and rank 0's metadata, and its manifest."""
    folder = ckpt_dir / f"step_{step:06d}"
    folder.mkdir(parents=True)
    (folder / "__0_0.distcp").write_bytes(bytes(range(256)) * 40 + bytes([step]))
    (folder / "__1_0.distcp").write_bytes(b"\x01\x02" * 3000)
    (folder / ".metadata").write_bytes(b"metadata of the tensors")
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    if manifest:
        files = hash_files(folder, checkpoint_files(folder))
        layout = {"world_size": 2, "data_parallel_size": 2}
        write_manifest(
            folder, build_manifest(files, step=step, recipe_hash="sha256:x", layout=layout)
        )
    (ckpt_dir / "latest").write_text(folder.name + "\n")
    return folder


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def test_an_intact_checkpoint_has_every_file_with_size_and_checksum(tmp_path):
    folder = fake_checkpoint(tmp_path, 40)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["step"] == 40 and manifest["layout"]["world_size"] == 2
    assert sorted(manifest["files"]) == [
        ".metadata",
        "__0_0.distcp",
        "__1_0.distcp",
        "metadata.json",
    ]
    assert manifest["files"]["__1_0.distcp"]["bytes"] == 6000
    assert manifest["bytes"] == sum(
        f.stat().st_size for f in folder.iterdir() if f.name != MANIFEST
    )
    assert inspect(folder).intact and inspect(folder).report().endswith(": intact")


@pytest.mark.parametrize(
    ("damage", "expected"),
    [
        (
            lambda f: (f / "__1_0.distcp").write_bytes(b"\x01" * 100),
            "__1_0.distcp: 100 bytes, the manifest says 6000 (truncated)",
        ),
        (lambda f: flip_byte(f / "__0_0.distcp", 5000), "__0_0.distcp: checksum"),
        (
            lambda f: (f / "__1_0.distcp").unlink(),
            "__1_0.distcp: missing (the manifest lists 6000 bytes)",
        ),
        (lambda f: (f / "stray.bin").write_bytes(b"x"), "stray.bin: not in the manifest"),
        (
            lambda f: (f / MANIFEST).write_text("{not json"),
            "manifest.json: manifest.json is not valid JSON",
        ),
    ],
    ids=["truncated", "flipped-byte", "missing-file", "unlisted-file", "bad-manifest"],
)
def test_each_kind_of_damage_is_reported_with_the_file_and_what_is_wrong(
    tmp_path, damage, expected
):
    folder = fake_checkpoint(tmp_path, 40)
    damage(folder)
    verdict = inspect(folder)
    assert not verdict.intact
    assert expected in verdict.report(), verdict.report()
    assert verdict.report().startswith(f"{folder} is damaged: ")


def test_a_flipped_byte_passes_a_sizes_only_check(tmp_path):
    folder = fake_checkpoint(tmp_path, 40)
    flip_byte(folder / "__0_0.distcp", 5000)
    assert inspect(folder, "sizes").intact and not inspect(folder).intact


def test_a_checkpoint_from_before_manifests_is_intact_but_unverified(tmp_path):
    old = inspect(fake_checkpoint(tmp_path, 40, manifest=False))
    assert old.intact and not old.manifest and "no manifest.json: unverified" in old.report()
    (old.path / "metadata.json").unlink()  # not even metadata: not a complete checkpoint
    assert "metadata.json: missing" in inspect(old.path).report()


def test_each_rank_hashes_the_files_it_wrote():
    assert [file_owner(n, 4) for n in ("__0_0.distcp", "__3_1.distcp", ".metadata")] == [0, 3, 0]
    assert file_owner("__5_0.distcp", 4) == 1  # written at another world size


def test_auto_tries_the_checkpoint_latest_names_first_then_newest_first(tmp_path):
    for step in (10, 20, 30):
        fake_checkpoint(tmp_path, step)
    (tmp_path / ".step_000040.tmp").mkdir()  # an unpublished save is not a checkpoint
    assert [p.name for p in resume_order(tmp_path)] == ["step_000030", "step_000020", "step_000010"]
    (tmp_path / "latest").write_text("step_000020\n")  # a resumed run re-saved step 20
    assert [p.name for p in resume_order(tmp_path)] == ["step_000020", "step_000030", "step_000010"]


def test_pruning_keeps_the_newest_intact_checkpoints_never_the_only_one(tmp_path):
    dirs = [fake_checkpoint(tmp_path, s) for s in (2, 4, 6, 8)]
    (dirs[3] / "__1_0.distcp").write_bytes(b"")  # the newest is damaged (truncated)
    (dirs[1] / "__0_0.distcp").unlink()

    def intact(d: Path) -> bool:
        return inspect(d, "sizes").intact

    # Counting folders, keep_last=1 would keep only the damaged step 8.
    assert prune_plan(checkpoint_dirs(tmp_path), 1, intact) == [dirs[0], dirs[1]]
    assert prune_plan(checkpoint_dirs(tmp_path), 2, intact) == []
    (dirs[2] / "__0_0.distcp").unlink()  # now step 2 is the only intact one
    assert prune_plan(checkpoint_dirs(tmp_path), 1, intact) == []


def test_recipe_hash_changes_with_any_field():
    from megatron_ext.config.load import read_recipe

    a, b = read_recipe("tiny_cpu_gpt", []), read_recipe("tiny_cpu_gpt", ["optimizer.lr=1e-3"])
    assert recipe_hash(recipe_dict(a)) == recipe_hash(recipe_dict(read_recipe("tiny_cpu_gpt", [])))
    assert recipe_hash(recipe_dict(a)) != recipe_hash(recipe_dict(b))
    assert recipe_hash(recipe_dict(a)).startswith("sha256:")


def ckpt_verify(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MEGATRON_EXT), "ckpt", "verify", *args], capture_output=True, text=True, timeout=60
    )


def test_ckpt_verify_reports_each_checkpoint_and_what_auto_would_load(tmp_path):
    ckpts = tmp_path / "run" / "checkpoints"
    fake_checkpoint(ckpts, 10)
    newest = fake_checkpoint(ckpts, 20)
    proc = ckpt_verify(str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr
    assert f"{ckpts}/step_000010: intact" in proc.stdout
    assert f"checkpoint.load=auto resumes from: {newest}" in proc.stdout

    (newest / "__0_0.distcp").write_bytes(b"short")
    proc = ckpt_verify(str(tmp_path / "run"))
    assert proc.returncode == 1
    assert f"{newest} is damaged: __0_0.distcp: 5 bytes, the manifest says 10241" in proc.stdout
    assert f"checkpoint.load=auto resumes from: {ckpts / 'step_000010'}" in proc.stdout
    one = ckpt_verify(str(newest))
    assert one.returncode == 1 and "truncated" in one.stdout
    assert ckpt_verify(str(newest), "--sizes-only").returncode == 1

    nothing = ckpt_verify(str(tmp_path))
    assert nothing.returncode == 2
    assert (
        nothing.stderr.startswith("megatron-ext: error: ")
        and "no checkpoint here" in nothing.stderr
    )
    (ckpts / "step_000010" / "manifest.json").unlink()  # as written before manifests
    old = ckpt_verify(str(ckpts / "step_000010"))
    assert old.returncode == 3 and "intact (no manifest.json: unverified)" in old.stdout
    assert old.stderr.splitlines() == [
        f"megatron-ext: error: {ckpts}/step_000010 has no manifest.json (written before "
        f"manifests): it needs `megatron-ext ckpt upgrade {ckpts}/step_000010 "
        f"{ckpts}/step_000010.upgraded` to be verified"
    ]


def test_the_trainers_pruning_never_deletes_the_checkpoint_it_resumed_from(tmp_path):
    """Resumed from step 4 because step 8 is damaged, a run writes step 6 with keep_last=1: the
    new step 6 stays (and the damaged, newer step 8), step 4 goes; counting folders would have
    kept only step 8."""
    from megatron_ext.gpt.checkpoint import _prune

    four, eight = fake_checkpoint(tmp_path, 4), fake_checkpoint(tmp_path, 8)
    (eight / "__0_0.distcp").write_bytes(b"")
    six = fake_checkpoint(tmp_path, 6)
    _prune(tmp_path, keep_last=1, written=six)
    assert checkpoint_dirs(tmp_path) == [six, eight] and not four.exists()
