"""What this machine can run: its device description, the precision rules, the fail-closed gate.

The rules are one table, :data:`REQUIREMENTS`, one row per FP8/FP4 precision with its source. Every
FP8/FP4 precision also needs Transformer Engine and a GPU. ``fp32``, ``bf16`` and ``fp16`` need
neither (torch's float16 kernels run on CPU too). :func:`unmet_requirement` compares a precision
with a :class:`DeviceDescription` and returns the one-line refusal (requirement, then what the
machine has), or None.

The gate runs twice, on two descriptions of the same hardware:

* before any process starts, in the launcher (:func:`check_precision_before_launch`), which must
  not import torch. The description (:func:`probe_device`, made once per launch with the rest of
  the launcher's host probe) comes from ``nvidia-smi --query-gpu``
  (:mod:`megatron_ext.run.nvidia_smi`: the driver's own answer, no CUDA context, a fraction of a
  second where a probe subprocess would spend seconds importing torch), the CUDA version torch
  was built with (read from
  ``torch/version.py`` as text: that is the version TE checks, not the driver's), and
  Transformer Engine's installed version (package metadata; nothing is imported). A GPU whose
  compute capability nvidia-smi cannot report (drivers before R510) counts as unknown and
  fails closed;
* on every rank, in the per-rank entry (:func:`check_precision_on_rank`), with torch: the
  rank's own GPU, ``torch.version.cuda``, and TE as actually imported.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.errors import ConfigError
from megatron_ext.run.nvidia_smi import query_gpus, visible_gpus
from megatron_ext.run.precision import PRECISIONS, Precision, precision_spec

__all__ = [
    "REQUIREMENTS",
    "DeviceDescription",
    "Requirement",
    "can_run",
    "check_precision_before_launch",
    "check_precision_on_rank",
    "probe_device",
    "probe_device_with_torch",
    "require_precision",
    "supported_precisions",
    "unmet_requirement",
]

Version = tuple[int, ...]

_TE_SOURCE = "Transformer Engine, transformer_engine/pytorch/quantization.py"
_MCORE_SOURCE = "megatron-core 0.19"


@dataclass(frozen=True)
class Requirement:
    """What one FP8/FP4 precision needs besides Transformer Engine and a GPU. Compute
    capabilities are (major, minor); ``below_cc`` is exclusive; ``min_te`` is the TE release
    megatron-core needs for the recipe (its ``x.y.z.dev0`` builds count)."""

    min_cc: tuple[int, int]
    below_cc: tuple[int, int] | None = None
    min_cuda: tuple[int, int] | None = None
    min_te: tuple[int, int, int] | None = None
    source: str = ""

    def describe(self) -> str:
        """The requirement in words, e.g. ``a GPU of compute capability 10.x-11.x``."""
        if self.below_cc is not None:
            gpu = f"a GPU of compute capability {self.min_cc[0]}.x-{self.below_cc[0] - 1}.x"
        else:
            gpu = f"a GPU of compute capability >= {_dotted(self.min_cc)}"
        te = "Transformer Engine"
        if self.min_te:
            te += f" >= {_dotted(self.min_te)}"
        cuda = f" with CUDA >= {_dotted(self.min_cuda)}" if self.min_cuda else ""
        return f"{te} and {gpu}{cuda}"


#: The one table of precision rules (precisions not listed, fp32 and bf16, need nothing).
REQUIREMENTS: dict[str, Requirement] = {
    "fp8_tensorwise": Requirement(
        min_cc=(8, 9),
        min_te=(2, 2, 0),
        source=f"{_TE_SOURCE} _compute_fp8_support (Float8CurrentScaling); "
        f"{_MCORE_SOURCE} fp8_utils.get_fp8_recipe (TE >= 2.2.0.dev0)",
    ),
    "fp8_delayed": Requirement(
        min_cc=(8, 9),
        source=f"{_TE_SOURCE} _compute_fp8_support (DelayedScaling)",
    ),
    "fp8_blockwise": Requirement(
        min_cc=(9, 0),
        min_cuda=(12, 9),
        min_te=(2, 3, 0),
        source=f"{_TE_SOURCE} _compute_fp8_block_scaling_support; "
        f"{_MCORE_SOURCE} fp8_utils.get_fp8_recipe (TE >= 2.3.0.dev0)",
    ),
    "mxfp8": Requirement(
        min_cc=(10, 0),
        below_cc=(12, 0),
        min_te=(2, 1, 0),
        source=f"{_TE_SOURCE} _compute_mxfp8_support (not on 12.0+ yet); "
        f"{_MCORE_SOURCE} fp8_utils.get_fp8_recipe (TE >= 2.1.0)",
    ),
    "nvfp4": Requirement(
        min_cc=(10, 0),
        min_te=(2, 7, 0),
        source=f"{_TE_SOURCE} _compute_nvfp4_support; "
        f"{_MCORE_SOURCE} fp4_utils.get_fp4_recipe (TE >= 2.7.0.dev0)",
    ),
}
assert set(REQUIREMENTS) == {p for p in PRECISIONS if precision_spec(p).quantized}


@dataclass(frozen=True)
class DeviceDescription:
    """The GPUs this process sees (one entry per GPU), the CUDA version torch was built with,
    Transformer Engine's version (None: not installed; ``"unknown"``: installed, version
    unreadable), and where the description came from."""

    names: tuple[str, ...] = ()
    capabilities: tuple[tuple[int, int] | None, ...] = ()
    cuda: tuple[int, int] | None = None
    transformer_engine: str | None = None
    source: str = ""
    notes: tuple[str, ...] = field(default=())

    @property
    def gpus(self) -> int:
        return len(self.names)

    @property
    def compute_capability(self) -> tuple[int, int] | None:
        """The lowest over the GPUs (every rank must run the precision); None if unknown."""
        if not self.capabilities or None in self.capabilities:
            return None
        return min(c for c in self.capabilities if c is not None)

    def describe(self) -> str:
        """One phrase, e.g. ``1 x NVIDIA H200 (compute capability 9.0), CUDA 12.8 (torch),
        Transformer Engine 2.5.0 [nvidia-smi]``."""
        if not self.names:
            gpus = "no GPU"
        else:
            cc = self.compute_capability
            kinds = ", ".join(dict.fromkeys(self.names))
            gpus = f"{self.gpus} x {kinds} (compute capability {_dotted(cc) if cc else 'unknown'})"
        cuda = f"CUDA {_dotted(self.cuda)} (torch)" if self.cuda else "no CUDA build of torch"
        te = (
            f"Transformer Engine {self.transformer_engine}"
            if self.transformer_engine
            else "no Transformer Engine"
        )
        notes = "; ".join(self.notes)
        return f"{gpus}, {cuda}, {te} [{self.source}{': ' + notes if notes else ''}]"


def unmet_requirement(precision: str, device: DeviceDescription) -> str | None:
    """Why ``device`` cannot run ``precision`` (one line: the requirement, its source, what
    the machine has, what it can run instead), or None when it can."""
    if can_run(precision, device):
        return None
    rule = REQUIREMENTS[precision]
    return (
        f"training.precision={precision} needs {rule.describe()} (rule from {rule.source}); "
        f"this machine has {device.describe()}; it can run: "
        f"{', '.join(supported_precisions(device))}"
    )


def can_run(precision: str, device: DeviceDescription) -> bool:
    """Whether ``device`` meets ``precision``'s row of :data:`REQUIREMENTS` (no row: yes)."""
    rule = REQUIREMENTS.get(precision_spec(precision).name)
    if rule is None:
        return True
    te, cc = device.transformer_engine, device.compute_capability
    return (
        te is not None
        and (rule.min_te is None or (_version(te) or (0,)) >= rule.min_te)
        and cc is not None
        and cc >= rule.min_cc
        and (rule.below_cc is None or cc < rule.below_cc)
        and (rule.min_cuda is None or (device.cuda is not None and device.cuda >= rule.min_cuda))
    )


