"""A whole dist_checkpointing checkpoint in one process's memory: read every tensor, object and
the common state (:func:`read_contents`), write them back as a new checkpoint
(:func:`write_contents`), for ``megatron-ext ckpt upgrade``.

A checkpoint written by N ranks holds each tensor as chunks (one per saved shard, ``offsets`` and
``sizes`` in the tensor's global shape, layer axes included); reading asks for every tensor
whole, so any chunking reads back. Writing keeps the chunks a tensor had (the model's weights are
written exactly as the ranks wrote them) or writes a tensor as one chunk, as the trainers write
their name-keyed optimizer state: either way a reader at any world size reads the same values.
Objects (``ShardedObject``: RNG streams, scalar optimizer state, layers' extra state) are kept
under their unique keys (``<key>/shard_<offset>_<shape>``), so the per-rank ones stay per rank.

Collective over the default process group; the upgrade runs it in a 1-rank group.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

from megatron_ext.megatron.cpu_compat import apply_cpu_compat
from megatron_ext.megatron.save_queue import fork_results_queue

__all__ = ["COMMON_STATE", "Chunk", "Contents", "read_contents", "write_contents"]

#: the object dist_checkpointing keeps the common state in (read by ``load_common_state_dict``)
COMMON_STATE = "common_state"

Chunk = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), in the global shape's axes


@dataclasses.dataclass
class Contents:
    """Everything a checkpoint holds.

    ``tensors``: key -> the whole global tensor. ``chunks``: key -> the chunks it is written in
    (absent: one chunk, the whole tensor). ``objects``: unique key -> value. ``common``: the
    common state (for a GPT checkpoint ``{"loop": {...}, "world": N}``, plus whatever an older
    layout kept there).
    """

    tensors: dict[str, torch.Tensor]
    chunks: dict[str, list[Chunk]]
    objects: dict[str, Any]
    common: dict[str, Any]


def object_key(key: str) -> str:
    """The unique key of a single (unsharded) object ``key``, as the trainers save scalars."""
    return ShardedObject(key, None, (1,), (0,)).unique_key


def read_contents(folder: Path) -> Contents:
    """Every tensor (whole), object and the common state of the checkpoint ``folder``.

    Memory: the whole checkpoint (its tensors' bytes), in this process."""
    metadata = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    request: dict[str, Any] = {}
    chunks: dict[str, list[Chunk]] = {}
    for key, meta in metadata.items():
        if isinstance(meta, TensorStorageMetadata):
            empty = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
            request[key] = ShardedTensor.from_rank_offsets(key, empty, replica_id=0)
            chunks[key] = [(tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks]
        elif isinstance(meta, BytesStorageMetadata) and not key.startswith(f"{COMMON_STATE}/"):
            request[key] = ShardedObject.empty_from_unique_key(key)
    common = dist_checkpointing.load_common_state_dict(str(folder))
    loaded = dist_checkpointing.load(request, str(folder), validate_access_integrity=False)
    tensors = {k: loaded[k] for k, sh in request.items() if isinstance(sh, ShardedTensor)}
    objects = {k: loaded[k] for k, sh in request.items() if isinstance(sh, ShardedObject)}
    whole = {k: c for k, c in chunks.items() if len(c) > 1 or c[0][1] != tensors[k].shape}
    return Contents(tensors, whole, objects, dict(common))


def write_contents(contents: Contents, folder: Path) -> None:
    """Write ``contents`` as a dist_checkpointing checkpoint into the empty folder ``folder``
    (its ``.metadata``, data files and ``metadata.json``; no manifest)."""
    state: dict[str, Any] = {}
    for key, tensor in contents.tensors.items():
        grid = contents.chunks.get(key)
        if grid is None:
            state[key] = ShardedTensor.from_rank_offsets(key, tensor.contiguous(), replica_id=0)
        else:
            state[key] = [_chunk(key, tensor, chunk) for chunk in grid]
    for unique_key, value in contents.objects.items():
        state[unique_key] = dataclasses.replace(
            ShardedObject.empty_from_unique_key(unique_key), data=value
        )
    clash = set(state) & set(contents.common)
    if clash:
        raise ValueError(f"common state keys {sorted(clash)} are also checkpoint keys")
    state.update(contents.common)
    apply_cpu_compat()  # the writer synchronises "the device" (a no-op on a CUDA host)
    fork_results_queue()  # as the trainers save (megatron_ext.megatron.save_queue)
    dist_checkpointing.save(state, str(folder))


def _chunk(key: str, tensor: torch.Tensor, chunk: Chunk) -> ShardedTensor:
    """The ShardedTensor of one chunk of ``tensor`` (a regular grid, as dist_checkpointing
    writes them)."""
    offsets, sizes = chunk
    region = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    rank_offsets = []
    for axis, (offset, size, total) in enumerate(zip(offsets, sizes, tensor.shape, strict=True)):
        if total % size or offset % size:
            raise ValueError(f"{key}: chunk {chunk} is not on a regular grid of {tensor.shape}")
        if size != total:
            rank_offsets.append((axis, offset // size, total // size))
    data = tensor[region].contiguous()
    return ShardedTensor.from_rank_offsets(key, data, *rank_offsets, replica_id=0)
