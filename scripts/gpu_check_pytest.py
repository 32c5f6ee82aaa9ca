"""pytest plugin of ``scripts/gpu_check.py``: keep only the tests that need CUDA, i.e. those
carrying a ``skipif`` mark whose condition or reason names CUDA (``torch.cuda.is_available()``,
``reason="needs CUDA"``). Use: ``pytest -p scripts.gpu_check_pytest tests/...``."""

from __future__ import annotations

from typing import Any


def _needs_cuda(item: Any) -> bool:
    for mark in item.iter_markers(name="skipif"):
        text = " ".join(str(a) for a in mark.args) + " " + str(mark.kwargs.get("reason", ""))
        if "cuda" in text.lower():
            return True
    return False


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    keep = [item for item in items if _needs_cuda(item)]
    dropped = [item for item in items if not _needs_cuda(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