def supported_precisions(device: DeviceDescription) -> list[str]:
    """The precisions ``device`` can run, in the schema's order."""
    return [p for p in PRECISIONS if can_run(p, device)]


def require_precision(precision: str, device: DeviceDescription) -> None:
    """Raise ``ConfigError`` (exit 2, one line) unless ``device`` can run ``precision``."""
    reason = unmet_requirement(precision, device)
    if reason is not None:
        raise ConfigError(reason)


def check_precision_before_launch(precision: Precision | None, device: DeviceDescription) -> None:
    """The launcher's gate, torch-free: ``precision`` (``training.precision``; None for a trainer
    without a ``training`` section) against ``device``, the launcher's one probe of this
    machine (:func:`probe_device`, read by :func:`megatron_ext.launch.hosts.probe_host`)."""
    if precision in REQUIREMENTS:
        require_precision(precision, device)


def check_precision_on_rank(precision: Precision | None, local_rank: int) -> None:
    """The per-rank gate (``megatron-ext train``): the same table, against the rank's own GPU
    as torch sees it and Transformer Engine as actually imported (probed only when
    ``precision`` has a rule)."""
    if precision in REQUIREMENTS:
        require_precision(precision, probe_device_with_torch(local_rank))


# --------------------------------------------------------------------------- probes


