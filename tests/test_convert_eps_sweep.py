"""``eps-sweep`` on tiny random Qwen3-MoE models: with the embedding variance near the epsilon
(1e-5) the curve peaks at 1x and falls at 0.1x; with variance 1e-2 it barely moves."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from megatron_ext.convert.eps_sweep import eps_sweep, write_sweep
from megatron_ext.convert.hf import hf_to_mcore_state, model_fields
from megatron_ext.convert.parity import build_mcore
from tests.hf_tiny import tiny_qwen3_moe


def _model(variance: float):
    hf = tiny_qwen3_moe(rms_norm_eps=1e-5)
    with torch.no_grad():
        embed = hf.model.embed_tokens.weight
        embed.mul_(variance**0.5 / embed.std())
    fields = model_fields(hf.config.to_dict(), 1e-5)
    return build_mcore(fields, hf_to_mcore_state(hf.state_dict(), fields))


def test_near_epsilon_model_peaks_at_one_and_falls_at_a_tenth(tmp_path: Path) -> None:
    tokens = torch.randint(0, 96, (16, 16), generator=torch.Generator().manual_seed(1))
    rows = {r["multiple"]: r for r in eps_sweep(_model(1e-5), 1e-5, tokens)}
    print({m: round(r["cosine"], 6) for m, r in rows.items()})
    assert rows[1.0]["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert max(rows, key=lambda m: rows[m]["cosine"]) == 1.0
    assert rows[0.1]["cosine"] < 0.999
    assert rows[10.0]["cosine"] < rows[3.0]["cosine"] < 1.0
    flat = {r["multiple"]: r for r in eps_sweep(_model(1e-2), 1e-5, tokens)}
    assert flat[0.1]["cosine"] > 0.99999 and flat[0.1]["argmax_agreement"] == 1.0
    csv_path, png_path = write_sweep(list(rows.values()), tmp_path / "sweep", "tiny")
    assert csv_path.read_text().startswith("multiple,epsilon,cosine,argmax_agreement")
    assert png_path.stat().st_size > 1000


def test_the_eps_sweep_command_on_a_saved_hf_model(tmp_path: Path, capsys) -> None:
    """``megatron-ext tools eps-sweep HF_DIR``: the epsilon from the model's config, the curve
    equal to the library call's on the same tokens, CSV and PNG written."""
    from megatron_ext.launch.cli import main

    hf = tiny_qwen3_moe(rms_norm_eps=1e-5)
    hf.save_pretrained(tmp_path / "hf")
    argv = ["tools", "eps-sweep", str(tmp_path / "hf"), "--out", str(tmp_path / "sweep")]
    assert main([*argv, "--tokens", "8", "--sequences", "4"]) == 0
    out = capsys.readouterr().out
    assert "correct epsilon 1e-05" in out
    rows = [line.split(",") for line in out.splitlines() if line[:1].isdigit()]
    fields = model_fields(hf.config.to_dict(), 1e-5)
    gpt = build_mcore(fields, hf_to_mcore_state(hf.state_dict(), fields))
    tokens = torch.randint(
        0, fields["vocab_size"], (4, 8), generator=torch.Generator().manual_seed(0)
    )
    expected = eps_sweep(gpt, 1e-5, tokens)
    assert [float(r[0]) for r in rows] == [r["multiple"] for r in expected]
    for printed, want in zip(rows, expected, strict=True):
        assert float(printed[2]) == pytest.approx(want["cosine"], abs=1e-7)
    assert (tmp_path / "sweep.csv").is_file() and (tmp_path / "sweep.png").stat().st_size > 1000
