"""``training.precision``: the one mapping to megatron-core, the rules table and its fail-closed
gate (every refusal on this CPU host, the accept paths on faked device descriptions), the
torch-free device probe, and the recipe rules that need no hardware."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_ext.config.load import load_recipe
from megatron_ext.errors import ConfigError
from megatron_ext.launch.hosts import HostInfo
from megatron_ext.run import hardware
from megatron_ext.run.hardware import (
    REQUIREMENTS,
    DeviceDescription,
    probe_device,
    supported_precisions,
    unmet_requirement,
)
from megatron_ext.run.precision import PRECISIONS, SPECS, precision_spec, transformer_config_fields
from tests.test_launcher import build, write_recipe

QUANTIZED = [p for p in PRECISIONS if precision_spec(p).quantized]
CPU_HOST = probe_device()  # this machine, as the launcher sees it
ON_CPU_HOST = pytest.mark.skipif(CPU_HOST.gpus > 0, reason="checks a CPU host's refusals")


def device(cc: tuple[int, int] | None, cuda=(12, 8), te: str | None = "2.8.0", n: int = 1):
    """A faked description: ``n`` GPUs of compute capability ``cc``."""
    return DeviceDescription(
        names=("NVIDIA Fake",) * n, capabilities=(cc,) * n, cuda=cuda, transformer_engine=te,
        source="faked",
    )  # fmt: skip


# --------------------------------------------------------------------------- the mapping


def test_every_precision_has_one_spec_and_dtype():
    import torch

    from megatron_ext.run.precision import precision_dtype

    assert tuple(SPECS) == PRECISIONS
    half = {"fp32": torch.float32, "fp16": torch.float16}
    assert {p: precision_dtype(p) for p in PRECISIONS} == {
        p: half.get(p, torch.bfloat16) for p in PRECISIONS
    }
    with pytest.raises(ConfigError, match="fp8"):
        precision_dtype("fp8")


@pytest.mark.parametrize(
    ("precision", "expected"),
    [
        ("fp32", {"bf16": False, "fp8": None, "fp4": None}),
        ("bf16", {"bf16": True, "fp8": None, "fp4": None}),
        ("fp8_tensorwise", {"bf16": True, "fp8": "hybrid", "fp8_recipe": "tensorwise"}),
        ("fp8_delayed", {"bf16": True, "fp8": "hybrid", "fp8_recipe": "delayed"}),
        ("fp8_blockwise", {"bf16": True, "fp8": "e4m3", "fp8_recipe": "blockwise"}),
        ("mxfp8", {"bf16": True, "fp8": "e4m3", "fp8_recipe": "mxfp8"}),
        ("nvfp4", {"bf16": True, "fp8": None, "fp4": "e2m1", "fp4_recipe": "nvfp4"}),
        ("fp16", {"bf16": False, "fp16": True, "fp8": None, "fp4": None}),
    ],
)
def test_each_precision_maps_to_megatron_core_fields(precision, expected):
    """The fields are megatron-core 0.19's own: its TransformerConfig accepts and keeps them."""
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    start, end = (1, 1) if precision in ("fp8_tensorwise", "mxfp8", "nvfp4") else (0, 0)
    fields = transformer_config_fields(precision, start, end)
    config = TransformerConfig(
        num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True, **fields
    )
    for key, value in expected.items():
        assert getattr(config, key) == value, key
    dtype = {"fp32": torch.float32, "fp16": torch.float16}.get(precision, torch.bfloat16)
    assert config.params_dtype == config.pipeline_dtype == dtype
    assert config.fp8_param is False and config.fp4_param is False
    assert config.first_last_layers_bf16 is bool(start)
    assert (config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16) == (start, end)


# --------------------------------------------------------------------------- the table


#: every precision but fp16, which every machine runs (torch's float16 kernels, CPU included):
#: the test adds it to each row
TRAINED = [p for p in PRECISIONS if p != "fp16"]