def probe_device(
    environ: Mapping[str, str] | None = None, nvidia_smi: str | None = None
) -> DeviceDescription:
    """This machine as the launcher sees it, without torch (see the module docstring): one
    ``nvidia-smi`` query (:func:`~megatron_ext.run.nvidia_smi.query_gpus`);
    ``CUDA_VISIBLE_DEVICES`` selects the GPUs (indices or UUIDs, as CUDA reads it)."""
    environ = os.environ if environ is None else environ
    answer = query_gpus(nvidia_smi)
    rows = visible_gpus(answer.rows, environ.get("CUDA_VISIBLE_DEVICES"))
    return DeviceDescription(
        names=tuple(r.name for r in rows),
        capabilities=tuple(r.compute_capability for r in rows),
        cuda=torch_cuda_version(),
        transformer_engine=transformer_engine_version(),
        source="nvidia-smi",
        notes=(answer.note,) if answer.note else (),
    )


def probe_device_with_torch(local_rank: int = 0) -> DeviceDescription:
    """This rank's GPU (``local_rank`` modulo the visible count) as torch sees it, the CUDA
    version torch was built with, and Transformer Engine's version if it imports."""
    import torch

    notes = []
    te: str | None = None
    if importlib.util.find_spec("transformer_engine") is not None:
        try:
            import transformer_engine.pytorch  # noqa: F401  (the part megatron-core uses)

            te = transformer_engine_version() or "unknown"
        except Exception as exc:  # a broken install must refuse, not crash obscurely
            notes.append(f"transformer_engine.pytorch fails to import: {exc}".splitlines()[0])
    names: tuple[str, ...] = ()
    caps: tuple[tuple[int, int] | None, ...] = ()
    if torch.cuda.is_available() and torch.cuda.device_count():
        index = local_rank % torch.cuda.device_count()
        names = (torch.cuda.get_device_name(index),)
        caps = (tuple(torch.cuda.get_device_capability(index)),)  # type: ignore[assignment]
    cuda = _version(torch.version.cuda or "")
    return DeviceDescription(
        names=names,
        capabilities=caps,
        cuda=cuda[:2] if cuda else None,  # type: ignore[arg-type]
        transformer_engine=te,
        source=f"torch, local rank {local_rank}",
        notes=tuple(notes),
    )


def transformer_engine_version() -> str | None:
    """Transformer Engine's installed version from package metadata (nothing imported): None
    when it is not installed, ``"unknown"`` when the module exists without metadata."""
    for dist in ("transformer_engine", "transformer_engine_torch", "transformer_engine_cu12"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown" if importlib.util.find_spec("transformer_engine") is not None else None


def torch_cuda_version() -> tuple[int, int] | None:
    """The CUDA version the installed torch was built with, read from ``torch/version.py`` as
    text (no import); None for a CPU-only build or no torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        text = (Path(spec.origin).parent / "version.py").read_text(encoding="utf-8")
    except OSError:
        return None
    match = re.search(r"^cuda\b[^=]*=\s*['\"]([0-9.]+)['\"]", text, re.MULTILINE)
    version = _version(match[1]) if match else None
    return version[:2] if version and len(version) >= 2 else None  # type: ignore[return-value]


def _version(text: str) -> Version | None:
    """The leading dotted integers of a version string (``2.3.0.dev0+5fdd7bb`` -> (2, 3, 0))."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text)
    return tuple(int(x) for x in match[1].split(".")) if match else None


def _dotted(version: Version | None) -> str:
    return ".".join(str(x) for x in version) if version else "?"
