"""Two no-grad kernels of the SOMA forward in C (``native_lstm.c``), for CPU float32.

* :func:`lstm_block` -- an LSTM block (norm, input projection, recurrence, residual, norm, MLP,
  residual; for the last block also the body's final norm) over one time chunk. The eager torch
  path runs seven kernels per time step over all ``P`` bodies, each a pass over memory and a
  thread barrier; the C kernel gives each thread whole bodies, runs the products of ~64 rows at
  a time as register-tiled matrix products with the body's matrices in cache, and only the
  recurrent product ``h @ whh`` step by step.
* :func:`head_nll` -- the head's cross-entropy, the (rows, V) logits never stored.

Same arithmetic as the torch path; results equal it to float rounding (tested). Threads are
OpenMP's -- the process's pool, which is torch's own libgomp: a second set of threads would
compete with torch's spinning workers (measured: no gain from the second core that way).

The source is compiled on first use with the host's C compiler (``$CC``, else ``cc``) for this
CPU (``-march=native``) into ``$MEGATRON_EXT_CACHE/kernels`` (default
``~/.cache/megatron-ext/kernels``; the temporary folder when that is not writable), keyed by the
source, compiler, flags (``$MEGATRON_EXT_CFLAGS`` adds some) and CPU model, written
atomically, and loaded through ``ctypes``; building a new one removes the folder's kernels not
loaded for :data:`STALE_DAYS` days. Where there is no compiler, or the compile fails,
:func:`native_available` says why and callers run the torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

__all__ = ["head_nll", "lstm_block", "native_available", "pack_block", "padded_width"]

SOURCE = Path(__file__).with_name("native_lstm.c")
FLAGS = ("-O3", "-march=native", "-funroll-loops", "-fPIC", "-shared", "-fopenmp", "-std=gnu11")
FLAGS += tuple(os.environ.get("MEGATRON_EXT_CFLAGS", "").split())  # e.g. -DSOMA_VW=8
CACHE_VAR = "MEGATRON_EXT_CACHE"
# Kernels of other sources, compilers or flags not loaded for this long are removed when a new
# one is built (each source change of an upgrade builds one).
STALE_DAYS = 30


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "megatron-ext"
    return Path(root) / "kernels"


def _cpu_model() -> str:
    """The CPU's model name and feature flags: a kernel built with ``-march=native`` on one
    host must not be loaded on another that lacks its instructions (a shared home folder on a
    cluster of mixed nodes)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    seen = {}
    for line in lines:
        key = line.split(":", 1)[0].strip()
        if key in ("model name", "flags") and key not in seen:
            seen[key] = line
    return "\n".join(seen.values()) or platform.processor() or platform.machine()


def _compiler() -> tuple[str | None, str]:
    """(path, version line) of the C compiler, or (None, why not)."""
    cc = os.environ.get("CC") or "cc"
    path = shutil.which(cc)
    if path is None:
        return None, f"no C compiler found ({cc!r} is not on PATH; set CC)"
    try:
        version = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout.splitlines()[:1]
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"the C compiler {path} does not run ({type(exc).__name__})"
    return path, version[0] if version else path