# (device, precisions it runs): the accept and refuse paths of every row
@pytest.mark.parametrize(
    ("dev", "runs"),
    [
        (device((8, 0)), ["fp32", "bf16"]),  # A100: no FP8 GEMMs
        (device((8, 9)), ["fp32", "bf16", "fp8_tensorwise", "fp8_delayed"]),  # L40S
        (device((9, 0)), ["fp32", "bf16", "fp8_tensorwise", "fp8_delayed"]),  # H200, CUDA 12.8
        (
            device((9, 0), cuda=(12, 9)),
            ["fp32", "bf16", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise"],
        ),
        (device((10, 0), cuda=(12, 9)), TRAINED),  # B200
        (device((11, 0), cuda=(13, 0)), TRAINED),  # Thor
        (  # 12.x (RTX 50xx): MXFP8 not yet
            device((12, 0), cuda=(12, 9)),
            ["fp32", "bf16", "fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "nvfp4"],
        ),
        (device((10, 0), cuda=(12, 9), te=None), ["fp32", "bf16"]),  # no Transformer Engine
        (device((10, 0), cuda=(12, 9), te="2.1.0"), ["fp32", "bf16", "fp8_delayed", "mxfp8"]),
        (device((10, 0), cuda=(12, 9), te="2.3.0.dev0+5fdd7bb"), PRECISIONS[:6]),
        (device((10, 0), cuda=(12, 9), te="unknown"), ["fp32", "bf16", "fp8_delayed"]),
        (device(None), ["fp32", "bf16"]),  # compute capability unknown: fail closed
        (device((10, 0), n=0), ["fp32", "bf16"]),  # no GPU
    ],
)
def test_the_table_accepts_and_refuses(dev, runs):
    runs = [*runs, "fp16"]
    assert supported_precisions(dev) == runs
    for p in PRECISIONS:
        assert (unmet_requirement(p, dev) is None) == (p in runs), p


def test_the_lowest_compute_capability_decides():
    mixed = DeviceDescription(
        names=("NVIDIA B200", "NVIDIA H200"), capabilities=((10, 0), (9, 0)), cuda=(12, 9),
        transformer_engine="2.8.0", source="faked",
    )  # fmt: skip
    assert mixed.compute_capability == (9, 0)
    assert "mxfp8" not in supported_precisions(mixed)


def test_a_refusal_is_one_line_with_requirement_source_and_machine():
    h200 = DeviceDescription(
        names=("NVIDIA H200",), capabilities=((9, 0),), cuda=(12, 8),
        transformer_engine="2.5.0", source="nvidia-smi",
    )  # fmt: skip
    reason = unmet_requirement("mxfp8", h200)
    assert reason is not None and "\n" not in reason
    assert "needs Transformer Engine >= 2.1.0 and a GPU of compute capability 10.x-11.x" in reason
    assert "_compute_mxfp8_support" in reason  # the rule's source
    assert "1 x NVIDIA H200 (compute capability 9.0), CUDA 12.8 (torch)" in reason
    assert "Transformer Engine 2.5.0" in reason
    assert reason.endswith("it can run: fp32, bf16, fp8_tensorwise, fp8_delayed, fp16")


@ON_CPU_HOST
@pytest.mark.parametrize("precision", QUANTIZED)
def test_this_cpu_host_refuses_every_fp8_and_fp4_precision(precision):
    reason = unmet_requirement(precision, CPU_HOST)
    assert reason is not None and reason.startswith(f"training.precision={precision} needs ")
    assert "this machine has no GPU" in reason and reason.endswith("it can run: fp32, bf16, fp16")
    assert REQUIREMENTS[precision].describe() in reason


# --------------------------------------------------------------------------- the probe


def fake_smi(tmp_path: Path, output: str, fail_on: str = "") -> str:
    """An ``nvidia-smi`` that prints ``output`` (and fails when its arguments contain
    ``fail_on``, as a driver without the ``compute_cap`` field does)."""
    path = tmp_path / "nvidia-smi"
    fail = (
        f'case "$*" in *{fail_on}*) echo "Field not valid" >&2; exit 2;; esac\n' if fail_on else ""
    )
    path.write_text(f"#!/bin/sh\n{fail}cat <<'EOF'\n{output}EOF\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


SMI_OUT = (
    "0, GPU-aaaa-1111, NVIDIA H200, 9.0\n"
    "1, GPU-bbbb-2222, NVIDIA H200, 9.0\n"
    "2, GPU-cccc-3333, NVIDIA B200, 10.0\n"
)


def test_the_probe_reads_nvidia_smi_and_cuda_visible_devices(tmp_path):
    smi = fake_smi(tmp_path, SMI_OUT)
    every = probe_device({}, nvidia_smi=smi)
    assert every.gpus == 3 and every.compute_capability == (9, 0)
    assert every.source == "nvidia-smi" and every.cuda == hardware.torch_cuda_version()
    blackwell = probe_device({"CUDA_VISIBLE_DEVICES": "2"}, nvidia_smi=smi)
    assert blackwell.names == ("NVIDIA B200",) and blackwell.compute_capability == (10, 0)
    by_uuid = probe_device({"CUDA_VISIBLE_DEVICES": "GPU-cccc,0"}, nvidia_smi=smi)
    assert by_uuid.capabilities == ((10, 0), (9, 0))
    assert probe_device({"CUDA_VISIBLE_DEVICES": ""}, nvidia_smi=smi).gpus == 0
    assert probe_device({"CUDA_VISIBLE_DEVICES": "1,-1,2"}, nvidia_smi=smi).gpus == 1


def test_a_driver_without_compute_cap_fails_closed(tmp_path):
    smi = fake_smi(tmp_path, "0, GPU-aaaa, NVIDIA H100 80GB HBM3\n", fail_on="compute_cap")
    dev = probe_device({}, nvidia_smi=smi)
    assert dev.gpus == 1 and dev.compute_capability is None
    assert "does not report compute_cap" in dev.describe()
    assert supported_precisions(dev) == ["fp32", "bf16", "fp16"]


def test_the_cuda_version_is_read_from_torch_without_importing_it():
    import torch

    expected = (
        tuple(int(x) for x in torch.version.cuda.split(".")[:2]) if torch.version.cuda else None
    )
    assert hardware.torch_cuda_version() == expected


# --------------------------------------------------------------------------- recipe rules


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["training.num_layers_at_start_in_bf16=1"], "training.precision=fp32 has none"),
        (
            ["training.precision=fp8_delayed", "training.num_layers_at_end_in_bf16=1"],
            "delayed scaling cannot keep first/last layers in BF16",
        ),
        (
            ["training.precision=mxfp8", "training.num_layers_at_start_in_bf16=2",
             "training.num_layers_at_end_in_bf16=2"],
            "leave no FP8/FP4 layer of model.num_layers=4",
        ),
        (
            ["training.precision=fp8_tensorwise", "training.num_layers_at_start_in_bf16=3",
             "parallel.pipeline_model_parallel_size=2"],
            "at most the 2 layer(s) of one pipeline stage",
        ),
        (
            ["training.precision=nvfp4", "model.transformer_impl=local"],
            "model.transformer_impl=local would train in BF16",
        ),
        (
            ["training.precision=bf16", "training.fp8_format=hybrid"],
            "training.fp8_format=hybrid sets the format of an FP8 precision",
        ),
        (
            ["training.precision=bf16", "training.params_dtype=float32"],
            "training.params_dtype=float32 sets the parameters' dtype of an FP8/FP4 precision",
        ),
        (  # Megatron-LM ignores the loss scale without --fp16: a recipe must not promise one
            ["training.precision=bf16", "optimizer.hysteresis=4"],
            "optimizer.hysteresis=4 is fp16's loss scale, read only with training.precision=fp16",
        ),
        (
            ["training.precision=fp16", "optimizer.initial_loss_scale=1",
             "optimizer.min_loss_scale=2"],
            "optimizer.min_loss_scale=2 exceeds optimizer.initial_loss_scale=1",
        ),
        (
            ["trainer=dipaco", "training.precision=fp16"],
            "training.precision=fp16 needs loss scaling, which trainer=gpt does",
        ),
    ],
)  # fmt: skip
def test_recipe_rules_that_need_no_hardware(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_recipe("tiny_cpu_gpt", overrides)


def test_fp8_counts_and_impl_accepted():
    recipe = load_recipe(
        "tiny_cpu_gpt",
        ["training.precision=fp8_tensorwise", "training.num_layers_at_start_in_bf16=1"],
    )
    assert recipe.training.num_layers_at_start_in_bf16 == 1


def test_fp8_over_fp32_parameters_has_megatron_lms_fields():
    """training.params_dtype=float32 is Megatron-LM's FP8 without --bf16: the model's dtypes
    are float32, no Float16Module (bf16 off), the FP8 fields stay; the planner counts 4-byte
    parameters."""
    import torch

    from megatron_ext.run.precision import half_parameters, transformer_config_fields

    fields = transformer_config_fields("fp8_tensorwise", params_dtype="float32")
    assert (fields["bf16"], fields["fp16"], fields["params_dtype"]) == (False, False, torch.float32)
    assert (fields["fp8"], fields["fp8_recipe"]) == ("hybrid", "tensorwise")
    recipe = load_recipe(
        "tiny_cpu_gpt", ["training.precision=fp8_tensorwise", "training.params_dtype=float32"]
    )
    assert not half_parameters(recipe.training)
    assert half_parameters(
        load_recipe("tiny_cpu_gpt", ["training.precision=fp8_tensorwise"]).training
    )


def test_the_model_builder_refuses_fp8_on_the_local_spec():
    """Even past the gate, FP8 never trains in BF16: the builder needs TE's layers."""
    from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
    from megatron_ext.megatron.model import build_gpt_model

    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4)
    with pytest.raises(ConfigError, match="silently train in BF16"):
        build_gpt_model(model, ParallelConfig(), "fp8_delayed", vocab_size=256, seq_length=32)


