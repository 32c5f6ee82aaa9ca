"""The GPUs a plan can be made for: memory, dense BF16 peak and link bandwidths.

Figures are the vendors' datasheet values (GB = 10⁹ bytes; bandwidths per GPU and per
direction): memory and NVLink from NVIDIA's A100, H100, H200, B200 and GB200 NVL72 datasheets;
the inter-node link is one 400 Gb/s InfiniBand NDR / 200 Gb/s HDR (A100) adapter per GPU, the
DGX/HGX reference design. The dense BF16 peaks are :data:`megatron_ext.run.peaks.DENSE_BF16_TFLOPS`
(one table). A cluster that differs (fewer adapters, RoCE) passes its own ``--network-gbps``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from megatron_ext.run.peaks import dense_bf16_peak_tflops

#: memory the plan leaves for the CUDA context, NCCL's buffers and allocator fragmentation
#: (here, with the GPUs, so that the CLI's options read it without importing the planner)
DEFAULT_RESERVE_BYTES = 4 * 10**9
DEFAULT_MFU = 0.4

__all__ = ["GPUS", "GpuKind", "GpuSpec", "gpu_kind", "gpu_spec"]

GpuKind = Literal["a100", "h100", "h200", "b200", "gb200"]


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as the plan sees it."""

    kind: str
    name: str  # as nvidia-smi spells it (matched against the peak table)
    memory_bytes: int
    nvlink_gbps: float  # GB/s per direction per GPU inside the NVLink domain
    network_gbps: float  # GB/s per direction per GPU between NVLink domains
    nvlink_domain: int  # GPUs one NVLink domain connects (8 per HGX node, 72 per NVL72 rack)

    @property
    def bf16_tflops(self) -> float:
        peak = dense_bf16_peak_tflops(self.name)
        assert peak is not None, self.name
        return peak


GPUS: dict[str, GpuSpec] = {
    "a100": GpuSpec("a100", "NVIDIA A100-SXM4-80GB", 80 * 10**9, 300.0, 25.0, 8),
    "h100": GpuSpec("h100", "NVIDIA H100 80GB HBM3", 80 * 10**9, 450.0, 50.0, 8),
    "h200": GpuSpec("h200", "NVIDIA H200", 141 * 10**9, 450.0, 50.0, 8),
    "b200": GpuSpec("b200", "NVIDIA B200", 180 * 10**9, 900.0, 50.0, 8),
    "gb200": GpuSpec("gb200", "NVIDIA GB200", 186 * 10**9, 900.0, 50.0, 72),
}


def gpu_spec(
    kind: str, *, nvlink_gbps: float | None = None, network_gbps: float | None = None
) -> GpuSpec:
    """The catalog's ``kind``, with the link bandwidths a user measured, if given."""
    if kind not in GPUS:
        raise ValueError(f"--gpu {kind!r}: choose one of {', '.join(GPUS)}")
    spec = GPUS[kind]
    if nvlink_gbps is not None:
        spec = replace(spec, nvlink_gbps=nvlink_gbps)
    if network_gbps is not None:
        spec = replace(spec, network_gbps=network_gbps)
    return spec


def gpu_kind(name: str) -> str | None:
    """The catalog kind of a GPU as nvidia-smi names it (``NVIDIA H100 80GB HBM3`` -> h100),
    None for a GPU the catalog does not hold."""
    upper = name.upper()
    for kind in ("gb200", "b200", "h200", "h100", "a100"):  # GB200 before B200
        if kind.upper() in upper:
            return kind
    return None
