"""Measurements shared by the benchmarks."""

from __future__ import annotations

import time
from typing import Any


def matmul_gflops(size: int = 1024, repeats: int = 12, device: str = "cpu") -> float:
    """Best-of-``repeats`` fp32 GFLOP/s of a ``size``³ matmul at the current torch thread count
    (or on ``device``): the machine's attainable rate, the anchor for every achieved-GFLOP/s
    figure."""
    import torch

    a, b = torch.randn(size, size, device=device), torch.randn(size, size, device=device)
    sync = torch.cuda.synchronize if a.is_cuda else lambda: None
    a @ b  # warm-up (CUDA: kernel selection)
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the tensors in ``optimizer.state`` (momenta, factors, ...), in any dtype."""
    import torch

    return sum(
        v.numel() * v.element_size()
        for st in optimizer.state.values()
        for v in st.values()
        if torch.is_tensor(v)
    )


def write_json(report: dict[str, Any], path: str | None) -> None:
    """Write a benchmark's report to ``path`` when given (the one atomic JSON writer) and say
    so."""
    if path:
        from megatron_ext.atomic import write_json as write_json_atomic

        write_json_atomic(path, report)
        print(f"wrote {path}")
