"""Measurements shared by the benchmarks."""

from __future__ import annotations

import time


def matmul_gflops(size: int = 1024, repeats: int = 12) -> float:
    """Best-of-``repeats`` fp32 GFLOP/s of a ``size``³ matmul at the current torch thread count:
    the machine's attainable rate, the anchor for every achieved-GFLOP/s figure."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e9
