"""Checkpoints in older optimizer-state layouts still load (megatron_ext/megatron/legacy_state.py).

Each fixture under ``tests/fixtures`` was written by the old code (``tests/fixtures/README.txt``
gives the commands): AdamW state laid out like the model (main at 1ad6c63) and KL-SOAP's explicit
factors (the tree before 7b2e38b). Resuming each for 3 steps on 2 gloo ranks must give, bit for
bit, the losses and gradient norms that resuming it gave with the code before the name-keyed form
(02f9e04, the expected values below; the norms to one rounding, which depends on the CPU); the
AdamW figures need the loaded moments (zeroing the first moment on load moves the second loss
by 4e-3).

The bf16 AdamW fixture (``legacy_adamw/adamw_bf16``) is kept but not resumed here: since bf16
models run in megatron-core's ``Float16Module`` (322d2fb) their norms are bf16, so its old
trajectory (5.928124, 5.923158, 5.933112 at 02f9e04) can no longer be reproduced, and its norms'
fp32 masters come from their fp32 weights (megatron_ext/megatron/fp32_weight_masters.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

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
OPTIMIZER = {
    "adamw_fp32": ("optimizer.name=adamw", "training.precision=fp32"),
    "kl_soap": ("optimizer.name=kl_soap", "training.precision=fp32"),
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


def test_each_older_layout_resumes_as_the_old_code_did(recipe_file, tmp_path):
    runs = []
    for layout in EXPECTED:  # one torchrun start for both resumes
        run = [str(recipe_file), f"run_dir={tmp_path / layout}"]
        runs += [*run, f"checkpoint.load={CHECKPOINTS[layout]}", *OPTIMIZER[layout], "--"]
    proc = run_torchrun(DIST / "train_several.py", 2, *runs[:-1])
    for layout in EXPECTED:  # written before manifests: loaded unverified, and said so
        note = f"{CHECKPOINTS[layout]} has no manifest (written before manifests): loading it"
        assert f"megatron-ext: note: {note} unverified" in proc.stderr, proc.stderr[-2000:]
    for layout, (losses, norms) in EXPECTED.items():
        rows = [
            json.loads(r) for r in (tmp_path / layout / "metrics.jsonl").read_text().splitlines()
        ]
        assert [r["step"] for r in rows] == [4, 5, 6], layout
        assert [r["loss"] for r in rows] == losses, layout
        # The norm's own reduction rounds by the CPU's vector kernels: on an AMD Zen 5 host the
        # step-4 norms differ from the Intel host's that recorded them by 6e-8 (one rounding),
        # every loss and later norm bit for bit.
        assert [r["grad_norm"] for r in rows] == pytest.approx(norms, rel=1e-6, abs=0), layout


def test_kl_soap_factors_are_asked_for_under_their_old_names_only_where_needed():
    """Which key each KL-SOAP factor entry is loaded from: the old one (``factor_l``) only when
    the checkpoint lacks the current one (``factor_basis_l``) and holds the old."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from megatron_ext.megatron.legacy_state import ExplicitKLSoapFactors

    prefix = "optimizer.layerwise"

    class Adapter:  # the one method the reader asks of the optimizer adapter
        def named_sharded_state(self, model_sd: dict) -> dict:
            def st(key: str) -> ShardedTensor:
                return ShardedTensor.from_rank_offsets(f"{prefix}.{key}", torch.zeros(2, 2))

            return {
                "layerwise": {
                    "w": {"factor_basis_l": st("factor_basis_l.w@0_0"), "exp_avg": st("e.w@0_0")},
                    "v": {"factor_basis_l": st("factor_basis_l.v@0_0")},
                }
            }

    saved = {f"{prefix}.factor_l.w@0_0", f"{prefix}.factor_basis_l.v@0_0", f"{prefix}.e.w@0_0"}
    state = ExplicitKLSoapFactors(saved, prefix).sharded_state(Adapter(), {})["layerwise"]
    assert set(state["w"]) == {"factor_l", "exp_avg"}
    assert state["w"]["factor_l"].key == f"{prefix}.factor_l.w@0_0"
    assert set(state["v"]) == {"factor_basis_l"}  # the current key is in the checkpoint
