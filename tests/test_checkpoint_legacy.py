"""Checkpoints in older optimizer-state layouts are upgraded once (``megatron-ext ckpt upgrade``,
megatron_ext/ckpt/legacy.py) and then resume as the old code resumed them.

Each fixture under ``tests/fixtures`` was written by the old code (``tests/fixtures/README.txt``
gives the commands): AdamW state laid out like the model (main at 1ad6c63) and KL-SOAP's explicit
factors (the tree before 7b2e38b). Upgraded, then resumed for 3 steps on 2 gloo ranks, each must
give, bit for bit, the losses and gradient norms that resuming it gave with the code before the
name-keyed form (02f9e04, the expected values below; the norms to one rounding, which depends on
the CPU); the AdamW figures need the loaded moments (zeroing the first moment on load moves the
second loss by 4e-3). The upgraded checkpoint has the layout of one today's code writes (keys,
shapes, dtypes, chunks, objects, common state, manifest) and passes ``ckpt verify``; the source
is untouched; an existing destination, a checkpoint in today's layout and an interrupted upgrade
write nothing; loading a fixture without upgrading stops with exit 2 and the upgrade command.

The bf16 AdamW fixture (``legacy_adamw/adamw_bf16``) is only recognised here: since bf16 models
run in megatron-core's ``Float16Module`` (322d2fb) their norms are bf16, so its old trajectory
(5.928124, 5.923158, 5.933112 at 02f9e04) can no longer be reproduced; its norms' fp32 masters
come from their fp32 weights (upgraded and resumed in tests/test_precision_ab.py).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from megatron_ext.ckpt.manifest import MANIFEST, file_crc32
from tests.conftest import DIST, run_torchrun

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TEXT = "\n\n".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i % 7} times, "
    f"while megatron trains a tiny model on byte {i % 13}."
    for i in range(400)
)
# Steps 4-6 after resuming each step-3 fixture, as computed by the code at 02f9e04.
EXPECTED = {
    "adamw_fp32": (
        [5.92820930480957, 5.923218250274658, 5.933165788650513],
        [0.9916831709719846, 0.9551301407642606, 0.9040319000983407],
    ),
    # The tree that wrote it, resuming itself: 5.916198, 5.909274, 5.899215 (KL-SOAP's math
    # has changed since, within 1e-4).
    "kl_soap": (
        [5.916197776794434, 5.909185886383057, 5.899438381195068],
        [0.99951631053919, 0.9617528790043377, 0.9241279615501565],
    ),
}
CHECKPOINTS = {
    "adamw_fp32": FIXTURES / "legacy_adamw" / "adamw_fp32" / "step_000003",
    "kl_soap": FIXTURES / "legacy_kl_soap" / "step_000003",
}
# what `ckpt upgrade` is given: a step folder, and a checkpoints folder (its latest checkpoint)
SOURCES = {"adamw_fp32": CHECKPOINTS["adamw_fp32"], "kl_soap": FIXTURES / "legacy_kl_soap"}
OPTIMIZER = {
    "adamw_fp32": ("optimizer.name=adamw", "training.precision=fp32"),
    "kl_soap": ("optimizer.name=kl_soap", "training.precision=fp32"),
}


def checksums(folder: Path) -> dict[str, tuple[int, str]]:
    """``{relative path: (bytes, crc32)}`` of every file under ``folder``."""
    return {
        p.relative_to(folder).as_posix(): file_crc32(p) for p in folder.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def recipe_file(tmp_path_factory) -> Path:
    """The fixtures' model and batch (README.txt), on this module's corpus."""
    root = tmp_path_factory.mktemp("legacy")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    recipe = {
        "trainer": "gpt",
        "model": {
            "num_layers": 1,
            "hidden_size": 16,
            "num_attention_heads": 2,
            "num_query_groups": 1,
            "ffn_hidden_size": 32,
        },
        "optimizer": {
            "lr": 1e-3,
            "min_lr": 6e-4,
            "weight_decay": 0.1,
            "adam_beta2": 0.95,
            "clip_grad": 1.0,
        },
        "data": {"path": str(root / "data" / "corpus"), "source": [str(root / "corpus.txt")]},
        "training": {
            "steps": 6,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "seq_length": 16,
            "lr_warmup_steps": 0,
            "lr_decay_style": "cosine",
        },
        "logging": {"log_interval": 1, "tensorboard": False, "progress_bar": "off"},
        "checkpoint": {"save_interval": 0, "save_at_end": False},
    }
    path = root / "legacy.yaml"
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def commands(recipe_file, tmp_path_factory) -> dict:
    """Every ``megatron-ext`` command of this module, in one process (tests/dist/cli_several.py):
    the upgrades, the refused and interrupted ones, and a load of a fixture not upgraded."""
    root = tmp_path_factory.mktemp("upgrade")
    before = checksums(FIXTURES)
    dst = {layout: root / "dst" / layout for layout in SOURCES}
    taken = root / "dst" / "taken"
    taken.mkdir(parents=True)
    (taken / "mine.txt").write_text("not to be overwritten\n")
    groups = {
        **{layout: ["ckpt", "upgrade", str(SOURCES[layout]), str(dst[layout])] for layout in dst},
        "taken": ["ckpt", "upgrade", str(CHECKPOINTS["adamw_fp32"]), str(taken)],
        "today": ["ckpt", "upgrade", str(dst["adamw_fp32"]), str(root / "dst" / "again")],
        "interrupted": [
            *("--fail-in", "megatron_ext.ckpt.collective:write_manifest_collectively"),
            *("ckpt", "upgrade", str(CHECKPOINTS["adamw_fp32"]), str(root / "dst" / "cut")),
        ],
        "not_upgraded": [
            *("train", str(recipe_file), f"run_dir={root / 'run'}"),
            *(f"checkpoint.load={CHECKPOINTS['adamw_fp32']}", *OPTIMIZER["adamw_fp32"]),
        ],
    }
    argv = [a for group in groups.values() for a in (*group, "--")][:-1]
    proc = run_torchrun(DIST / "cli_several.py", 1, *argv)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"argv"')]
    assert len(lines) == len(groups), proc.stdout[-3000:] + proc.stderr[-3000:]
    results = dict(zip(groups, lines, strict=True))
    for layout in dst:
        assert results[layout]["code"] == 0, results[layout]["stderr"][-3000:]
    return {"results": results, "root": root, "dst": dst, "before": before}


@pytest.fixture(scope="module")
def resumed(recipe_file, commands, tmp_path_factory) -> Path:
    """Both upgraded checkpoints resumed to step 6 (one torchrun start), each saving step 6."""
    root = tmp_path_factory.mktemp("resumed")
    runs = []
    for layout in EXPECTED:
        run = [str(recipe_file), f"run_dir={root / layout}", "checkpoint.save_at_end=true"]
        runs += [*run, f"checkpoint.load={commands['dst'][layout]}", *OPTIMIZER[layout], "--"]
    proc = run_torchrun(DIST / "train_several.py", 2, *runs[:-1])
    assert "no manifest" not in proc.stderr, proc.stderr[-2000:]  # the upgrade wrote one
    return root


def test_each_upgraded_layout_resumes_as_the_old_code_did(resumed):
    for layout, (losses, norms) in EXPECTED.items():
        rows = [
            json.loads(r) for r in (resumed / layout / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in rows] == [4, 5, 6], layout
        assert [r["loss"] for r in rows] == losses, layout
        # The norm's own reduction rounds by the CPU's vector kernels: on an AMD Zen 5 host the
        # step-4 norms differ from the Intel host's that recorded them by 6e-8 (one rounding),
        # every loss and later norm bit for bit.
        assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-6, abs=0), layout


def layout_of(folder: Path) -> dict:
    """What a loader sees of a checkpoint: every tensor's shape, dtype and chunks, every
    object's key, the common state's keys and world size, the manifest's fields. Optimizer
    state is written in each rank's element ranges by today's ZeRO-1 AdamW and whole by the
    upgrade: for it, whether the chunks tile the tensor (what any reader needs), not how."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata

    def chunks(key: str, m: TensorStorageMetadata) -> Any:
        if key.startswith("optimizer."):  # elements covered, once each
            return sum(math.prod(c.sizes) for c in m.chunks) == math.prod(m.size)
        return sorted((c.offsets, c.sizes) for c in m.chunks)

    tensors = {
        key: (tuple(m.size), m.properties.dtype, chunks(key, m))
        for key, m in metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }
    common = dist_checkpointing.load_common_state_dict(str(folder))
    manifest = json.loads((folder / MANIFEST).read_text())
    return {
        "tensors": tensors,
        "objects": sorted(k for k in metadata if k not in tensors),
        "common": (sorted(common), common["world"], sorted(common["loop"])),
        "manifest": (sorted(manifest), sorted(manifest["layout"]), manifest["layout"]),
    }


