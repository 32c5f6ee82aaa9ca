"""The LSTM recurrence of the SOMA body over one time chunk, for ``P`` bodies at once, and the
``torch.compile`` switch of the fused forward.

Two ways to run the same arithmetic (gates in the order i, f, o, g with the g columns
pre-scaled by 2, and ``n = −2c`` carried instead of the cell state ``c``):

* :func:`lstm_scan_inplace` -- eager, no autograd, seven kernels per step writing into
  preallocated buffers: the reference;
* :func:`lstm_scan_cells` -- out of place, one :func:`lstm_cell` expression per step: the
  differentiable path, and what ``torch.compile`` (Inductor) turns into one batched matmul plus
  ONE element-wise loop per step inside the fused forward (:class:`Compiled`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, Literal

import torch

# How a no-grad forward runs its recurrence. "off": the eager torch scan (the reference);
# "on": each chunk one torch.compile graph (warns and runs eager where it cannot compile);
# "native": the C kernel of :mod:`.native` (CPU float32; warns and runs eager elsewhere);
# "auto": compiled where that was measured to pay (AUTO_FUSED), else native on CPU float32
# where the kernel builds (AUTO_NATIVE), else eager -- silently.
FusedMode = Literal["auto", "on", "off", "native"]
FUSED_MODES: tuple[FusedMode, ...] = ("auto", "on", "off", "native")

# Where "auto" fuses. CPU: no. ``megatron-ext bench soma`` on this project's 2-core host, SPSA
# forward (d=32, D=2, 128 bodies, B=16, T=256): compiled/eager 1.06x at 2 threads on a quiet
# host, 1.20x at 1 thread, up to 1.6x at 2 threads while other jobs load the cores (fewer kernels,
# fewer thread barriers to wait at) -- against a compile of 10-60 s per new shape (cached on disk
# afterwards). Inductor's CPU sigmoid and erf call Sleef's 1-ulp exp out of line, slower per
# element than ATen's own kernels, which cancels much of what fusing saves in memory passes.
# CUDA: not measured (no GPU in these sessions).
AUTO_FUSED: dict[str, bool] = {"cpu": False, "cuda": False}
# Where "auto" runs the C kernels. CPU float32, any width: yes -- ``megatron-ext bench soma`` on
# this project's 2-core host: 3.0-3.1x the torch.nn loop where eager is 1.2-1.4x; batched_loss
# native/eager 1.2-3.4x over widths 4-128 (padded to whole vectors); figures in docs/soma.md.
AUTO_NATIVE = True
# Compiled shapes kept per process: one per (bodies, batch, chunk length), a few per run.
RECOMPILE_LIMIT = 64


def lstm_scan_inplace(
    xw: torch.Tensor, whh_t: torch.Tensor, h: torch.Tensor, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """No-grad recurrence over one time chunk, with sigmoids only.

    xw (P, tc, B, 4d) input projections and whh_t (P, d, 4d); carried state h (P, B, d) and
    ``n = −2c`` (P, B, d) -> (out (P, tc, B, d), h, n). ``n`` is updated in place, ``h`` is a
    view of ``out``'s last step.

    On CPU tanh costs several sigmoids, so both tanh are rewritten exactly:
    ``tanh(x) = 2σ(2x) − 1`` makes ``g = 2·σ(gate) − 1`` (one sigmoid over all four gates), and
    ``tanh(c) = 1 − 2σ(−2c) = 1 − 2σ(n)`` makes ``h = o − 2·o·σ(n)`` one addcmul, with
    ``n ← f·n − 4·i·σ_g + 2·i`` (that is ``c ← f·c + i·g``). Seven kernels per step, all
    writing into preallocated buffers."""
    p, tc, b, four_d = xw.shape
    d = four_d // 4
    out = xw.new_empty(p, tc, b, d)
    gates = xw.new_empty(p, b, four_d)
    tmp = xw.new_empty(p, b, d)
    i_g, f_g, o_g, s_g = (gates[..., k * d : (k + 1) * d] for k in range(4))
    for s in range(tc):
        torch.baddbmm(xw[:, s], h, whh_t, out=gates)
        gates.sigmoid_()
        n.mul_(f_g).addcmul_(i_g, s_g, value=-4.0).add_(i_g, alpha=2.0)
        torch.sigmoid(n, out=tmp)
        h = torch.addcmul(o_g, o_g, tmp, value=-2.0, out=out[:, s])
    return out, h, n


def lstm_cell(
    xw_s: torch.Tensor, rec: torch.Tensor, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's gate arithmetic, :func:`lstm_scan_inplace`'s formulas as one expression:
    input projection xw_s (P, B, 4d) plus recurrent product rec (P, B, 4d), carried ``n = −2c``
    (P, B, d) -> (h, n_new), both (P, B, d).

    Each gate's sigmoid is taken on its own d-wide slice, so that compiled, the step is ONE loop
    over (P·B, d) that reads the four gates and writes h and n (no 4d-wide intermediate)."""
    d = n.shape[-1]
    z = [xw_s[..., k * d : (k + 1) * d] + rec[..., k * d : (k + 1) * d] for k in range(4)]
    i_g, f_g, o_g, s_g = (torch.sigmoid(g) for g in z)
    n_new = f_g * n - 4.0 * i_g * s_g + 2.0 * i_g
    return o_g - 2.0 * o_g * torch.sigmoid(n_new), n_new


