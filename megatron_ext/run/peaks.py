"""Peak figures of a device: a GPU's dense BF16 TFLOP/s (the MFU denominator) and this
process's peak memory. torch is imported only by :func:`memory_peaks`."""

from __future__ import annotations

from typing import Any

__all__ = ["DENSE_BF16_TFLOPS", "dense_bf16_peak_tflops", "memory_peaks"]

#: Dense (no sparsity) BF16 tensor-core peaks, TFLOP/s per GPU, from NVIDIA's datasheets (their
#: "with sparsity" figures halved). Matched in order against the GPU's name.
DENSE_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("GH200", 989.5),
    ("H200 NVL", 835.5),
    ("H200", 989.5),
    ("H100 NVL", 835.5),
    ("H100 PCIe", 756.5),
    ("H100", 989.5),
    ("A100", 312.0),
    ("L40S", 362.0),
)


def dense_bf16_peak_tflops(name: str) -> float | None:
    """The dense BF16 peak of the GPU called ``name`` (nvidia-smi or torch spelling), or
    None for a GPU not in :data:`DENSE_BF16_TFLOPS`."""
    for key, tflops in DENSE_BF16_TFLOPS:
        if key in name:
            return tflops
    return None


def memory_peaks(device: Any) -> dict[str, Any]:
    """This process's peak memory so far: on CUDA the caching allocator's peak allocated and
    reserved bytes on ``device``; on CPU there is no allocator to ask, so only the process's
    peak resident set (``ru_maxrss``: weights, activations, the Python runtime and every
    library) is given, and ``basis`` says which it is."""
    import resource
    import sys

    import torch

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss_bytes = rss if sys.platform == "darwin" else rss * 1024
    if torch.device(device).type == "cuda":
        return {
            "basis": "CUDA caching allocator (torch.cuda.max_memory_allocated/reserved)",
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
            "peak_rss_bytes": rss_bytes,
        }
    return {
        "basis": "CPU: process peak resident set (ru_maxrss); no allocated/reserved split",
        "peak_allocated_bytes": None,
        "peak_reserved_bytes": None,
        "peak_rss_bytes": rss_bytes,
    }
