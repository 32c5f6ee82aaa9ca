"""The real ``megatron-ext convert`` commands on a tiny random Qwen3-MoE saved with
``save_pretrained`` whose config.json leaves the epsilon out: hf-to-mcore says it used the family
default, check reports parity in its JSON; bad input exits 2."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from transformers import Qwen3MoeForCausalLM

from tests.hf_tiny import tiny_qwen3_moe

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(MEGATRON_EXT), "convert", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"},
    )


def test_hf_to_mcore_then_check(tmp_path: Path, capsys) -> None:
    hf_dir = tmp_path / "hf"
    tiny_qwen3_moe().save_pretrained(hf_dir)
    raw = json.loads((hf_dir / "config.json").read_text())
    raw.pop("rms_norm_eps")  # the trap: a config without the epsilon
    (hf_dir / "config.json").write_text(json.dumps(raw))
    out = tmp_path / "mcore"
    proc = _cli("hf-to-mcore", str(hf_dir), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "layernorm_epsilon=1e-06 from the qwen3_moe HF class default" in proc.stdout
    assert json.loads((out / "model.json").read_text())["layernorm_epsilon"] == 1e-6
    from megatron.core import dist_checkpointing

    common = dist_checkpointing.load_common_state_dict(str(out / "step_000000"))
    assert common["loop"]["step"] == 0  # the GPT trainer's weights-only start
    report = tmp_path / "parity.json"
    proc = _cli("check", str(hf_dir), str(out), "--json", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(report.read_text())
    print(figures)
    assert figures["max_abs_diff"] <= 1e-4 and figures["cosine"] >= 0.99999
    assert figures["argmax_agreement"] == 1.0
    assert figures["expert_selection_agreement"] == [1.0, 1.0]
    # its checkpoint carries a manifest like a run's (was: "written before manifests")
    from megatron_ext.ckpt.cli import verify_main

    assert verify_main(argparse.Namespace(path=str(out / "step_000000"), sizes_only=False)) == 0
    # another model's weights (same shapes) fail the parity: exit 1, one line naming the figures
    other = tmp_path / "other"
    tiny_qwen3_moe(initializer_range=0.2).save_pretrained(other)
    from megatron_ext.launch.cli import main  # in this process: the exit path ran above

    capsys.readouterr()
    assert main(["convert", "check", str(other), str(out)]) == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("megatron-ext: error: parity failed: cosine ") and "argmax" in line
    back = tmp_path / "back"
    proc = _cli("mcore-to-hf", str(out), str(back))
    assert proc.returncode == 0, proc.stderr[-3000:]
    reloaded = Qwen3MoeForCausalLM.from_pretrained(back).state_dict()
    original = Qwen3MoeForCausalLM.from_pretrained(hf_dir).state_dict()
    assert set(reloaded) == set(original)
    assert all(torch.equal(reloaded[k], original[k]) for k in original)


def test_not_a_model_directory_exits_2(tmp_path: Path) -> None:
    proc = _cli("hf-to-mcore", str(tmp_path), str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "no config.json" in proc.stderr
