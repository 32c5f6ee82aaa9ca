"""Two no-grad kernels of the SOMA forward in C (``native_lstm.c``), for CPU float32.

* :func:`lstm_block` -- an LSTM block's norm, input projection, recurrence, residual and second
  norm over one time chunk. The eager torch path runs the projection as one batched matmul into
  a (P, rows, 4d) tensor and then seven kernels per time step over all ``P`` bodies, each a pass
  over memory and a thread barrier; the C kernel gives each thread whole bodies and runs every
  step of a chunk for a pair of batch rows with their state in registers, the body's matrices
  in cache.
* :func:`head_nll` -- the head's cross-entropy, the (rows, V) logits never stored.

Same arithmetic as the torch path; results equal it to float rounding (tested). Threads are
OpenMP's -- the process's pool, which is torch's own libgomp: a second set of threads would
compete with torch's spinning workers (measured: no gain from the second core that way).

The source is compiled on first use with the host's C compiler (``$CC``, else ``cc``) for this
CPU (``-march=native``) into ``$MEGATRON_EXT_CACHE/kernels`` (default
``~/.cache/megatron-ext/kernels``; the temporary folder when that is not writable), keyed by the
source, compiler, flags (``$MEGATRON_EXT_CFLAGS`` adds some) and CPU model, written
atomically, and loaded through ``ctypes``. Where
there is no compiler, or the compile fails, :func:`native_available` says why and callers run
the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

__all__ = ["head_nll", "lstm_block", "native_available"]

SOURCE = Path(__file__).with_name("native_lstm.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=gnu11")
FLAGS += tuple(os.environ.get("MEGATRON_EXT_CFLAGS", "").split())  # e.g. -DSOMA_VW=8
CACHE_VAR = "MEGATRON_EXT_CACHE"


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
    signatures = {
        "soma_lstm_block": [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, ptr, *[i32] * 4, f32, i32],
        "soma_head_nll": [ptr, i64, ptr, i64, ptr, i64, ptr, *[i32] * 5],
    }
    for name, argtypes in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
    return lib, ""


def _build(cc: str, target: Path) -> Path | str:
    """Compile :data:`SOURCE` into ``target`` unless it is there (written atomically: a
    concurrent builder writes the same bytes); the compiler's first error line on failure."""
    if target.is_file():
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM block of the body over a time chunk on the C kernel: x (1 or P, tc·B, d)
    time-major rows (one x shared by all bodies, or one per body), wcat (P, 2d, 4d) =
    ``[w_ih_t; whh_t]``, fc1_t (P, d, 4d), fc2_t (P, 4d, d) (:func:`~.forward.block_weights`'s
    layouts, norm gains folded in), state h, n (P, B, d) -> (the block's output
    ``x1 + gelu(norm(x1) @ fc1_t) @ fc2_t`` with ``x1 = x + LSTM(norm(x))``, (P, tc·B, d); h after
    the chunk, (P, B, d)); ``n`` is updated in place."""
    lib = _check((x, wcat, fc1_t, fc2_t, h, n))
    p, b, d = h.shape
    rows = x.shape[1]
    shapes_ok = (
        wcat.shape == (p, 2 * d, 4 * d)
        and fc1_t.shape == (p, d, 4 * d)
        and fc2_t.shape == (p, 4 * d, d)
        and x.shape[2] == d
        and rows % b == 0
        and x.shape[0] in (1, p)
    )
    if not shapes_ok:
        raise ValueError(
            f"shapes x {tuple(x.shape)}, wcat {tuple(wcat.shape)}, fc1_t {tuple(fc1_t.shape)}, "
            f"fc2_t {tuple(fc2_t.shape)}, h {tuple(h.shape)}"
        )
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
        eps,
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
