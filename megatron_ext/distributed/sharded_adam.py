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
index space split evenly over the ranks; with more than one rank the parameters live in one
flat buffer per bucket. Per step and bucket: the gradient reduce-scatter-v
(:class:`~.grad_sync.GradSync`, the layer-wise matrices' path: started from backward once the
bucket's gradients are complete, out of the bucket's region of DDP's grad buffer into receive
buffers allocated once; each rank adds the ``world`` contributions to its range in rank order,
so the sum is the same bits on any backend), ``torch.optim.AdamW`` over the rank's fp32
master ranges, and an in-place all-gather-v (:mod:`.allgather_v`) of the bucket's buffer in
the model dtype. Nothing is allocated or copied per step (a bf16 parameter's range is rounded
from its master). AdamW is element-wise, so each element's update is the single-process one;
the only arithmetic that differs from a replicated AdamW is the gradient sum's order (rank
order here, the backend's ring order in DDP's all-reduce) and the global norm's sum (per rank,
then over ranks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_ext.distributed.allgather_v import AllGatherV, Pending, WireStats
from megatron_ext.distributed.grad_sync import GradSync
from megatron_ext.distributed.layerwise import MASTER_KEY, PARAM_ATTRIBUTES, forward_wait_hooks
from megatron_ext.distributed.plan import BucketLayout
from megatron_ext.distributed.shard_layout import piece_ranges, shard_buckets
from megatron_ext.optimizers.routing import decays_weight

__all__ = ["GRAD_TAG_BASE", "ShardedAdamW"]

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]
#: builds the element-wise optimizer over parameter groups (megatron-core's weight-decay split)
BuildOptimizer = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]


#: bucket ``i``'s gradient messages carry tag ``GRAD_TAG_BASE + i``, apart from the layer-wise
#: matrices' buckets (tags from 0) reduce-scattered over the same group at the same time
GRAD_TAG_BASE = 1 << 20


