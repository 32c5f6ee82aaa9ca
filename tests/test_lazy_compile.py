"""``run.lazy_compile``: on a CPU host megatron-core's import no longer imports torch's compiler,
and a deferred ``torch.compile`` still compiles, with its options, on the first call."""

from __future__ import annotations

import os
import subprocess
import sys

CHECK = """
import sys, torch
from megatron_ext.run.lazy_compile import defer_compile_on_cpu
assert defer_compile_on_cpu() and defer_compile_on_cpu()  # CPU host; idempotent
import megatron.core, megatron.core.models.gpt  # decorates its fusions with torch.compile
assert "torch._inductor" not in sys.modules, "megatron-core's import compiled something"

calls = []
def backend(gm, example_inputs):  # a backend that records it ran, then runs the graph
    calls.append(len(example_inputs))
    return gm.forward

@torch.compile(backend=backend, dynamic=False)
def scaled(x):
    return x * 2 + 1

assert scaled.__name__ == "scaled" and calls == []  # nothing compiled before the first call
assert scaled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0]
assert calls == [1]  # compiled once, by torch.compile with the options given
assert scaled(torch.ones(3)).tolist() == [3.0, 3.0, 3.0] and calls == [1]
module = torch.compile(torch.nn.Linear(2, 2), backend=backend)
assert isinstance(module, torch.nn.Module)  # modules compile as torch compiles them
print("ok")
"""


def test_deferred_compile_imports_nothing_until_the_first_call_then_compiles() -> None:
    done = subprocess.run(
        [sys.executable, "-c", CHECK],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},  # a CPU host, whatever this one is
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]
