"""The precision gate on a GPU host (skipped without CUDA; ``scripts/gpu_check.sh`` runs them):
the launcher's torch-free description and the rank's torch description of the same GPU agree,
so both gates accept and refuse the same precisions, and FP8/FP4 build on TE's layers."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_ext.run.hardware import (
    can_run,
    probe_device,
    probe_device_with_torch,
    torch_cuda_version,
)
from megatron_ext.run.precision import PRECISIONS

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cuda_both_descriptions_of_this_gpu_agree():
    smi, rank = probe_device(), probe_device_with_torch(0)
    assert smi.gpus == torch.cuda.device_count()
    assert smi.capabilities[0] == rank.capabilities[0] == torch.cuda.get_device_capability(0)
    assert torch_cuda_version() == rank.cuda
    assert (smi.transformer_engine is None) == (rank.transformer_engine is None), rank.notes
    assert [p for p in PRECISIONS if can_run(p, smi)] == [p for p in PRECISIONS if can_run(p, rank)]


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None, reason="needs Transformer Engine"
)
def test_cuda_quantized_precisions_use_transformer_engines_layers():
    from megatron_ext.gpt.sections import ModelConfig
    from megatron_ext.megatron.model import _require_quantized_layers, use_transformer_engine

    model = ModelConfig(transformer_impl="auto")
    assert use_transformer_engine(model)
    _require_quantized_layers(model, "fp8_tensorwise")  # does not raise
