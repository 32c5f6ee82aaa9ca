"""Loading checkpoints written before bf16 models ran in megatron-core's ``Float16Module``.

Until then a bf16 model kept its norms in fp32 (the local spec's norms ignore ``params_dtype``):
their fp32 value was saved as the model weight, and no fp32 master was saved for them, since an
fp32 parameter is its own master. Today every parameter of a bf16 model is bf16 with an fp32
master, so loading such a checkpoint would ask for masters it does not hold. :func:`load` is
``dist_checkpointing.load`` that reads a weight saved in fp32 in fp32, into the parameter's
master: bit for bit the value the old run trained with. Every other entry is asked for as it
is; a checkpoint that holds its masters loads exactly as before.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.utils import extract_matching_values

__all__ = ["load"]

# optimizer.layerwise.fp32_param.<model key>@<offsets> (name-keyed state) or
# optimizer.state.fp32_param.<model key> (megatron-core's model-laid-out optimizer state)
_MASTER = re.compile(r"\.fp32_param\.(?P<key>[^@]+)(?:@(?P<offsets>[\d_]+))?$")


def load(sharded_state_dict: dict[str, Any], checkpoint_dir: str | Path) -> dict[str, Any]:
    """``dist_checkpointing.load(sharded_state_dict, checkpoint_dir)``, where a weight saved in
    fp32 is read in fp32 (into its master when this rank's optimizer asks for a master the
    checkpoint lacks; the bf16 parameter is then its rounding, as after any step)."""
    saved = dist_checkpointing.load_tensors_metadata(str(checkpoint_dir))
    # as dist_checkpointing.load does: a copy of the mapping, its factories applied
    sharded_state_dict, _ = extract_matching_values(sharded_state_dict, lambda x: True)
    is_factory = lambda x: isinstance(x, ShardedTensorFactory)  # noqa: E731
    factories, _ = extract_matching_values(sharded_state_dict, is_factory, True)
    apply_factories(sharded_state_dict)

    def fp32_in_checkpoint(key: str) -> bool:
        return key in saved and saved[key].dtype == torch.float32

    model = sharded_state_dict.get("model", {})
    weights = {_where(sh): sh for sh in model.values() if isinstance(sh, ShardedTensor)}
    masters: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def missing_master(sh: Any) -> Any:
        """A master the checkpoint lacks, of a weight it holds in fp32: asked for as that
        weight (its key, layout and replica), into the master."""
        match = _MASTER.search(sh.key) if isinstance(sh, ShardedTensor) else None
        if match is None or sh.key in saved or not fp32_in_checkpoint(match["key"]):
            return sh
        offsets = match["offsets"]
        offset = tuple(int(o) for o in offsets.split("_")) if offsets else tuple(sh.global_offset)
        weight = weights.get((match["key"], offset))
        if weight is None:
            return sh
        masters[(match["key"], offset)] = sh.data
        return dataclasses.replace(weight, data=sh.data, dtype=sh.data.dtype)

    dict_list_map_inplace(missing_master, sharded_state_dict.get("optimizer", {}))
    for name, sh in model.items():
        if not (isinstance(sh, ShardedTensor) and fp32_in_checkpoint(sh.key)):
            continue
        if _where(sh) in masters:  # loaded once, into the master; the model gets it back
            model[name] = LocalNonpersistentObject(masters[_where(sh)])
        elif sh.dtype != torch.float32:  # one dtype per key on every rank
            data = torch.empty(sh.local_shape, dtype=torch.float32, device=sh.data.device)
            model[name] = dataclasses.replace(sh, data=data, dtype=torch.float32)
    loaded = dist_checkpointing.load(sharded_state_dict, str(checkpoint_dir))
    return apply_factory_merges(loaded, factories)


def _where(sh: ShardedTensor) -> tuple[str, tuple[int, ...]]:
    return sh.key, tuple(sh.global_offset)
