"""Readers of optimizer-state checkpoints in layouts older than today's name-keyed form.

Today every optimizer's state is keyed by parameter,
``optimizer.layerwise.<state key>.<model shard tag>``
(:meth:`~megatron_ext.megatron.optimizer.MegatronExtOptimizer.named_sharded_state`). Two older
layouts are still read, here and nowhere else:

* **model-laid-out AdamW** (``optimizer.name=adamw`` up to commit 02f9e04): torch AdamW's state as
  megatron-core's ``optim_state_to_sharding_state`` lays it out, ``optimizer.state.<exp_avg |
  exp_avg_sq>.<model key>`` shaped like each parameter's shard, the fp32 masters of bf16
  parameters as ``optimizer.state.fp32_param.<model key>``, and one step for all parameters in
  the common state (``optimizer.optimizer.state.common_step``);
* **KL-SOAP's explicit factors** (before commit 7b2e38b held them as ``L·Q``): ``factor_l`` /
  ``factor_r`` instead of ``factor_basis_l`` / ``factor_basis_r``. They are asked for under their
  old names and loaded as such; KL-SOAP's next step converts them (``optimizers/kl_soap.py``).

:func:`older_layout` is the one dispatch (called by the optimizer adapter when it loads a
checkpoint); the reader it returns says what to ask dist_checkpointing for, and what comes back
is today's form, ``{"layerwise": {name: {state key: value}}}``: nothing after the load knows
where the state came from. Tested on checkpoints written by the old code
(``tests/fixtures/legacy_*``, ``tests/test_checkpoint_legacy.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import make_sharded_optimizer_tensor

from megatron_ext.optimizers.kl_soap import LEGACY_STATE_KEYS

if TYPE_CHECKING:
    from megatron_ext.megatron.optimizer import MegatronExtOptimizer

__all__ = ["ExplicitKLSoapFactors", "ModelLaidOutAdamW", "OlderLayout", "older_layout"]

MODEL_LAID_OUT_PREFIX = "optimizer.state"


class OlderLayout(Protocol):
    def sharded_state(self, opt: MegatronExtOptimizer, model_sd: dict) -> dict[str, Any]:
        """What ``opt`` asks dist_checkpointing for; loads as ``{"layerwise": named state}``."""
        ...


def older_layout(checkpoint_dir: str | Path, state_prefix: str) -> OlderLayout | None:
    """The reader of ``checkpoint_dir``'s optimizer state, or None when it is today's form
    (name-keyed state under ``state_prefix``, the optimizer's own)."""
    keys = set(dist_checkpointing.load_tensors_metadata(str(checkpoint_dir)))
    if any(k.startswith(f"{MODEL_LAID_OUT_PREFIX}.") for k in keys):
        common = dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
        return ModelLaidOutAdamW(common["optimizer"]["optimizer"]["state"]["common_step"])
    old = tuple(f"{state_prefix}.{name}." for name in LEGACY_STATE_KEYS.values())
    if any(k.startswith(old) for k in keys):
        return ExplicitKLSoapFactors(keys, state_prefix)
    return None


@dataclasses.dataclass(frozen=True)
class ModelLaidOutAdamW:
    """AdamW state laid out like the model (see the module docstring).

    Each parameter's entry is a ShardedTensorFactory: it asks for the parameter's moments (and
    master) under their old keys, with the model shard's layout and replica (as the old code
    wrote them; SwiGLU's fc1, itself a factory, included), and merges them into that
    parameter's name-keyed entry, with the checkpoint's one step as each parameter's ``step``.
    """

    step: torch.Tensor  # the common step of every parameter, a 0-dim tensor

    def sharded_state(self, opt: MegatronExtOptimizer, model_sd: dict) -> dict[str, Any]:
        shards = opt.model_shards(model_sd)
        entries = {}
        for name, st in opt.optimizer.named_state().items():
            tensors = {k: v for k, v in st.items() if torch.is_tensor(v) and v.dim() > 0}
            scalars = set(st) - set(tensors)
            if scalars - {"step"}:
                raise ValueError(
                    f"{name}: state {sorted(scalars)} has no counterpart in the model-laid-out "
                    f"AdamW layout (only 'step')"
                )
            entries[name] = self._entry(name, shards[name], tensors)
        return {"layerwise": entries}

    def _entry(
        self, name: str, model_shard: Any, tensors: Mapping[str, torch.Tensor]
    ) -> ShardedTensorFactory:
        old = {
            k: make_sharded_optimizer_tensor(model_shard, t, prefix=f"{MODEL_LAID_OUT_PREFIX}.{k}")
            for k, t in tensors.items()
        }

        def build(*_: Any) -> dict[str, Any]:
            return {
                k: t.build() if isinstance(t, ShardedTensorFactory) else t for k, t in old.items()
            }

        def merge(loaded: dict[str, Any]) -> dict[str, Any]:
            entry = {
                k: old[k].merge_fn(v) if isinstance(old[k], ShardedTensorFactory) else v
                for k, v in loaded.items()
            }
            entry["step"] = self.step.clone()
            return entry

        first = next(iter(tensors.values()))
        return ShardedTensorFactory(f"legacy.{name}", first, build, merge)


@dataclasses.dataclass(frozen=True)
class ExplicitKLSoapFactors:
    """Today's layout, with KL-SOAP's factor products asked for as the factors themselves
    (under ``factor_l`` / ``factor_r``) where the checkpoint holds only those."""

    saved_keys: Collection[str]
    state_prefix: str

    def sharded_state(self, opt: MegatronExtOptimizer, model_sd: dict) -> dict[str, Any]:
        prefix = self.state_prefix
        state = opt.named_sharded_state(model_sd)
        for entry in state["layerwise"].values():
            for new, old in LEGACY_STATE_KEYS.items():
                sharded = entry.get(new)
                if not isinstance(sharded, ShardedTensor) or sharded.key in self.saved_keys:
                    continue
                old_key = sharded.key.replace(f"{prefix}.{new}.", f"{prefix}.{old}.", 1)
                if old_key in self.saved_keys:
                    entry[old] = dataclasses.replace(entry.pop(new), key=old_key)
        return state