# --------------------------------------------------------------------------- the gates


def test_the_launcher_gate_uses_the_table(tmp_path):
    recipe = write_recipe(tmp_path, training={"precision": "fp8_tensorwise"})
    h200 = DeviceDescription(
        names=("NVIDIA H200",), capabilities=((9, 0),), cuda=(12, 8),
        transformer_engine="2.5.0", source="faked",
    )  # fmt: skip
    h200_host = HostInfo(gpus=0, cpus=8, device=h200)  # the launcher's one probe, faked
    argv, _ = build(recipe, host=h200_host)  # accepted: the command is built
    assert "torch.distributed.run" in argv
    with pytest.raises(ConfigError, match=r"compute capability 10\.x-11\.x"):
        build(recipe, host=h200_host, overrides=("training.precision=mxfp8",))
    build(recipe, overrides=("training.precision=bf16",))  # fp32/bf16 need no GPU


@ON_CPU_HOST
def test_launch_refuses_before_any_process_starts(tmp_path):
    """The real command: exit 2 and one line, for a dry run too; no torchrun started."""
    recipe = write_recipe(tmp_path, training={"precision": "mxfp8"})
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.launch.cli", "launch", recipe, "--dry-run"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("megatron-ext: error: training.precision=mxfp8 needs ")
    assert "this machine has no GPU" in line


@ON_CPU_HOST
def test_the_per_rank_entry_checks_again_with_torch(tmp_path):
    """``megatron-ext train`` started without the launcher (srun/mpirun): refused on the rank."""
    recipe = write_recipe(tmp_path, training={"precision": "fp8_delayed"})
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.launch.cli", "train", recipe],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("megatron-ext: error:")]
    assert len(errors) == 1 and "training.precision=fp8_delayed needs" in errors[0]
    assert "[torch, local rank 0" in errors[0]


@pytest.mark.parametrize("field", ["fp8_param", "fp4_param"])
def test_quantized_parameters_are_refused_when_the_model_is_built(field):
    """Megatron-LM's --fp8-param-gather / --fp4-param-gather are carried by the converter in
    model.transformer_config; the GPT trainer does not build TE's quantized parameters, so the
    config is refused with the reason rather than handed to an optimizer never run on them."""
    from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
    from megatron_ext.megatron.model import transformer_config

    model = ModelConfig(transformer_config={field: True})
    with pytest.raises(ConfigError, match=r"parameters .* are not built"):
        transformer_config(model, ParallelConfig(), "bf16")
