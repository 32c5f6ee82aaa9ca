"""Run megatron-core's model and DDP on a CPU host (gloo), without touching a CUDA host.

megatron-core assumes a CUDA device in a handful of places that matter for GPTModel (dense and
MoE) and ``DistributedDataParallel``.  :func:`apply_cpu_compat` redirects exactly these calls,
and only when ``torch.cuda.is_available()`` is false; on a CUDA host it returns without changing
anything.  Every replaced call, and why:

``torch.cuda.current_device``  -> ``torch.cpu.current_device`` (``"cpu"``)
    Weight, grad-buffer and router tensors are created with ``device=torch.cuda.current_device()``.
``torch.cuda.set_device``      -> no-op
    Called with the local rank during initialisation; a CPU host has one device.
``torch.cuda.Stream`` / ``current_stream`` / ``default_stream`` / ``stream``
                                -> ``torch.cpu`` equivalents (one implicit stream)
    DDP's grad-sync and the MoE layer put communication on side streams and wait on them; the
    MoE token dispatcher synchronises the event a side stream's ``record_event`` returns, so the
    CPU stream returns an (always complete) event there instead of ``None``.
``torch.cuda.Event``            -> ``torch.cpu.Event`` (always complete)
    DDP records events to order bucket communication after the backward computation.
``torch.cuda.synchronize``      -> ``torch.cpu.synchronize`` (no-op)
    Timers and DDP flush the device before measuring / finishing.
``torch.cuda.get_rng_state`` / ``torch.cuda.manual_seed`` and megatron-core's
``tensor_parallel.random._get_cuda_rng_state`` / ``_set_cuda_rng_state``  -> the CPU default
generator
    megatron-core's RNG tracker forks "device" RNG streams (data-parallel, tensor-parallel,
    expert-parallel) around dropout and weight init; on a CPU host the device generator *is* the
    CPU generator, so the tracker seeds, saves and restores that one (activation
    recomputation, ``parallel.recompute_granularity``, saves and restores it around each
    recomputed forward).
``torch.zeros(..., device="cuda")`` inside ``megatron.core.pipeline_parallel.schedules``
    -> the same on the CPU.  The forward/backward schedules allocate their token counter on
    "cuda" literally; the module's ``torch`` name is bound to a proxy that forwards everything to
    torch and rewrites only that device argument of ``zeros``.

``maybe_move_tensor_to_cpu`` inside ``megatron.core.transformer.moe.token_dispatcher``
    -> the same, plus ``as_numpy`` honoured for tensors already on the CPU.  The alltoall
    dispatcher turns its split sizes into NumPy arrays only when moving them off a GPU; on a CPU
    host they stayed tensors, which gloo's ``all_to_all_single`` rejects (expert parallelism).

``LanguageModule.setup_embeddings_and_output_layer`` -> the same, with ``Tensor.cuda`` the
identity while it runs
    With tied embeddings over several pipeline stages, the last stage's copy of the word
    embeddings is all-reduced from the first stage's after ``weight.data = weight.data.cuda()``;
    on a CPU host the weight stays where it is (``Tensor.cuda`` is restored on return).

Nothing else is patched.  Call it once per process before building the model.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class _CpuStream(torch.cpu.Stream):
    """torch.cpu.Stream whose ``record_event`` returns an event (megatron-core synchronises it)."""

    def record_event(self, event: torch.cpu.Event | None = None) -> torch.cpu.Event:
        return event if event is not None else torch.cpu.Event()


_CURRENT_STREAM = _CpuStream()


class _SchedulesTorch:
    """Stands in for ``torch`` inside megatron-core's schedules module (see module docstring)."""

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def zeros(*size: object, device: object = None, **kwargs: object) -> torch.Tensor:
        if device is not None and torch.device(device).type == "cuda":
            device = "cpu"
        return torch.zeros(*size, device=device, **kwargs)


def _to_cpu(tensor: object, as_numpy: bool = False, record_stream: bool = False) -> object:
    """megatron-core's ``maybe_move_tensor_to_cpu`` for tensors that are already on the CPU."""
    if torch.is_tensor(tensor) and as_numpy:
        return tensor.numpy()
    return tensor


