"""The no-grad LSTM recurrence of the SOMA body as one C kernel (``native_lstm.c``), for CPU.

The eager torch scan (:func:`~.scan.lstm_scan_inplace`) runs seven kernels per time step over
all ``P`` bodies, each one a pass over memory and a thread barrier; the C kernel gives each
thread whole bodies and runs every step of a chunk for one body before the next, so the body's
recurrent matrix, its state and the step's gates stay in cache (see the C file). Same
arithmetic; results equal the torch path to float rounding (tested).

The source is compiled on first use with the host's C compiler (``$CC``, else ``cc``) for this
CPU (``-march=native``) into ``$MEGATRON_EXT_CACHE/kernels`` (default
``~/.cache/megatron-ext/kernels``; the temporary folder when that is not writable), keyed by the
source, compiler, flags and CPU model, written atomically, and loaded through ``ctypes``. Where
there is no compiler, or the compile fails, :func:`native_available` says why and callers run
the torch scan.
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

__all__ = ["lstm_scan_native", "native_available"]

SOURCE = Path(__file__).with_name("native_lstm.c")
FLAGS = ("-O3", "-march=native", "-fPIC", "-shared", "-fopenmp", "-std=gnu11")
CACHE_VAR = "MEGATRON_EXT_CACHE"


def _cache_dir() -> Path:
    root = os.environ.get(CACHE_VAR) or Path.home() / ".cache" / "megatron-ext"
    return Path(root) / "kernels"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
    fn = lib.soma_lstm_scan
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] + [ctypes.c_void_p] * 2
    fn.argtypes += [ctypes.c_int] * 5
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
            [cc, *FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True, timeout=300
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


def lstm_scan_native(
    xw: torch.Tensor, whh_t: torch.Tensor, h: torch.Tensor, n: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~.scan.lstm_scan_inplace`'s arguments and results, on the C kernel: xw (P, tc, B,
    4d) and whh_t (P, d, 4d) float32 CPU tensors, state h, n (P, B, d) -> (out (P, tc, B, d),
    h, n); ``n`` is updated in place, ``h`` is a view of ``out``'s last step. Raises
    ``RuntimeError`` when the kernel is unavailable (:func:`native_available`)."""
    lib, why = _library()
    if lib is None:
        raise RuntimeError(f"SOMA's C kernel is unavailable: {why}")
    p, tc, b, four_d = xw.shape
    d = four_d // 4
    tensors = (xw, whh_t, h, n)
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise ValueError("the C kernel takes float32 CPU tensors")
    xw, whh_t = xw.contiguous(), whh_t.contiguous()
    if h.stride()[1:] != (d, 1):  # rows of one body contiguous; bodies at any stride
        h = h.contiguous()
    if not n.is_contiguous():
        raise ValueError("the carried n must be contiguous (it is updated in place)")
    out = xw.new_empty(p, tc, b, d)
    status = lib.soma_lstm_scan(
        xw.data_ptr(),
        whh_t.data_ptr(),
        h.data_ptr(),
        h.stride(0),
        n.data_ptr(),
        out.data_ptr(),
        p,
        tc,
        b,
        d,
        torch.get_num_threads(),
    )
    if status != 0:
        raise MemoryError("SOMA's C kernel could not allocate its scratch buffers")
    return out, out[:, -1], n
