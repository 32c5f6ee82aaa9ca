"""Run megatron-core's own ``LayerWiseDistributedOptimizer`` (fp32) on a CPU host (gloo).

A sibling of :mod:`megatron_ext.megatron.cpu_compat` (the model and DDP): that module makes
``GPTModel`` and ``DistributedDataParallel`` run; this one adds what megatron-core 0.19.2's
layer-wise optimizer path needs beyond it, so that ``megatron-ext bench layerwise --against
megatron-core`` can run megatron-core's optimizer beside megatron-ext's on the same host.
:func:`apply_cpu_compat_layerwise` applies both, and only when ``torch.cuda.is_available()`` is
false; on a CUDA host it returns without changing anything.  Every replaced call, and why:

``torch.tensor`` / ``torch.zeros`` / ``torch.empty`` / ``torch.ones`` with ``device='cuda'``
inside four megatron-core modules -> the same on the CPU.  The modules' ``torch`` name is bound
to a proxy that forwards everything to torch and rewrites only a literal ``"cuda"`` device:

* ``megatron.core.optimizer.clip_grads``: ``get_grad_norm_fp32`` and ``count_zeros_fp32`` put
  their accumulators and the multi-tensor applier's overflow flag on "cuda";
* ``megatron.core.utils``: ``local_multi_tensor_l2_norm`` (the fallback without Apex or
  Transformer Engine) returns its norm on "cuda";
* ``megatron.core.optimizer.optimizer``: ``FP32Optimizer.__init__`` keeps its loss scale (1.0)
  on "cuda", and ``has_grad_norm_group`` all-reduces a "cuda" flag;
* ``megatron.core.optimizer.layer_wise_optimizer``: its own ``has_grad_norm_group`` flag.

``clip_grad_by_total_norm_fp32`` as called from ``megatron.core.optimizer.optimizer``
    -> megatron-core's own function, on its ``use_decoupled_grad`` path.  Its plain path asserts
    ``param.grad.type() == 'torch.cuda.FloatTensor'``; the replacement hands each gradient over as
    ``param.decoupled_grad`` for the call (removed afterwards), where megatron-core checks only
    the dtype (fp32/bf16) and scales the same gradients by the same coefficient.

``torch.distributed.all_gather`` inside ``megatron.core.optimizer.layer_wise_optimizer``
    -> one ``broadcast`` per rank from that rank, when the per-rank sizes differ.  Its
    ``allgather_params`` gathers each rank's flattened parameters with receive buffers of their
    true sizes (no padding); NCCL runs such uneven all-gathers, gloo rejects them ("All tensors
    must have the same size").  Equal sizes still go to ``all_gather``.  The bytes each rank
    receives are the same (every other rank's segment).

Not a patch: in megatron-core 0.19.2 ``get_megatron_optimizer(optimizer='muon',
use_layer_wise_distributed_optimizer=True)`` with ``bf16=False`` chains the *raw* Emerging-
Optimizers ``TensorParallelMuon`` (and ``torch.optim.AdamW``) in its ``ChainedOptimizer``, whose
``step()`` then fails ("'TensorParallelMuon' object has no attribute 'prepare_grads'") on any
device.  :func:`wrap_fp32_inner_optimizers` wraps each in megatron-core's own ``FP32Optimizer``
(its public constructor, as megatron-core does on its non-layer-wise fp32 path); that is a use of
megatron-core's API, applied on GPUs too.

Nothing else is patched.  Call :func:`apply_cpu_compat_layerwise` once per process, before
building the optimizer.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.megatron.cpu_compat import CpuPatches, apply_cpu_compat

#: the megatron-core modules whose ``torch`` name becomes :class:`_CpuDeviceTorch`
DEVICE_MODULES = (
    "megatron.core.optimizer.clip_grads",
    "megatron.core.utils",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.layer_wise_optimizer",
)


def _cpu_device(device: Any) -> Any:
    """``"cpu"`` for a CUDA device argument, anything else unchanged."""
    if device is not None and torch.device(device).type == "cuda":
        return "cpu"
    return device


def _uneven_all_gather(
    tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None, async_op: bool = False
) -> Any:
    """``all_gather`` that gloo accepts with per-rank sizes that differ: each rank's segment
    broadcast from it (sizes equal: the real ``all_gather``)."""
    if len({t.numel() for t in tensor_list}) <= 1:
        return dist.all_gather(tensor_list, tensor, group=group, async_op=async_op)
    handles = [
        dist.broadcast(
            t, src=dist.get_global_rank(group, r) if group else r, group=group, async_op=async_op
        )
        for r, t in enumerate(tensor_list)
    ]
    return _Handles(handles) if async_op else None


class _Handles:
    """Several async works waited on as one."""

    def __init__(self, handles: list[Any]) -> None:
        self.handles = handles

    def wait(self) -> bool:
        for h in self.handles:
            h.wait()
        return True


class _Distributed:
    """Stands in for ``torch.distributed`` inside megatron-core's layer-wise optimizer module:
    everything forwarded, ``all_gather`` through :func:`_uneven_all_gather`."""

    def __getattr__(self, name: str) -> object:
        return getattr(dist, name)

    all_gather = staticmethod(_uneven_all_gather)


class _CpuDeviceTorch:
    """Stands in for ``torch`` inside the modules of :data:`DEVICE_MODULES` (module docstring)."""

    distributed = _Distributed()

    def __getattr__(self, name: str) -> object:
        return getattr(torch, name)

    @staticmethod
    def tensor(data: Any, *args: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.tensor(data, *args, device=_cpu_device(device), **kwargs)

    @staticmethod
    def zeros(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.zeros(*size, device=_cpu_device(device), **kwargs)

    @staticmethod
    def ones(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.ones(*size, device=_cpu_device(device), **kwargs)

    @staticmethod
    def empty(*size: Any, device: Any = None, **kwargs: Any) -> torch.Tensor:
        return torch.empty(*size, device=_cpu_device(device), **kwargs)


def _clip_on_cpu(original: Any) -> Any:
    """megatron-core's ``clip_grad_by_total_norm_fp32`` on its decoupled-gradient path (above)."""

    def clip(parameters: Any, max_norm: Any, total_norm: Any, use_decoupled_grad: bool = False):
        if use_decoupled_grad:
            return original(parameters, max_norm, total_norm, use_decoupled_grad=True)
        params = [parameters] if torch.is_tensor(parameters) else list(parameters)
        handed = [p for p in params if p.grad is not None]
        for p in handed:
            p.decoupled_grad = p.grad
        try:
            return original(handed, max_norm, total_norm, use_decoupled_grad=True)
        finally:
            for p in handed:
                del p.decoupled_grad

    return clip