def test_the_upgraded_checkpoint_is_laid_out_as_todays_code_writes(commands, resumed):
    """The upgraded step 3 against the step 6 the resumed run wrote with today's code."""
    for layout in EXPECTED:
        upgraded = layout_of(commands["dst"][layout])
        today = layout_of(resumed / layout / "checkpoints" / "step_000006")
        assert upgraded == today, layout
        assert not any(k.startswith("optimizer.state.") for k in upgraded["tensors"])
        assert json.loads((commands["dst"][layout] / MANIFEST).read_text())["step"] == 3


def test_the_upgraded_checkpoint_passes_ckpt_verify(commands, capsys):
    from megatron_ext.ckpt.cli import verify_main

    for layout, dst in commands["dst"].items():
        assert verify_main(argparse.Namespace(path=str(dst), sizes_only=False)) == 0, layout
        assert capsys.readouterr().out == f"{dst}: intact\n"
    said = commands["results"]["kl_soap"]
    assert f"upgrading {CHECKPOINTS['kl_soap']} (checkpoint.load=auto's)" in said["stderr"]
    assert said["stdout"].startswith(f"{commands['dst']['kl_soap']}: ")
    assert "explicit KL-SOAP factors" in said["stdout"]


def test_the_source_is_untouched(commands):
    assert checksums(FIXTURES) == commands["before"]