def _set_rng_state(new_state: torch.Tensor, device: int = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _get_rng_state(
    device: object = "cuda", clone: bool = False, graph_safe: bool = False
) -> torch.Tensor:
    return torch.get_rng_state()  # a new tensor: cloned already


def tensor_stays(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """``Tensor.cuda`` on a CPU host: the tensor itself (also :mod:`.cpu_compat_training`'s)."""
    return self


def _without_cuda_moves(method: Callable[..., object]) -> Callable[..., object]:
    """``method`` with ``Tensor.cuda`` the identity while it runs (see the module docstring);
    applied to an already wrapped method, the original is wrapped once."""
    method = getattr(method, "__wrapped__", method)

    def on_cpu(*args: object, **kwargs: object) -> object:
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = tensor_stays  # type: ignore[method-assign]
        try:
            return method(*args, **kwargs)
        finally:
            torch.Tensor.cuda = cuda  # type: ignore[method-assign]

    on_cpu.__wrapped__ = method  # type: ignore[attr-defined]
    return on_cpu


def _replacements() -> list[tuple[object, str, object]]:
    import megatron.core.pipeline_parallel.schedules as mc_schedules
    import megatron.core.tensor_parallel.random as mc_random
    import megatron.core.transformer.moe.token_dispatcher as mc_dispatcher
    from megatron.core.models.common.language_module.language_module import LanguageModule

    cpu = torch.cpu
    return [
        (torch.cuda, "current_device", cpu.current_device),
        (torch.cuda, "set_device", lambda device: None),
        (torch.cuda, "Stream", _CpuStream),
        (torch.cuda, "current_stream", lambda device=None: _CURRENT_STREAM),
        (torch.cuda, "default_stream", lambda device=None: _CURRENT_STREAM),
        (torch.cuda, "stream", cpu.stream),
        (torch.cuda, "Event", cpu.Event),
        (torch.cuda, "synchronize", cpu.synchronize),
        (torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state()),
        (torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed) and None),
        (mc_random, "_set_cuda_rng_state", _set_rng_state),
        (mc_random, "_get_cuda_rng_state", _get_rng_state),
        (mc_schedules, "torch", _SchedulesTorch()),
        (mc_dispatcher, "maybe_move_tensor_to_cpu", _to_cpu),
        (
            LanguageModule,
            "setup_embeddings_and_output_layer",
            _without_cuda_moves(LanguageModule.setup_embeddings_and_output_layer),
        ),
    ]


class CpuPatches:
    """Replacements applied once per process, and only on a host without CUDA.

    The CPU compatibility modules (this one, :mod:`.cpu_compat_training`,
    :mod:`.cpu_compat_layerwise`) each keep one: ``build`` returns the ``(owner, attribute,
    replacement)`` triples (called when applying and listing, so the owners are imported only
    then); :meth:`apply` sets them on the first call on a CPU host and returns True then and
    after, False on a CUDA host, where nothing is changed; :attr:`applied` says whether they are
    in place (tests reset it).
    """

    def __init__(self, build: Callable[[], list[tuple[object, str, object]]]) -> None:
        self.build = build
        self.applied = False

    def apply(self) -> bool:
        """Set every replacement once, on a host without CUDA; see the class docstring."""
        if torch.cuda.is_available():
            return False
        if not self.applied:
            for owner, name, replacement in self.build():
                setattr(owner, name, replacement)
            self.applied = True
        return True

    def replaced_calls(self) -> list[str]:
        """``owner.attribute`` of every replacement (for logs and the docstring tests)."""
        return [f"{getattr(o, '__name__', type(o).__name__)}.{n}" for o, n, _ in self.build()]


#: this module's replacements (:func:`_replacements`, looked up at each use)
PATCHES = CpuPatches(lambda: _replacements())


def apply_cpu_compat() -> bool:
    """Patch the calls listed in the module docstring when CUDA is unavailable.

    Returns True when the patches are (now or already) in place, False on a CUDA host, where
    nothing is changed.
    """
    return PATCHES.apply()


def replaced_calls() -> list[str]:
    """Dotted names of every call this module replaces (for logs and the docstring test)."""
    return PATCHES.replaced_calls()