@functools.cache
def _library() -> tuple[ctypes.CDLL | None, str]:
    """The compiled kernel (built once per host and source), or (None, why not)."""
    if platform.system() != "Linux":
        return None, f"the C kernel is built for Linux only (this is {platform.system()})"
    cc, version = _compiler()
    if cc is None:
        return None, version
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        b"\0".join([source, version.encode(), " ".join(FLAGS).encode(), _cpu_model().encode()])
    ).hexdigest()[:20]
    try:
        target = _build(cc, _cache_dir() / f"soma_lstm_{key}.so")
    except OSError:  # the cache folder is not writable: build in the temporary folder
        try:
            fallback = Path(tempfile.gettempdir()) / f"megatron-ext-kernels-{os.getuid()}"
            target = _build(cc, fallback / f"soma_lstm_{key}.so")
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"building {SOURCE.name} failed: {type(exc).__name__}: {exc}"
    except subprocess.SubprocessError as exc:
        return None, f"building {SOURCE.name} failed: {type(exc).__name__}: {exc}"
    if isinstance(target, str):
        return None, target
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as exc:
        return None, f"loading {target} failed: {exc}"
    ptr, i64, i32, f32 = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
    block_args = [ptr, i64, *[ptr] * 4, i64, *[ptr] * 3]  # x .. out (pointers, body strides)
    block_args += [*[i32] * 5, f32, i32, ptr, i64, i32]  # p, tc, b, d, dn, eps, final_norm ..
    signatures = {  # name: (return type, argument types), as in native_lstm.c
        "soma_lstm_block": (i32, block_args),
        "soma_head_nll": (i32, [ptr, i64, ptr, i64, ptr, i64, ptr, *[i32] * 5]),
        "soma_pointwise": (None, [ptr, i64, i32]),
        "soma_vector_width": (i32, []),
        "soma_fma_peak": (f32, [i64, i32, ptr]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib, ""


def _prune(folder: Path, keep: Path) -> None:
    """Remove kernels in ``folder`` other than ``keep`` not loaded for :data:`STALE_DAYS` (a
    load refreshes a kernel's time, so one in use on any host sharing the folder stays). Best
    effort: a kernel another process removes first, or one it cannot remove, is left."""
    cutoff = time.time() - STALE_DAYS * 86400
    for old in folder.glob("soma_lstm_*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass


def _build(cc: str, target: Path) -> Path | str:
    """Compile :data:`SOURCE` into ``target`` unless it is there (written atomically: a
    concurrent builder writes the same bytes), then prune the folder's stale kernels; the
    compiler's first error line on failure."""
    if target.is_file():
        with contextlib.suppress(OSError):
            os.utime(target)  # in use: not stale
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        proc = subprocess.run(
            [cc, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines() or ["(no message)"]
            first = next((x for x in lines if "error" in x), lines[0])
            return f"compiling {SOURCE.name} with {cc} failed: {first}"
        os.replace(built, target)
    _prune(target.parent, target)
    return target


def native_available() -> tuple[bool, str]:
    """(True, "") when the C kernel is built and loaded on this host, else (False, why)."""
    lib, why = _library()
    return lib is not None, why


def _check(tensors: tuple[torch.Tensor, ...]) -> ctypes.CDLL:
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"SOMA's C kernel is unavailable: {why}")
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise ValueError("the C kernel takes float32 CPU tensors")
    return lib


def padded_width(d: int) -> int:
    """``d`` rounded up to whole vectors of the built kernel (16 floats with AVX-512, else 8):
    the width the forward runs the kernel at, the model's matrices zero-padded (a column tail
    would run scalar, several times slower than the padding costs)."""
    lib = _check(())
    vw = lib.soma_vector_width()
    return -(-d // vw) * vw


def pack_block(
    w_ih_t: torch.Tensor, whh_t: torch.Tensor, fc1_t: torch.Tensor, fc2_t: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's matrices (:func:`~.forward.block_weights`' layouts, (P, d, 4d) x3 and
    (P, 4d, d)) as :func:`lstm_block` takes them at ``width`` >= d: (wcat (P, 2w, 4w) =
    ``[w_ih_t; whh_t]``, fc1_t (P, w, 4w), fc2_t (P, 4w, w)), contiguous, zero in the padding --
    the input rows past d, each gate's columns past d, the MLP's hidden columns past 4d."""
    p, d = w_ih_t.shape[:2]
    pad = width - d

    def gates(w: torch.Tensor) -> torch.Tensor:  # (P, d, 4d) -> (P, w, 4w), per-gate padding
        return F.pad(w.reshape(p, d, 4, d), (0, pad, 0, 0, 0, pad)).reshape(p, width, 4 * width)

    wcat = torch.cat([gates(w_ih_t), gates(whh_t)], dim=1)
    fc1 = F.pad(fc1_t, (0, 4 * pad, 0, pad)).contiguous()
    fc2 = F.pad(fc2_t, (0, pad, 0, 4 * pad)).contiguous()
    return wcat, fc1, fc2


def _per_body_rows(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` (1 or P, rows, width) with each body's rows contiguous (copied if they are not),
    and its body stride (0 for one body shared by all)."""
    if t.stride()[1:] != (t.shape[2], 1):
        t = t.contiguous()
    return t, 0 if t.shape[0] == 1 else t.stride(0)


def lstm_block(
    x: torch.Tensor,
    wcat: torch.Tensor,
    fc1_t: torch.Tensor,
    fc2_t: torch.Tensor,
    h: torch.Tensor,
    n: torch.Tensor,
    eps: float,
    *,
    final_norm: bool = False,
    gain: torch.Tensor | None = None,
    norm_width: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM block of the body over a time chunk on the C kernel: x (1 or P, tc·B, d)
    time-major rows (one x shared by all bodies, or one per body), wcat (P, 2d, 4d) =
    ``[w_ih_t; whh_t]``, fc1_t (P, d, 4d), fc2_t (P, 4d, d) (:func:`~.forward.block_weights`'s
    layouts, norm gains folded in), state h, n (P, B, d) -> (the block's output
    ``x1 + gelu(norm(x1) @ fc1_t) @ fc2_t`` with ``x1 = x + LSTM(norm(x))``, (P, tc·B, d); h after
    the chunk, (P, B, d)); ``n`` is updated in place. With ``final_norm`` the output is
    ``layer_norm(out)`` times ``gain`` (P, 1, d) where given: the body's final norm fused into
    its last block. ``norm_width``: the model's width when d is padded (:func:`pack_block`;
    x, h, n and gain zero in the padding): norms over the first ``norm_width`` columns."""
    lib = _check((x, wcat, fc1_t, fc2_t, h, n, *([] if gain is None else [gain])))
    p, b, d = h.shape
    rows = x.shape[1]
    shapes_ok = (
        wcat.shape == (p, 2 * d, 4 * d)
        and fc1_t.shape == (p, d, 4 * d)
        and fc2_t.shape == (p, 4 * d, d)
        and x.shape[2] == d
        and rows % b == 0
        and x.shape[0] in (1, p)
        and (gain is None or (final_norm and gain.shape == (p, 1, d)))
        and (norm_width is None or 1 <= norm_width <= d)
    )
    if not shapes_ok:
        raise ValueError(
            f"shapes x {tuple(x.shape)}, wcat {tuple(wcat.shape)}, fc1_t {tuple(fc1_t.shape)}, "
            f"fc2_t {tuple(fc2_t.shape)}, h {tuple(h.shape)}"
            + ("" if gain is None else f", gain {tuple(gain.shape)} (final_norm={final_norm})")
            + ("" if norm_width is None else f", norm_width {norm_width}")
        )
    if gain is not None and gain.stride(-1) != 1:
        gain = gain.contiguous()
    if h.stride()[1:] != (d, 1):
        h = h.contiguous()
    wcat, fc1_t, fc2_t = wcat.contiguous(), fc1_t.contiguous(), fc2_t.contiguous()
    if not n.is_contiguous():
        raise ValueError("the carried n must be contiguous (it is updated in place)")
    x, x_stride = _per_body_rows(x)
    out, h_last = x.new_empty(p, rows, d), h.new_empty(p, b, d)
    status = lib.soma_lstm_block(
        x.data_ptr(),
        x_stride,
        wcat.data_ptr(),
        fc1_t.data_ptr(),
        fc2_t.data_ptr(),
        h.data_ptr(),
        h.stride(0),
        n.data_ptr(),
        h_last.data_ptr(),
        out.data_ptr(),
        p,
        rows // b,
        b,
        d,
        d if norm_width is None else norm_width,
        eps,
        int(final_norm),
        None if gain is None else gain.data_ptr(),
        0 if gain is None else gain.stride(0),
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("SOMA's C kernel could not allocate its scratch buffers")
    return out, h_last


def head_nll(hid: torch.Tensor, weight_t: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the tied or per-body head on the C kernel, logits never stored:
    hid (P, R, E) (rows of a body contiguous), weight_t (1 or P, E, V) the decoder transposed,
    targets (1 or P, R) integer ids in 0..V-1 -> (P, R) negative log-likelihoods (nats)."""
    lib = _check((hid, weight_t))
    p, rows, e = hid.shape
    v = weight_t.shape[2]
    weight_t = weight_t.contiguous()
    targets = targets.to(torch.int64).contiguous()
    if weight_t.shape[1] != e or weight_t.shape[0] not in (1, p) or targets.shape[-1] != rows:
        raise ValueError(
            f"shapes hid {tuple(hid.shape)}, weight_t {tuple(weight_t.shape)}, "
            f"targets {tuple(targets.shape)}"
        )
    hid, hid_stride = _per_body_rows(hid)
    out = hid.new_empty(p, rows)
    status = lib.soma_head_nll(
        hid.data_ptr(),
        hid_stride,
        weight_t.data_ptr(),
        0 if weight_t.shape[0] == 1 else weight_t.stride(0),
        targets.data_ptr(),
        0 if targets.shape[0] == 1 else targets.stride(0),
        out.data_ptr(),
        p,
        rows,
        e,
        v,
        torch.get_num_threads(),
    )
    if status & 2:
        raise ValueError(f"targets outside 0..{v - 1}")
    if status:
        raise MemoryError("SOMA's C kernel could not allocate its scratch buffers")
    return out


def pointwise(kind: str, x: torch.Tensor) -> torch.Tensor:
    """The kernels' own ``"gelu"`` or ``"sigmoid"`` of a float32 CPU tensor (a new tensor): the
    approximations the block computes with, for their tests."""
    lib = _check((x,))
    out = x.contiguous().clone()
    lib.soma_pointwise(out.data_ptr(), out.numel(), {"gelu": 0, "sigmoid": 1}[kind])
    return out


def fma_peak(iters: int, threads: int) -> tuple[float, float]:
    """Run the kernels' FMA-peak loop (``soma_fma_peak`` in the C source: 12 independent vector
    accumulators per thread, ``iters`` steps ``c <- 0.999 c + 0.001`` each, no memory traffic)
    on ``threads`` threads: (thread 0's checksum -- the sum of its accumulators' lanes --, the
    flops done)."""
    flops = ctypes.c_double()
    checksum = _check(()).soma_fma_peak(iters, threads, ctypes.byref(flops))
    return float(checksum), flops.value


def _timed_fma(iters: int, threads: int) -> tuple[float, float]:
    """(seconds, flops) of one :func:`fma_peak` call."""
    start = time.perf_counter()
    _, flops = fma_peak(iters, threads)
    return time.perf_counter() - start, flops


@functools.cache
def _fma_iters(threads: int) -> int:
    """Steps per :func:`fma_peak` call for at least 0.05 s on ``threads`` threads (found once
    per process)."""
    iters = 1 << 16
    while _timed_fma(iters, threads)[0] <= 0.05:
        iters *= 2
    return iters


def fma_peak_gflops(threads: int, repeats: int = 5) -> float:
    """The fp32 FMA rate of this build's vectors on ``threads`` threads, GFLOP/s, best of
    ``repeats`` calls of at least 0.05 s: the arithmetic peak any kernel here could reach
    (:func:`fma_peak`)."""
    iters = _fma_iters(threads)
    seconds, flops = min(_timed_fma(iters, threads) for _ in range(repeats))
    return flops / seconds / 1e9
