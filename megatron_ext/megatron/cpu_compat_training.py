"""Run Megatron-LM's training loop (``megatron.training.pretrain``) on a CPU host (gloo).

:mod:`.cpu_compat` makes megatron-core's model and DDP run without CUDA; Megatron-LM's training
package needs more: it asserts CUDA, creates its bookkeeping tensors on ``"cuda"``, moves
batches and models with ``.cuda()``, asks for memory statistics, and type-checks gradients as
``torch.cuda.FloatTensor``. :func:`apply_training_cpu_compat` redirects exactly the calls below,
and only when ``torch.cuda.is_available()`` is false; on a CUDA host it returns without changing
anything. Apply :func:`~.cpu_compat.apply_cpu_compat` too (streams, events, RNG, device index).
Every replaced call, and why:

``torch`` inside ``megatron.training.training``, ``megatron.training.initialize``,
``megatron.training.checkpointing``, ``megatron.training.utils.common_utils``,
``megatron.core.optimizer.optimizer``, ``megatron.core.optimizer.clip_grads``,
``megatron.core.timers``, ``megatron.core.rerun_state_machine``,
``megatron.core.distributed.param_and_grad_buffer``,
``megatron.core.models.common.embeddings.rotary_pos_embedding`` and ``megatron.core.utils``
    -> a view of ``torch`` (:class:`_TorchView`) in which a CUDA device is the CPU and nothing
    else differs. Its tensor factories (``tensor``, ``zeros``, ``ones``, ``empty``, ``full``,
    ``arange``, ``rand``, ``randn``, ``randint``, the ``*_like`` ones, ``as_tensor``) and
    ``torch.device`` map ``"cuda"``/``"cuda:N"``/an index to ``"cpu"`` (these modules create
    their loss sums, iteration counters, grad-norm and found-inf flags, timer buffers and RoPE
    frequencies on ``"cuda"`` literally); its ``torch.cuda`` answers ``is_available() -> True``
    and ``device_count() -> 1`` (``initialize_megatron`` asserts CUDA, and builds the
    model-parallel groups and seeds the device RNG tracker only when a device is counted: the
    one device is the CPU, whose generator :mod:`.cpu_compat` makes the tracker's),
    ``empty_cache`` as a no-op and zero memory statistics (``memory_stats``,
    ``memory_allocated``, ``max_memory_allocated``, ``memory_reserved``,
    ``max_memory_reserved``: the training log reports them); every other ``torch.cuda`` name is
    torch's own (patched by :mod:`.cpu_compat` where listed there).
``torch.Tensor.cuda`` / ``torch.nn.Module.cuda``  -> return the tensor / module unchanged
    Megatron-LM moves each batch (``batch[key].cuda(non_blocking=True)``), the model
    (``model_module.cuda(torch.cuda.current_device())``) and optimizer state onto the GPU; on a
    CPU host they are already where they belong (the original calls raise without a driver).
``megatron.core.optimizer.clip_grads.clip_grad_by_total_norm_fp32`` (and its import in
``megatron.core.optimizer.optimizer``)  -> :func:`_clip_fp32`
    The original asserts ``param.grad.type() == 'torch.cuda.FloatTensor'``; the replacement
    checks the gradients are fp32 and scales them in place by ``max_norm / (total_norm +
    1e-6)`` when that is below 1 — the same product the original's ``multi_tensor_scale`` forms.
``megatron.training.initialize._warmup_jit_function``  -> no-op
    It runs the fused bias-GeLU / bias-SwiGLU and bias-dropout-add functions on random
    ``"cuda"`` tensors so that their GPU kernels are compiled before step 1; on a CPU it would
    compile them with the CPU inductor (tens of seconds) and draw from the one generator the
    model's initialisation uses. A model that uses the fusions compiles them at first use.
``megatron.training.training.build_train_valid_test_data_iterators``  -> the same, on a
forked CPU generator (its state saved before and restored after)
    Building the data iterators draws from the CPU generator (a DataLoader draws its base seed
    from it when its iterator is made). On a GPU host those are host draws, which leave the
    device generator that dropout draws from alone; on a CPU host the device generator *is* the
    CPU generator (:mod:`.cpu_compat`), and a resumed run builds its iterators after
    ``load_checkpoint`` restored the generator, so the draws moved every later dropout mask
    (Megatron-LM's own Adam resumed at iteration 5 read 4.521451 at iteration 6, the
    uninterrupted run 4.521372). With the fork a resumed run continues bit for bit.

Nothing else is patched. Call it once per process before ``pretrain``.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from typing import Any

import torch

from megatron_ext.megatron.cpu_compat import CpuPatches, tensor_stays

__all__ = ["apply_training_cpu_compat", "replaced_calls"]

#: the Megatron-LM / megatron-core modules whose module-global ``torch`` becomes the CPU view
TORCH_VIEW_MODULES = (
    "megatron.training.training",
    "megatron.training.initialize",
    "megatron.training.checkpointing",
    "megatron.training.utils.common_utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.timers",
    "megatron.core.rerun_state_machine",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.utils",
)
_FACTORIES = frozenset(
    [
        "tensor",
        "zeros",
        "ones",
        "empty",
        "full",
        "arange",
        "rand",
        "randn",
        "randint",
        "zeros_like",
        "ones_like",
        "empty_like",
        "full_like",
        "as_tensor",
    ]
)


def _cpu(device: Any) -> Any:
    """``device`` with a CUDA device (``"cuda"``, ``"cuda:1"``, an index) made the CPU."""
    if device is None:
        return None
    if isinstance(device, int) or torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


class _DeviceMeta(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.device)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.device:
        return _cpu(torch.device(*args, **kwargs))


class _Device(metaclass=_DeviceMeta):
    """``torch.device`` with CUDA devices made the CPU (``isinstance`` sees torch.device)."""


class _CudaView:
    """``torch.cuda`` as Megatron-LM's loop sees it on a CPU host: one device, the CPU."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def memory_stats(device: object = None) -> dict[str, int]:
        return {}

    @staticmethod
    def memory_allocated(device: object = None) -> int:
        return 0

    max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated


