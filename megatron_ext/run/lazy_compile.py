"""On a CPU host, ``torch.compile`` decorations wait for their function's first call.

megatron-core decorates its fused kernels with ``torch.compile`` when its modules are imported
(``megatron.core.jit.jit_fuser``); each decoration imports ``torch._dynamo`` and
``torch._inductor``, 3.4 s of the 6.7 s a CPU rank of the GPT trainer spent importing (measured
on this project's 2-core CI host: 6.6–6.9 s with, 3.2 s without). On a CPU host those fusions are
off and never called, so the decoration buys nothing there. :func:`defer_compile_on_cpu` makes
``torch.compile(fn, **options)`` return a thin function that compiles ``fn`` with the same options
on its first call (where torch itself would compile it), so nothing changes but when the compiler
is imported. On a CUDA host it returns without changing anything. The per-rank entry point
(``megatron-ext train``) calls it before the trainer's modules are imported.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["defer_compile_on_cpu"]

_APPLIED: list[Callable[..., Any]] = []  # the real torch.compile, once replaced


def defer_compile_on_cpu() -> bool:
    """Replace ``torch.compile`` by its deferred form when torch sees no CUDA device; returns
    whether it did (idempotent)."""
    import torch

    if _APPLIED:
        return True
    if torch.cuda.is_available():
        return False
    real = torch.compile
    _APPLIED.append(real)

    def compile_on_first_call(model: Any = None, **options: Any) -> Any:
        if model is None:  # used as @torch.compile(**options)
            return lambda fn: compile_on_first_call(fn, **options)
        if not callable(model) or isinstance(model, torch.nn.Module):
            return real(model, **options)  # modules compile as before (their own laziness)
        compiled: list[Callable[..., Any]] = []

        @functools.wraps(model)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not compiled:
                compiled.append(real(model, **options))
            return compiled[0](*args, **kwargs)

        return call

    torch.compile = compile_on_first_call
    return True
