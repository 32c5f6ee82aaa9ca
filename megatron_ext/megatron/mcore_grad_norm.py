"""The gradient norm as megatron-core's Muon (``--optimizer muon``) computes it, bit for bit.

Clipping multiplies every gradient by ``clip_grad / (norm + 1e-6)``, so the norm's last bit
reaches every parameter; with bf16 Newton–Schulz that one-ulp difference grows into a
visible loss difference within ten iterations (measured: 5e-6 relative at world size 1).
megatron-core's emerging-optimizer path (``_get_megatron_emerging_optimizer``) computes the norm
with a fixed arithmetic and order, which :class:`McoreGradNorm` reproduces with megatron-core's
own functions:

- the parameters are bucketed as megatron-core builds its sub-optimizers: its parameter groups
  (``_get_param_groups`` with the standard overrides and the emerging optimizer's default
  routing, in megatron-core's group order), then by (optimizer, expert-parallel) in the order
  the groups first name them (``ChainedOptimizer([muon, adam, ...])``);
- each bucket's gradients (``main_grad``; shared and tensor-parallel duplicate parameters
  left out) in that order go to megatron-core's ``get_grad_norm_fp32`` (fp32 norm per tensor,
  the fp32 norm of those norms, squared, summed over the bucket's statistics group: the
  model-parallel group, or the expert one);
- one bucket list when all buckets share the statistics group, else
  ``sqrt(sum(norm_b ** 2))`` in double, as ``ChainedOptimizer.get_grad_norm``.

megatron-core's non-layer-wise Muon holds every gradient on every data-parallel rank
(``use_distributed_optimizer=False``, which the drop-in requires), so nothing is summed over
the data-parallel group: every rank computes the same number from the same gradients.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence

import torch
from megatron.core.optimizer import OptimizerConfig as McOptimizerConfig
from megatron.core.optimizer import _get_param_groups, get_standard_config_overrides
from megatron.core.optimizer.clip_grads import get_grad_norm_fp32
from megatron.core.optimizer.emerging_optimizers import _EMERGING_OPTIMIZERS
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import MegatronModule, param_is_not_shared

__all__ = ["McoreGradNorm"]


class McoreGradNorm:
    """megatron-core's Muon gradient norm over ``model_chunks`` (module docstring).

    Args:
        config: megatron-core ``OptimizerConfig`` the run was started with (its groups'
            weight-decay overrides decide megatron-core's order).
        model_chunks: the model chunks, as given to ``get_megatron_optimizer``.
    """

    def __init__(self, config: McOptimizerConfig, model_chunks: Sequence[MegatronModule]) -> None:
        overrides = get_standard_config_overrides(config)
        # Muon's routing (every parameter but 2-D non-embedding ones to Adam): the same for
        # any matrix optimizer under megatron-core's routing
        routing = copy.deepcopy(_EMERGING_OPTIMIZERS["muon"].default_param_overrides)
        overrides.update(routing)
        buckets: dict[tuple[str, bool], list[torch.nn.Parameter]] = {}
        for group in _get_param_groups(list(model_chunks), config, overrides):
            key = (group.get("optimizer", "muon"), bool(group["is_expert_parallel"]))
            buckets.setdefault(key, []).extend(group["params"])
        groups = ProcessGroupCollection.use_mpu_process_groups()
        #: (parameters in megatron-core's order, statistics group) per sub-optimizer
        self.buckets = [
            (params, groups.tp_ep_pp if expert else groups.mp)
            for (_, expert), params in buckets.items()
            if params
        ]

    def __call__(self) -> float:
        """The global gradient norm, from each parameter's ``main_grad`` (``grad`` without)."""
        grads = [
            [g for g in (_grad(p) for p in params if _counted(p)) if g is not None]
            for params, _ in self.buckets
        ]
        stats = [group for _, group in self.buckets]
        if all(group == stats[0] for group in stats):
            flat = [g for bucket in grads for g in bucket]
            return float(get_grad_norm_fp32(flat, grad_stats_parallel_group=stats[0]))
        norms = [
            float(get_grad_norm_fp32(bucket, grad_stats_parallel_group=group))
            for bucket, group in zip(grads, stats, strict=True)
        ]
        return math.sqrt(sum(n**2 for n in norms))


def _grad(p: torch.nn.Parameter) -> torch.Tensor | None:
    grad = getattr(p, "main_grad", None)
    return p.grad if grad is None else grad


def _counted(p: torch.nn.Parameter) -> bool:
    return param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)