@dataclass
class _Bucket:
    layout: BucketLayout
    params: list[tuple[str, torch.nn.Parameter]]  # forward order
    buffer: torch.Tensor | None = None  # world > 1: the parameters live here, forward order
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
        decoupled_lr: bool = False,
    ) -> None:
        self.named_params = list(named_params)
        self.gather = gather
        self.rank, self.world = (gather.rank, gather.world) if gather else (0, 1)
        self._params = dict(self.named_params)
        layouts = shard_buckets(
            [(n, p.numel(), str(p.dtype)) for n, p in self.named_params],
            self.world,
            bucket_numel,
            # a tied embedding's first- and last-stage copies: the same element ranges, so
            # megatron-core's all-reduce of their gradients (finalize_model_grads) after the
            # reduce-scatter adds matching ranges
            alone={n for n, p in self.named_params if getattr(p, "shared_embedding", False)},
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
            if self.world > 1:
                self._move_into_buffer(bucket)
        # after the move: an fp32 master is a view of its parameter's storage
        self.masters = {n: self._master(n, p) for n, p in self.named_params}
        # (decays weight, decoupled LR) -> masters. megatron-core gives its decoupled LR to the
        # parameters it marks is_embedding_or_output_parameter (the word embeddings and the
        # output layer): with ``decoupled_lr`` they form their own group, flagged
        # is_decoupled_lr, whose LR the trainer sets from optimizer.decoupled_lr's schedule.
        held: dict[tuple[bool, bool], list[torch.nn.Parameter]] = {}
        for name, p in self.named_params:
            if self.holds(name):
                key = (
                    decays_weight(name, p.shape),
                    decoupled_lr and getattr(p, "is_embedding_or_output_parameter", False),
                )
                held.setdefault(key, []).append(self.masters[name])
        groups: list[dict[str, Any]] = []
        for (decays, decoupled), params in sorted(
            held.items(), key=lambda kv: (not kv[0][0], kv[0][1])
        ):
            group: dict[str, Any] = {"params": params}
            if not decays:
                group["weight_decay"] = 0.0
            if decoupled:
                group["is_decoupled_lr"] = True
            groups.append(group)
        # a rank may hold no element at all (more ranks than elements): an optimizer over an
        # empty parameter keeps the interface (param_groups) without state
        self.optimizer = build(groups or [{"params": [], "weight_decay": 0.0}])
        # gradients: the buckets' layout is rank-major as it is (rank r's range is counts[r]
        # consecutive elements), the reduce-scatter-v layout of the layer-wise matrices
        self.grad_sync = GradSync(
            [([(n, p.numel()) for n, p in b.params], b.layout.counts) for b in self.buckets],
            [],
            self.rank,
            self.world,
            gather.group if gather else None,
            tag_base=GRAD_TAG_BASE,
        )

    @torch.no_grad()
    def _move_into_buffer(self, bucket: _Bucket) -> None:
        """Give ``bucket`` one flat buffer in its dtype, its parameters in forward order, and make
        each parameter a view of its place (values unchanged; the ``Parameter`` objects, and so
        the model's references, stay the same): the all-gather then runs in place, nothing is
        allocated or copied per step."""
        first = bucket.params[0][1]
        bucket.buffer = first.new_empty(bucket.layout.numel)
        for name, p in bucket.params:
            at = self._offset[name]
            place = bucket.buffer[at : at + p.numel()].view_as(p)
            place.copy_(p)
            p.data = place

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

    # -- gradients: reduce-scatter-v of each bucket to the ranks holding its ranges ------------
    def set_grads(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        """Each master's gradient: its range of the (summed) gradient, as fp32 (a view of an
        fp32 gradient, not a copy)."""
        for name, g in grads.items():
            if name not in self.masters:
                continue
            lo, hi = self._range[name]
            self.masters[name].grad = None if g is None else g.reshape(-1)[lo:hi].float()

    @property
    def grad_wire(self) -> WireStats:
        """Payload bytes of the gradient reduce-scatters, cumulative (assignable, to reset)."""
        return self.grad_sync.wire

    @grad_wire.setter
    def grad_wire(self, wire: WireStats) -> None:
        self.grad_sync.wire = wire

    @property
    def grad_numel(self) -> int:
        """Elements of gradient storage :meth:`bind_grad_storage` lays out."""
        return self.grad_sync.numel

    def bind_grad_storage(self, storage: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
        """Lay the gradients out in ``storage`` (1-D, e.g. a region of DDP's grad buffer)
        bucket after bucket, each in its forward order, so that a bucket's region is its
        reduce-scatter's send buffer as it is and this rank's ranges of the sums land in place
        (:class:`~.grad_sync.GradSync`, receive buffers allocated here, once); ``scale``
        (DDP's 1/dp) is applied before the sum. Returns each parameter's 1-D view."""
        return self.grad_sync.bind(storage, scale)

    def grad_ready(self, name: str) -> None:
        """Backward completed ``name``'s gradient: a bucket whose gradients are all complete
        starts its reduce-scatter-v, later buckets first (:meth:`.GradSync.grad_ready`). The
        word embeddings complete last, so their bucket starts at the end of backward."""
        self.grad_sync.grad_ready(name)

    def finish_grad_sync(self) -> None:
        """Start what backward did not, wait for every bucket and add the contributions in rank
        order; afterwards this rank's ranges of the bound storage hold the sums."""
        self.grad_sync.finish()

    @torch.no_grad()
    def reduce_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Sum each gradient over the group into this rank's range of it, in place, for
        gradients that live outside a bound storage (``grads[name]`` already scaled, e.g. by
        1/dp): copied into the sync's own storage (allocated once), reduced as under DDP, this
        rank's ranges copied back; outside them a rank keeps its local values, which nothing
        reads."""
        if self.world == 1:
            return
        sync = self.grad_sync
        sync.reduce_copies(grads)
        for name, view in sync.views.items():
            g = grads[name].view(-1)
            lo, hi = self._range[name]
            if hi > lo and g.data_ptr() != view.data_ptr():
                g[lo:hi].copy_(view[lo:hi])

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
        """Round this rank's updated masters into the model dtype, in place in the parameters
        (an fp32 master is its parameter's range already), and start the bucket's in-place
        all-gather."""
        for name, p in bucket.params:
            lo, hi = self._range[name]
            if hi > lo and p.dtype != torch.float32:
                p.view(-1)[lo:hi].copy_(self.masters[name])
        if bucket.buffer is not None and self.gather is not None:
            bucket.pending = self.gather.start(bucket.buffer, bucket.layout.counts)

    @torch.no_grad()
    def wait_bucket(self, bucket: _Bucket) -> None:
        """Wait for ``bucket``'s all-gather: the other ranks' ranges have then arrived in
        place."""
        if bucket.pending is None:
            return
        bucket.pending.wait()
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