def lstm_scan_cells(
    xw: torch.Tensor, whh_t: torch.Tensor, h: torch.Tensor, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`lstm_scan_inplace`'s arguments and results, out of place (differentiable): per
    step one ``bmm`` (P, B, d) @ (P, d, 4d) and one :func:`lstm_cell`.

    The chunk's input projections are first laid out time-major, so that each step reads one
    contiguous (P, B, 4d) block: Inductor's CPU loop over a body-strided slice ran several
    times slower than over a contiguous one."""
    xw_tm = xw.transpose(0, 1).contiguous()  # (tc, P, B, 4d)
    hs = []
    for s in range(xw_tm.shape[0]):
        h, n = lstm_cell(xw_tm[s], torch.bmm(h, whh_t), n)
        hs.append(h)
    return torch.stack(hs, dim=1), h, n


def _compile_blocker(device: torch.device) -> str:
    """Why Inductor cannot compile for ``device`` here ("" when nothing is known to block it):
    it needs a C++ compiler for CPU code and Triton for GPU code."""
    if device.type == "cpu":
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception as exc:  # InvalidCxxCompiler, or any failure to run the compiler
            return f"no working C++ compiler for torch.compile ({type(exc).__name__})"
        return ""
    from torch.utils._triton import has_triton

    return "" if has_triton() else f"torch.compile needs Triton for {device.type}, not installed"


@functools.cache
def _warn_unavailable(why: str) -> None:
    warnings.warn(
        f"SOMA's fused forward is unavailable ({why}); running the eager forward instead "
        "(same losses, slower). Pass fused='off' to choose eager explicitly.",
        RuntimeWarning,
        stacklevel=4,
    )


# Every compile that failed in this process, oldest first (fused_available reports the last).
COMPILE_FAILURES: list[str] = []


class Compiled:
    """``fn`` compiled by ``torch.compile`` on first use (one compile per input shape: seconds
    to a minute on a small CPU; Inductor's on-disk cache makes repeats faster), falling back
    to ``fn`` itself -- the same arithmetic, eagerly -- with one warning if compiling fails,
    so a forward never stops half way."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._eager = fn
        self._fn: Callable[..., Any] | None = None  # torch.compile imports dynamo: lazily
        self._failed = False

    def __call__(self, *args: Any) -> Any:
        if not self._failed:
            try:
                if self._fn is None:
                    self._fn = torch.compile(self._eager, dynamic=False)
                with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                    return self._fn(*args)
            except Exception as exc:  # a compiler error at run time: warn once, run eager
                self._failed = True
                first = str(exc).strip().splitlines()[:1]
                COMPILE_FAILURES.append(f"{type(exc).__name__}: {first[0] if first else ''}")
                _warn_unavailable(COMPILE_FAILURES[-1])
        return self._eager(*args)


def fused_available(device: torch.device | str = "cpu") -> tuple[bool, str]:
    """(True, "") when the fused forward can compile for ``device`` on this host, else (False,
    why): no C++ compiler (CPU) or no Triton (GPU) found, or a compile that already failed."""
    why = COMPILE_FAILURES[-1] if COMPILE_FAILURES else _compile_blocker(torch.device(device))
    return (not why, why)


def _check_mode(mode: str) -> None:
    if mode not in FUSED_MODES:
        raise ValueError(f"fused must be one of {FUSED_MODES}, got {mode!r}")


def use_fused(mode: FusedMode, device: torch.device) -> bool:
    """Whether a no-grad forward on ``device`` runs compiled under ``mode``. "on" warns (once
    per reason) where fusion is unavailable; "auto" follows :data:`AUTO_FUSED`, silently."""
    _check_mode(mode)
    if mode in ("off", "native") or (mode == "auto" and not AUTO_FUSED.get(device.type, False)):
        return False
    ok, why = fused_available(device)
    if not ok and mode == "on":
        _warn_unavailable(why)
    return ok


def use_native(mode: FusedMode, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a no-grad forward runs the C recurrence (:mod:`.native`) under ``mode`` (when
    it does not run compiled, :func:`use_fused`): "native" asks for it (and warns, once per
    reason, where it cannot run: not CPU float32, or no kernel built), "auto" takes it on CPU
    float32 where it is built (:data:`AUTO_NATIVE`), silently."""
    _check_mode(mode)
    if mode not in ("native", "auto") or (mode == "auto" and not AUTO_NATIVE):
        return False
    if device.type != "cpu" or dtype != torch.float32:
        why = f"the C kernel runs float32 on CPU, not {str(dtype).removeprefix('torch.')} on "
        if mode == "native":
            _warn_unavailable(why + device.type)
        return False
    from megatron_ext.soma.native import native_available

    ok, why = native_available()
    if not ok and mode == "native":
        _warn_unavailable(why)
    return ok
