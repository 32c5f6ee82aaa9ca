"""AdamW with ZeRO-1 semantics: fp32 masters and both moments element-sharded over the
data-parallel group, gradients reduce-scattered, the updated shards all-gathered.

This is what megatron-core's ``DistributedOptimizer`` (``--use-distributed-optimizer``) does for
Adam, built on this project's variable-size collectives rather than on megatron-core's class,
for three reasons found by reading both:

* megatron-core's ``DistributedOptimizer`` shards the ranges of DDP's grad buffers, so it needs
  DDP with ``use_distributed_optimizer=True``: every gradient is then reduce-scattered into
  element ranges. The layer-wise optimizer needs whole gradients of the matrices it updates,
  so Muon / KL-SOAP runs could not shard their AdamW part that way; here one class serves both
  plain AdamW and the AdamW-routed parameters (embeddings, output layer, norms) of a
  matrix-optimizer run, over the same group and buckets as the layer-wise part beside it.
* Its state is checkpointed in its own bucket layouts (``dp_reshardable``,
  ``fully_reshardable``); this project's checkpoint form is keyed by parameter and loads at any
  data-parallel size. Each rank here writes its element range of each parameter as blocks of
  the parameter's own shape (:func:`~.shard_layout.rectangles`), under the same keys as a whole
  tensor, so a checkpoint saved at one data-parallel size is read at another by
  dist_checkpointing itself.
* It allocates ``device='cuda'`` buffers and needs megatron-core's fused kernels; this runs the
  same code on a CPU host (gloo) and on GPUs (NCCL).

Layout (:mod:`.shard_layout`): buckets of parameters in forward order, each bucket's flat
index space split evenly over the ranks. Per step and bucket: the gradient reduce-scatter
(one ``all_to_all_single``; each rank sums the ``world`` contributions to its range in rank
order, so the sum is the same bits on any backend), ``torch.optim.AdamW`` over the rank's
fp32 master ranges, and an all-gather-v (:mod:`.allgather_v`) of the updated ranges in the
model dtype. AdamW is element-wise, so each element's update is the single-process one; the
only arithmetic that differs from a replicated AdamW is the gradient sum's order (rank order
here, the backend's ring order in DDP's all-reduce) and the global norm's sum (per rank, then
over ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ext.distributed.allgather_v import AllGatherV, Pending, WireStats
from megatron_ext.distributed.layerwise import MASTER_KEY, PARAM_ATTRIBUTES, forward_wait_hooks
from megatron_ext.distributed.plan import BucketLayout
from megatron_ext.distributed.shard_layout import piece_ranges, rank_range, shard_buckets
from megatron_ext.optimizers.routing import decays_weight

__all__ = ["ShardedAdamW", "reduce_scatter_flat"]

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]
#: builds the element-wise optimizer over parameter groups (megatron-core's weight-decay split)
BuildOptimizer = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


def reduce_scatter_flat(
    send: torch.Tensor, counts: Sequence[int], rank: int, group: Any, wire: WireStats
) -> torch.Tensor:
    """Sum the flat ``send`` (this rank's contribution, ``sum(counts)`` elements) over
    ``group``; returns this rank's range ``counts[rank]`` of the sum, added in rank order."""
    world = len(counts)
    mine = counts[rank]
    recv = send.new_empty(world * mine)
    torch.distributed.all_to_all_single(recv, send, [mine] * world, list(counts), group=group)
    parts = recv.view(world, mine)
    total = parts[0].clone()
    for r in range(1, world):
        total += parts[r]
    size = send.element_size()
    wire.sent += (send.numel() - mine) * size
    wire.received += (world - 1) * mine * size
    return total


@dataclass
class _Bucket:
    layout: BucketLayout
    params: list[tuple[str, torch.nn.Parameter]]  # forward order
    pending: Pending | None = None


class ShardedAdamW:
    """Element-sharded AdamW over the data-parallel group of ``gather``.

    Args:
        named_params: the parameters, forward order, replicated on every rank of the group.
        build: makes the optimizer (AdamW) over parameter groups of this rank's fp32 ranges.
        gather: the all-gather-v backend over the data-parallel group; ``None``: one rank.
        bucket_numel: elements per bucket (a bucket closes before it would exceed it).

    A rank holds, per parameter, the elements ``[lo, hi)`` of its flattened tensor
    (:meth:`flat_range`); ``master(name)`` is that range as a 1-D fp32 parameter (for an fp32
    parameter a view of the parameter itself, as megatron-core's fp32 parameters are their own
    masters; possibly empty).
    """

    def __init__(
        self,
        named_params: NamedParams,
        build: BuildOptimizer,
        gather: AllGatherV | None = None,
        bucket_numel: int = 4_000_000,
    ) -> None:
        self.named_params = list(named_params)
        self.gather = gather
        self.rank, self.world = (gather.rank, gather.world) if gather else (0, 1)
        self._params = dict(self.named_params)
        layouts = shard_buckets(
            [(n, p.numel(), str(p.dtype)) for n, p in self.named_params],
            self.world,
            bucket_numel,
        )
        self.buckets = [_Bucket(b, [(n, self._params[n]) for n in b.members]) for b in layouts]
        self._range: dict[str, tuple[int, int]] = {}
        self._offset: dict[str, int] = {}  # where the parameter starts in its bucket
        for bucket in self.buckets:
            numels = [p.numel() for _, p in bucket.params]
            pieces = piece_ranges(bucket.layout, numels, self.rank)
            for (name, _), (lo, hi, at) in zip(bucket.params, pieces, strict=True):
                self._range[name] = (lo, hi)
                self._offset[name] = at - lo
        self.masters = {n: self._master(n, p) for n, p in self.named_params}
        decay, no_decay = [], []
        for name, p in self.named_params:
            if self.holds(name):
                (decay if decays_weight(name, p.shape) else no_decay).append(self.masters[name])
        groups: list[dict[str, Any]] = []
        if decay:
            groups.append({"params": decay})
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        # a rank may hold no element at all (more ranks than elements): an optimizer over an
        # empty parameter keeps the interface (param_groups) without state
        self.optimizer = build(groups or [{"params": [], "weight_decay": 0.0}])
        self.grad_wire = WireStats()

    def _master(self, name: str, p: torch.nn.Parameter) -> torch.nn.Parameter:
        lo, hi = self._range[name]
        flat = p.detach().view(-1)[lo:hi]
        # fp32: the parameter's own storage (updated in place, nothing copied back)
        master = torch.nn.Parameter(flat if p.dtype == torch.float32 else flat.float())
        for attr in PARAM_ATTRIBUTES:
            if hasattr(p, attr):
                setattr(master, attr, getattr(p, attr))
        return master

    # -- ranges -------------------------------------------------------------------------
    def flat_range(self, name: str) -> tuple[int, int]:
        """``[lo, hi)``: the elements of flattened ``name`` this rank holds."""
        return self._range[name]

    def holds(self, name: str) -> bool:
        lo, hi = self._range[name]
        return hi > lo

    def counts_toward_norm(self, name: str) -> bool:
        """Every rank counts its own range (empty or not): the ranges partition the tensor."""
        return True

    def saves(self, name: str) -> bool:
        return self.holds(name)

    def master(self, name: str) -> torch.nn.Parameter:
        return self.masters[name]

    def master_bytes(self) -> int:
        """Bytes of fp32 masters separate from the parameters (0 for fp32 parameters)."""
        return sum(
            4 * m.numel() for n, m in self.masters.items() if self._params[n].dtype != torch.float32
        )

    # -- gradients ------------------------------------------------------------------------
    def set_grads(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        """Each master's gradient: its range of the (summed) gradient, as fp32 (a view of an
        fp32 gradient, not a copy)."""
        for name, g in grads.items():
            if name not in self.masters:
                continue
            lo, hi = self._range[name]
            self.masters[name].grad = None if g is None else g.reshape(-1)[lo:hi].float()

    @torch.no_grad()
    def reduce_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Sum each gradient over the group into this rank's range of it, in place, one
        reduce-scatter per bucket (``grads[name]`` already scaled, e.g. by 1/dp); outside its
        range a rank keeps its local values, which nothing reads."""
        if self.world == 1:
            return
        for bucket in self.buckets:
            names = [n for n, _ in bucket.params]
            self._reduce_bucket(bucket, torch.cat([grads[n].reshape(-1) for n in names]), grads)

    def _reduce_bucket(
        self, bucket: _Bucket, send: torch.Tensor, grads: Mapping[str, torch.Tensor]
    ) -> None:
        """Reduce-scatter one bucket's flat contribution ``send`` and write this rank's ranges
        of the sums into ``grads``."""
        group = self.gather.group if self.gather else None
        total = reduce_scatter_flat(send, bucket.layout.counts, self.rank, group, self.grad_wire)
        start, _ = rank_range(bucket.layout, self.rank)
        for name, _ in bucket.params:
            lo, hi = self._range[name]
            if hi > lo:
                at = self._offset[name] + lo - start
                grads[name].view(-1)[lo:hi].copy_(total[at : at + hi - lo])

    # -- gradient sync under DDP (MegatronExtOptimizer.take_over_grad_sync) ---------------
    @property
    def grad_numel(self) -> int:
        """Elements of gradient storage :meth:`bind_grad_storage` lays out."""
        return sum(p.numel() for _, p in self.named_params)

    def bind_grad_storage(self, storage: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
        """Lay the gradients out in ``storage`` (1-D, e.g. a region of DDP's grad buffer)
        bucket after bucket, each bucket contiguous in its own order, so that a bucket's
        region is its reduce-scatter's send buffer as it is (no concatenation); ``scale``
        (DDP's 1/dp) is applied before the sum. Returns each parameter's 1-D view."""
        if storage.dim() != 1 or storage.numel() < self.grad_numel:
            raise ValueError(
                f"gradient storage of shape {tuple(storage.shape)} cannot hold the "
                f"{self.grad_numel} gradient elements of the element-sharded AdamW"
            )
        self._grad_scale = scale
        self._grad_views: dict[str, torch.Tensor] = {}
        self._grad_regions: list[torch.Tensor] = []
        at = 0
        for bucket in self.buckets:
            start = at
            for name, p in bucket.params:
                self._grad_views[name] = storage[at : at + p.numel()]
                at += p.numel()
            self._grad_regions.append(storage[start:at])
        return self._grad_views

    def grad_ready(self, name: str) -> None:
        """Backward completed ``name``'s gradient. The AdamW parameters' reduce-scatters run in
        :meth:`finish_grad_sync`, after backward: they are the embeddings, the output layer and
        the norms, whose gradients backward completes last (the word embeddings) or that are
        small, so starting them early would overlap little."""

    def finish_grad_sync(self) -> None:
        """Scale and reduce-scatter every bucket of the bound storage (:meth:`bind_grad_storage`)
        in place; afterwards this rank's ranges hold the sums over the group."""
        regions = getattr(self, "_grad_regions", None)
        if regions is None:
            raise RuntimeError("the gradient sync has no storage: bind_grad_storage() first")
        for region in regions:
            if self._grad_scale != 1.0:
                region.mul_(self._grad_scale)
        if self.world == 1:
            return
        for bucket, region in zip(self.buckets, regions, strict=True):
            self._reduce_bucket(bucket, region, self._grad_views)

    # -- step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Update this rank's ranges, then start each bucket's all-gather (waited for by
        :meth:`finish` or a forward pre-hook, :meth:`attach_forward_hooks`)."""
        self.finish()
        self.optimizer.step()
        for bucket in self.buckets:
            self._launch(bucket)

    def _launch(self, bucket: _Bucket) -> None:
        """Round this rank's updated masters into the model dtype, in the parameters and in
        the bucket's buffer, and start the bucket's all-gather."""
        first = bucket.params[0][1]
        buffer = None
        if self.world > 1:
            buffer = torch.empty(bucket.layout.numel, dtype=first.dtype, device=first.device)
        for name, p in bucket.params:
            lo, hi = self._range[name]
            if hi == lo:
                continue
            master = self.masters[name]
            mine = p.view(-1)[lo:hi]
            if p.dtype != torch.float32:
                mine.copy_(master)
            if buffer is not None:
                at = self._offset[name] + lo
                buffer[at : at + hi - lo].copy_(mine)
        if buffer is not None and self.gather is not None:
            bucket.pending = self.gather.start(buffer, bucket.layout.counts)

    @torch.no_grad()
    def wait_bucket(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s all-gather and write the other ranks' ranges back."""
        if bucket.pending is None:
            return
        buffer = bucket.pending.wait()
        for name, p in bucket.params:
            at = self._offset[name]
            p.view(-1).copy_(buffer[at : at + p.numel()])
        bucket.pending = None

    def finish(self) -> None:
        for bucket in self.buckets:
            self.wait_bucket(bucket)

    def attach_forward_hooks(self, model: torch.nn.Module) -> list[Any]:
        """Wait for each bucket in a forward pre-hook of every module holding one of its
        parameters, as the layer-wise optimizer does (:func:`~.layerwise.forward_wait_hooks`)."""
        buckets = [(b, [n for n, _ in b.params]) for b in self.buckets]
        return forward_wait_hooks(model, buckets, self.wait_bucket)

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy the model parameters into the fp32 masters (after the model was loaded)."""
        for name, p in self.named_params:
            if p.dtype != torch.float32:
                lo, hi = self._range[name]
                self.masters[name].copy_(p.view(-1)[lo:hi])

    # -- torch.optim-like views -------------------------------------------------------------
    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.optimizer]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Mapping[Any, Any]:
        return self.optimizer.state

    # -- name-keyed state: this rank's ranges -------------------------------------------------
    def named_state(self) -> dict[str, dict[str, Any]]:
        """``{name: {state key: value}}`` for the parameters this rank holds elements of: the
        moments as 1-D copies of its range (:meth:`flat_range`), the step counter, and a bf16
        parameter's fp32 master range under ``"fp32_param"``."""
        names = {id(m): n for n, m in self.masters.items()}
        out: dict[str, dict[str, Any]] = {}
        for p, st in self.optimizer.state.items():
            out[names[id(p)]] = {
                k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()
            }
        for name, p in self.named_params:
            if self.holds(name) and p.dtype != torch.float32:
                out.setdefault(name, {})[MASTER_KEY] = self.masters[name].detach().clone()
        return out

    def _local(self, name: str, value: Any) -> Any:
        """``value`` as this rank's range: a 1-D range as it is, a whole tensor sliced."""
        if not torch.is_tensor(value) or value.dim() == 0:
            return value
        lo, hi = self._range[name]
        if value.dim() == 1 and value.numel() == hi - lo:
            return value
        if value.shape == self._params[name].shape:
            return value.reshape(-1)[lo:hi]
        raise ValueError(
            f"optimizer state for {name} has shape {tuple(value.shape)}, neither the "
            f"parameter's {tuple(self._params[name].shape)} nor this rank's {hi - lo} elements: "
            f"the checkpoint was written for a different model"
        )

    def load_named_state(self, named: Mapping[str, Mapping[str, Any]]) -> None:
        """Install name-keyed state: per held parameter its range (1-D) or the whole tensor
        (sliced here); a held parameter missing from ``named`` is an error."""
        missing = [n for n, _ in self.named_params if self.holds(n) and n not in named]
        if missing:
            raise ValueError(
                f"optimizer state is missing for {len(missing)} parameters (e.g. {missing[0]}): "
                f"the checkpoint was written for a different model or optimizer"
            )
        self.optimizer.state.clear()
        for name, _ in self.named_params:
            if not self.holds(name):
                continue
            master = self.masters[name]
            st = {
                k: self._local(name, v).detach().clone().to(master.device)
                if torch.is_tensor(v)
                else v
                for k, v in named[name].items()
                if k != MASTER_KEY
            }
            if st:
                self.optimizer.state[master] = st
            if MASTER_KEY in named[name]:
                with torch.no_grad():
                    master.copy_(self._local(name, named[name][MASTER_KEY]))

    def state_dict(self) -> dict[str, Any]:
        return {"state": self.named_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load_named_state(state["state"])
