"""The CPU compatibility module for Megatron-LM's training package
(megatron_ext.megatron.cpu_compat_training), the runner's argument handling and its refusals,
checked in-process; Megatron-LM's ``pretrain`` itself runs in tests/test_megatron_lm_pretrain.py.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import megatron_ext.megatron.cpu_compat_training as compat
from megatron_ext.megatron import megatron_lm
from tests.conftest import ROOT


def test_docstring_lists_exactly_what_is_replaced() -> None:
    doc = " ".join(compat.__doc__.split())
    calls = compat.replaced_calls()
    for module in compat.TORCH_VIEW_MODULES:
        assert f"``{module}``" in doc, f"{module}.torch is replaced but not documented"
        assert f"{module}.torch" in calls
    for dotted in ("torch.Tensor.cuda", "torch.nn.Module.cuda", "_warmup_jit_function"):
        assert dotted in doc
    assert "megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32" in doc
    # nothing replaced that the docstring does not name: modules' torch, the two .cuda methods,
    # the clip in its module and where optimizer.py imported it, the JIT warm-up
    names = {c.rsplit(".", 1)[-1] for c in calls}
    assert names == {
        "torch",
        "cuda",
        "clip_grad_by_total_norm_fp32",
        "_warmup_jit_function",
        "build_train_valid_test_data_iterators",
    }
    assert len(calls) == len(compat.TORCH_VIEW_MODULES) + 6


def test_changes_nothing_when_cuda_present(monkeypatch) -> None:
    import megatron.core.optimizer.clip_grads as clip_grads
    import megatron.training.training as training

    monkeypatch.setattr(compat.PATCHES, "applied", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    before = (training.torch, torch.Tensor.cuda, clip_grads.clip_grad_by_total_norm_fp32)
    assert compat.apply_training_cpu_compat() is False
    assert (training.torch, torch.Tensor.cuda, clip_grads.clip_grad_by_total_norm_fp32) == before
    assert compat.PATCHES.applied is False


def test_the_torch_view_moves_only_cuda_devices() -> None:
    view = compat._TorchView()
    assert view.zeros(2, device="cuda").device.type == "cpu"
    assert view.tensor([1.0], device="cuda:1").device.type == "cpu"
    assert view.ones(1, device=torch.device("meta")).device.type == "meta"
    assert view.device("cuda", 0) == torch.device("cpu")
    assert isinstance(torch.device("cpu"), view.device)
    assert view.cuda.is_available() and view.cuda.device_count() == 1
    assert view.float32 is torch.float32


def test_the_clip_scales_as_megatron_cores() -> None:
    from megatron.core.utils import local_multi_tensor_scale

    grads = [torch.randn(3, 4), torch.randn(5)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g.clone()
    compat._clip_fp32(params, max_norm=1.0, total_norm=4.0)
    expected = [g.clone() for g in grads]
    local_multi_tensor_scale(None, None, [expected, expected], 1.0 / (4.0 + 1e-6))
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected, strict=True))
    params[0] = torch.nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
    params[0].grad = torch.ones(3, 4, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="fp32 expected"):
        compat._clip_fp32(params, max_norm=1.0, total_norm=4.0)


def _parse(monkeypatch, argv: list[str]):
    """Megatron-LM's own parse_args with the megatron-ext group, as the runner sets it up."""
    import megatron.training.arguments as arguments

    monkeypatch.setattr(arguments, "add_megatron_arguments", arguments.add_megatron_arguments)
    megatron_lm.add_to_megatron_parser()
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *argv])
    return arguments.parse_args()


def test_megatron_lms_parser_takes_the_ext_arguments(monkeypatch) -> None:
    args = _parse(
        monkeypatch,
        [
            *("--megatron-ext-optimizer", "kl_soap", "--megatron-ext-kl-soap-factor-eps", "1e-10"),
            *("--megatron-ext-match-update-rms", "true", "--lr", "1e-3"),
        ],
    )
    from megatron.core.optimizer import OptimizerConfig

    from megatron_ext.megatron.drop_in import extension_config

    config = OptimizerConfig(optimizer=args.optimizer, lr=args.lr)  # unvalidated args: by hand
    ext = SimpleNamespace(**extension_config(megatron_lm.apply_arguments(config, args)).flat())
    assert (ext.name, ext.lr, ext.kl_soap_factor_eps, ext.match_update_rms) == (
        "kl_soap",
        1e-3,
        1e-10,
        True,
    )
    # a field megatron-core spells keeps Megatron-LM's flag only (--muon-no-split-qkv)
    with pytest.raises(SystemExit):
        _parse(monkeypatch, ["--megatron-ext-split-qkv", "false"])


@pytest.mark.parametrize(
    "argv",
    [
        ["--megatron-ext-optimizer", "shampoo"],
        ["--megatron-ext-muon-ns-method", "newton"],
        ["--megatron-ext-match-update-rms", "maybe"],
    ],
)
def test_a_bad_value_is_argparses_error(monkeypatch, capsys, argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        _parse(monkeypatch, argv)
    assert stop.value.code == 2 and "megatron-ext" in capsys.readouterr().err


def test_the_runner_without_a_script_says_how_to_call_it() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.megatron.run_pretrain", "missing.py", "--lr", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the first argument must be the script ('missing.py' is no file)"
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("fmt", "dp", "save", "load", "refused"),
    [
        ("torch", 2, "ckpt", None, True),
        ("torch", 4, None, "ckpt", True),
        ("torch", 1, "ckpt", "ckpt", False),  # one rank holds every optimizer state
        ("torch_dist", 2, "ckpt", "ckpt", False),
        ("torch", 2, None, None, False),  # nothing saved or loaded
    ],
)
def test_the_legacy_torch_format_is_refused_only_where_it_loses_state(
    fmt: str, dp: int, save: str | None, load: str | None, refused: bool
) -> None:
    """Megatron-LM's ``--ckpt-format torch`` writes data-parallel rank 0's optimizer state only
    (the launch in tests/test_megatron_lm_pretrain.py checks the refusal end to end)."""
    from argparse import Namespace

    from megatron_ext.errors import ConfigError

    args = Namespace(ckpt_format=fmt, save=save, load=load)
    if refused:
        with pytest.raises(ConfigError, match=f"sharded over the {dp} data-parallel ranks"):
            megatron_lm.check_checkpoint_format(args, dp)
    else:
        megatron_lm.check_checkpoint_format(args, dp)