def test_an_existing_destination_is_refused_and_left_as_it_was(commands):
    taken = commands["results"]["taken"]
    assert taken["code"] == 2
    assert f"megatron-ext: error: {commands['root'] / 'dst' / 'taken'} exists" in taken["stderr"]
    folder = commands["root"] / "dst" / "taken"
    assert checksums(folder) == {"mine.txt": file_crc32(folder / "mine.txt")}
    assert (folder / "mine.txt").read_text() == "not to be overwritten\n"
    assert not list(folder.parent.glob(".taken*"))


def test_an_interrupted_upgrade_leaves_no_destination(commands):
    """A failure after the data files were written and before the manifest: no ``cut``, and
    no temporary folder beside it."""
    cut = commands["results"]["interrupted"]
    assert cut["code"] == 1 and "RuntimeError: injected failure" in cut["stderr"]
    assert not (commands["root"] / "dst" / "cut").exists()
    assert not list((commands["root"] / "dst").glob(".cut*"))


def test_a_checkpoint_in_todays_layout_has_nothing_to_upgrade(commands):
    today = commands["results"]["today"]
    assert today["code"] == 2, today["stderr"][-2000:]
    assert "is in today's layout: nothing to upgrade" in today["stderr"]
    assert not (commands["root"] / "dst" / "again").exists()


def test_loading_an_older_layout_without_upgrading_stops_with_the_fix(commands):
    result = commands["results"]["not_upgraded"]
    assert result["code"] == 2, result["stderr"][-3000:]
    errors = [x for x in result["stderr"].splitlines() if x.startswith("megatron-ext: error:")]
    src = CHECKPOINTS["adamw_fp32"]
    assert len(errors) == 1, result["stderr"][-3000:]
    assert errors[0].startswith(f"megatron-ext: error: {src} is a checkpoint in an older layout")
    assert "AdamW state laid out like the model" in errors[0]
    fix = f"`megatron-ext ckpt upgrade {src} {src}.upgraded`, then resume with checkpoint.load="
    assert errors[0].endswith(f"{fix}{src}.upgraded")
    assert not (commands["root"] / "run" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("fixture", "layouts"),
    [
        ("legacy_adamw/adamw_fp32", ["model-laid-out AdamW"]),
        ("legacy_adamw/adamw_bf16", ["model-laid-out AdamW", "fp32-era norms"]),
        ("legacy_kl_soap", ["explicit KL-SOAP factors"]),
        ("precision_fp32_norms/muon", ["fp32-era norms"]),
        ("precision_fp32_norms/adamw", ["model-laid-out AdamW", "fp32-era norms"]),
    ],
)
def test_each_fixture_is_recognised_from_its_metadata(fixture, layouts):
    from megatron_ext.ckpt.legacy import older_layouts, saved_tensors

    found = older_layouts(saved_tensors(FIXTURES / fixture / "step_000003"))
    assert [layout.name for layout in found] == layouts