def _replacements() -> list[tuple[object, str, object]]:
    import importlib

    import megatron.core.optimizer.clip_grads as mc_clip
    import megatron.core.optimizer.optimizer as mc_optimizer

    proxy = _CpuDeviceTorch()
    return [
        *((importlib.import_module(m), "torch", proxy) for m in DEVICE_MODULES),
        (
            mc_optimizer,
            "clip_grad_by_total_norm_fp32",
            _clip_on_cpu(mc_clip.clip_grad_by_total_norm_fp32),
        ),
    ]


#: this module's replacements (:func:`_replacements`, looked up at each use)
PATCHES = CpuPatches(lambda: _replacements())


def apply_cpu_compat_layerwise() -> bool:
    """:func:`~megatron_ext.megatron.cpu_compat.apply_cpu_compat` plus the calls listed in the
    module docstring, when CUDA is unavailable.  Returns True when the patches are (now or
    already) in place, False on a CUDA host, where nothing is changed."""
    if torch.cuda.is_available():
        return False
    apply_cpu_compat()
    return PATCHES.apply()


def replaced_calls() -> list[str]:
    """Dotted names of every call this module replaces (for logs and the docstring test)."""
    calls = [
        f"{m}.torch.{fn}" for m in DEVICE_MODULES for fn in ("tensor", "zeros", "ones", "empty")
    ]
    return [
        *calls,
        "megatron.core.optimizer.optimizer.clip_grad_by_total_norm_fp32",
        "megatron.core.optimizer.layer_wise_optimizer.torch.distributed.all_gather",
    ]


def wrap_fp32_inner_optimizers(optimizer: Any, config: Any) -> int:
    """Wrap each raw inner optimizer of megatron-core's ``LayerWiseDistributedOptimizer`` (fp32,
    ``config.bf16`` false) in megatron-core's ``FP32Optimizer``, in place; returns how many were
    wrapped.  A use of megatron-core's API, not a patch (module docstring).  No
    ``init_state_fn`` is given: it only creates empty state before a checkpoint load.

    ``optimizer``: what ``get_megatron_optimizer`` returned; a ``ChainedOptimizer`` around a
    layer-wise one is searched too."""
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer
    from megatron.core.optimizer.optimizer import FP32Optimizer, MegatronOptimizer

    if config.bf16 or config.fp16:
        return 0  # megatron-core wraps these itself (Float16OptimizerWithFloat16Params)
    layerwise = [optimizer, *list(getattr(optimizer, "chained_optimizers", []))]
    wrapped = 0
    for lw in layerwise:
        if not isinstance(lw, LayerWiseDistributedOptimizer):
            continue
        for i, inner in enumerate(lw.chained_optimizers):
            if not isinstance(inner, MegatronOptimizer):
                lw.chained_optimizers[i] = FP32Optimizer(inner, config, None)
                wrapped += 1
    return wrapped