def _factory(fn: Any) -> Any:
    def on_cpu(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        return fn(*args, device=_cpu(device), **kwargs)

    return on_cpu


class _TorchView:
    """``torch`` inside one Megatron module: a CUDA device is the CPU (module docstring)."""

    cuda = _CudaView()
    device = _Device

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        return _factory(value) if name in _FACTORIES else value


def _module_cuda(self: torch.nn.Module, device: object = None) -> torch.nn.Module:
    return self


def _clip_fp32(
    parameters: Any, max_norm: float, total_norm: Any, use_decoupled_grad: bool = False
) -> None:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` for CPU tensors: every fp32 gradient
    times ``max_norm / (total_norm + 1e-6)`` when that is below 1, in place."""
    params = [parameters] if torch.is_tensor(parameters) else list(parameters)
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    grads = [g for g in (getattr(p, attr, None) for p in params) if g is not None]
    for grad in grads:
        if grad.dtype != torch.float32 and not (
            use_decoupled_grad and grad.dtype == torch.bfloat16
        ):
            raise TypeError(f"clip_grad_by_total_norm_fp32: a {grad.dtype} gradient, fp32 expected")
    coeff = max_norm / (total_norm + 1.0e-6)
    if torch.is_tensor(coeff):
        coeff = coeff.clamp_max(1.0)
    elif coeff >= 1.0:
        return
    for grad in grads:
        grad.copy_(grad * coeff)


def _on_forked_cpu_rng(build: Callable[..., Any]) -> Callable[..., Any]:
    """``build`` run with the CPU generator's state saved before and restored after."""
    if getattr(build, "forks_cpu_rng", False):
        return build  # already forked (the patches re-applied)

    @functools.wraps(build)
    def forked(*args: Any, **kwargs: Any) -> Any:
        state = torch.get_rng_state()
        try:
            return build(*args, **kwargs)
        finally:
            torch.set_rng_state(state)

    forked.forks_cpu_rng = True  # type: ignore[attr-defined]
    return forked


def _replacements() -> list[tuple[object, str, object]]:
    import megatron.core.optimizer.clip_grads as mc_clip
    import megatron.core.optimizer.optimizer as mc_optimizer
    import megatron.training.initialize as mlm_initialize
    import megatron.training.training as mlm_training

    view = _TorchView()
    out: list[tuple[object, str, object]] = [
        (importlib.import_module(name), "torch", view) for name in TORCH_VIEW_MODULES
    ]
    return [
        *out,
        (torch.Tensor, "cuda", tensor_stays),
        (torch.nn.Module, "cuda", _module_cuda),
        (mc_clip, "clip_grad_by_total_norm_fp32", _clip_fp32),
        (mc_optimizer, "clip_grad_by_total_norm_fp32", _clip_fp32),
        (mlm_initialize, "_warmup_jit_function", lambda tp_size=None: None),
        (
            mlm_training,
            "build_train_valid_test_data_iterators",
            _on_forked_cpu_rng(mlm_training.build_train_valid_test_data_iterators),
        ),
    ]


#: this module's replacements (:func:`_replacements`, looked up at each use)
PATCHES = CpuPatches(lambda: _replacements())


def apply_training_cpu_compat() -> bool:
    """Patch the calls listed in the module docstring when CUDA is unavailable.

    Returns True when the patches are (now or already) in place, False on a CUDA host, where
    nothing is changed.
    """
    return PATCHES.apply()


def replaced_calls() -> list[str]:
    """Dotted names of every call this module replaces (for logs and the docstring test)."""
    return PATCHES.replaced_calls()
