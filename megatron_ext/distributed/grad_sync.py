"""The layer-wise optimizer's gradient path: bucketed reduce-scatter-v to the owners, started
from backward, over one flat gradient storage and buffers allocated once.

Layout of the storage (``numel`` elements, one dtype): the optimizer's buckets one after the
other, each rank-major (rank ``r``'s owned gradients are ``counts[r]`` consecutive elements,
the layout of :mod:`.reduce_scatter_v`), then the replicated parameters (norms, biases). Each
parameter's gradient is a view of it (:attr:`GradSync.views`): under megatron-core's DDP the
storage is DDP's own fp32 grad buffer, re-laid out once, and ``param.main_grad`` points at
these views, so backward accumulates straight into the send buffers and nothing is copied.

Per step:

* backward: DDP's hook reports each parameter whose gradient is complete
  (:meth:`GradSync.grad_ready`); once all of a bucket's are, its reduce-scatter-v starts,
  scaled first as DDP scales (e.g. by 1/dp). Buckets start in descending index order (the
  order backward completes them) on every rank, whatever order the hooks fire in, so the
  ranks' collectives always match; a bucket waits for the later ones.
* :meth:`GradSync.finish` (DDP's ``finish_grad_sync``): starts what is left (parameters that
  got no gradient), the replicated gradients as one all-gather (the sum is folded locally in
  rank order, so every rank gets the same bits as a rank-ordered sum), waits, and adds each
  bucket's contributions into the owned segment in rank order (:func:`.fold_in_rank_order`).

At one rank nothing is communicated or copied: the storage already holds the sum.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.distributed.allgather_v import WireStats
from megatron_ext.distributed.reduce_scatter_v import fold_in_rank_order, start_reduce_scatter_v

__all__ = ["GradBucket", "GradSync"]


@dataclass
class GradBucket:
    """One bucket of the storage: ``names`` rank-major from element ``start``."""

    index: int
    names: list[str]
    start: int
    counts: list[int]  # elements per owner rank
    recv: torch.Tensor | None = None  # (world − 1, counts[rank]), allocated once
    handles: list[Any] = field(default_factory=list)
    ready: set[str] = field(default_factory=set)  # gradients backward completed this step
    launched: bool = False

    @property
    def numel(self) -> int:
        return sum(self.counts)


class GradSync:
    """Gradient sync of one layer-wise optimizer (see the module docstring).

    Args:
        buckets: per bucket, its ``(name, numel)`` pairs rank-major and the elements per owner
            rank.
        replicated: ``(name, numel)`` of the parameters every rank updates.
        rank, world, group: this rank in the data-parallel ``group`` of ``world`` ranks.
        events: when a list, ``("grad_launch", bucket)`` and ``("grad_wait", bucket)`` are
            appended as they happen (bucket ``-1``: the replicated gradients).
        tag_base: bucket ``i``'s point-to-point messages carry tag ``tag_base + i``: two syncs
            over one group in flight together (the layer-wise matrices and the element-sharded
            AdamW parameters beside them) need disjoint tags on gloo, which matches by tag.
    """

    def __init__(
        self,
        buckets: Sequence[tuple[Sequence[tuple[str, int]], Sequence[int]]],
        replicated: Sequence[tuple[str, int]],
        rank: int,
        world: int,
        group: Any,
        events: list[tuple[str, int]] | None = None,
        tag_base: int = 0,
    ) -> None:
        self.rank, self.world, self.group, self.events = rank, world, group, events
        self.tag_base = tag_base
        self.layout: dict[str, tuple[int, int]] = {}  # name -> (start, numel) in the storage
        self.bucket_of: dict[str, int] = {}  # name -> bucket index, -1 = replicated
        self.buckets: list[GradBucket] = []
        offset = 0
        for i, (members, counts) in enumerate(buckets):
            self.buckets.append(GradBucket(i, [n for n, _ in members], offset, list(counts)))
            for name, numel in members:
                self.layout[name], self.bucket_of[name] = (offset, numel), i
                offset += numel
        self.replicated_start = offset
        self.replicated = [n for n, _ in replicated]
        for name, numel in replicated:
            self.layout[name], self.bucket_of[name] = (offset, numel), -1
            offset += numel
        self.numel = offset
        self.replicated_numel = offset - self.replicated_start
        self.storage: torch.Tensor | None = None
        self.views: dict[str, torch.Tensor] = {}  # name -> 1-D view of the storage
        self.scale = 1.0
        self.wire = WireStats()  # the buckets' reduce-scatter payload, cumulative
        self.replicated_wire = WireStats()  # the replicated gradients' all-gather payload
        self._replicated_recv: torch.Tensor | None = None
        self._replicated_handle: Any = None
        self._next = len(self.buckets) - 1  # the next bucket to launch (descending order)

    # -- storage ------------------------------------------------------------------------------
    def bind(self, storage: torch.Tensor, scale: float = 1.0) -> dict[str, torch.Tensor]:
        """Use ``storage`` (1-D, at least :attr:`numel` elements; its first ``numel`` are laid
        out as above) for the gradients, scaled by ``scale`` before they are summed; allocates
        the receive buffers. Returns each parameter's 1-D view."""
        if storage.dim() != 1 or storage.numel() < self.numel:
            raise ValueError(
                f"gradient storage of shape {tuple(storage.shape)} cannot hold the "
                f"{self.numel} gradient elements of this optimizer"
            )
        self.storage, self.scale = storage, scale
        self.views = {n: storage[s : s + k] for n, (s, k) in self.layout.items()}
        if self.world > 1:
            others = self.world - 1
            recv = storage.new_empty(others * sum(b.counts[self.rank] for b in self.buckets))
            at = 0
            for b in self.buckets:
                mine = b.counts[self.rank]
                b.recv = recv[at : at + others * mine].view(others, mine)
                at += others * mine
            self._replicated_recv = storage.new_empty(self.world * self.replicated_numel)
        return self.views

    def allocate(self, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """Bind a storage of its own (for gradients that live elsewhere and are copied in)."""
        return self.bind(torch.zeros(self.numel, dtype=dtype, device=device))

    # -- per step -----------------------------------------------------------------------------
    def reduce_copies(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Reduce gradients held outside a bound storage (``reduce_grads`` of the unit tests and
        benchmarks): allocate the sync's own storage once (``grads``' dtype and device), copy
        each gradient in unless it already is its view, and run :meth:`finish`. The caller
        copies back what it owns."""
        if self.storage is None:
            first = next(iter(grads.values()))
            self.allocate(first.dtype, first.device)
        for name, view in self.views.items():
            g = grads[name]
            if g.data_ptr() != view.data_ptr():
                view.copy_(g.reshape(-1))
        self.finish()

    def grad_ready(self, name: str) -> None:
        """Backward has completed ``name``'s gradient (for this step's last micro-batch)."""
        index = self.bucket_of[name]
        if index < 0 or self.storage is None:
            return  # replicated gradients go together in finish()
        ready = self.buckets[index].ready
        if name in ready:
            raise RuntimeError(
                f"the gradient of {name} was reported complete twice before finish_grad_sync: "
                "run every micro-batch but a step's last under DDP's no_sync()"
            )
        ready.add(name)
        while self._next >= 0:
            bucket = self.buckets[self._next]
            if len(bucket.ready) < len(bucket.names):
                break
            self._launch(bucket)
            self._next -= 1

    def _bound(self) -> torch.Tensor:
        """The bound storage; an error before :meth:`bind` / :meth:`allocate`."""
        if self.storage is None:
            raise RuntimeError("the gradient sync has no storage: bind() or allocate() first")
        return self.storage

    def _launch(self, bucket: GradBucket) -> None:
        if self.scale == 1.0 and self.world == 1:  # one rank's gradient is the sum: nothing
            bucket.launched = True
            self._record("grad_launch", bucket.index)
            return
        region = self._bound()[bucket.start : bucket.start + bucket.numel]
        if self.scale != 1.0:
            region.mul_(self.scale)  # DDP's gradient_scaling_factor, before the sum
        if self.world > 1:
            assert bucket.recv is not None  # allocated by bind() for a world over 1
            bucket.handles = start_reduce_scatter_v(
                region,
                bucket.recv,
                bucket.counts,
                self.rank,
                self.group,
                self.wire,
                self.tag_base + bucket.index,
            )
        bucket.launched = True
        self._record("grad_launch", bucket.index)

    def _launch_replicated(self) -> None:
        if self.scale != 1.0 or self.world > 1:
            self._launch_replicated_region()
        self._record("grad_launch", -1)

    def _launch_replicated_region(self) -> None:
        region = self._bound()[self.replicated_start : self.numel]
        if self.scale != 1.0:
            region.mul_(self.scale)
        if self.world > 1 and self.replicated_numel:
            self._replicated_handle = dist.all_gather_into_tensor(
                self._replicated_recv, region, group=self.group, async_op=True
            )
            size = region.element_size()
            self.replicated_wire.sent += region.numel() * size
            self.replicated_wire.received += (self.world - 1) * region.numel() * size

    @torch.no_grad()
    def finish(self) -> None:
        """Start what backward did not, wait for everything, fold the sums (see the module
        docstring); afterwards the owned and replicated gradients hold the sums over ranks,
        the others this rank's scaled contribution."""
        if self.storage is None:
            raise RuntimeError("the gradient sync has no storage: bind() or allocate() first")
        for bucket in reversed(self.buckets):
            if not bucket.launched:
                self._launch(bucket)
        self._launch_replicated()
        if self._replicated_handle is not None:
            self._replicated_handle.wait()
            assert self._replicated_recv is not None  # bound with a replicated region
            rows = self._replicated_recv.view(self.world, self.replicated_numel)
            region = self._bound()[self.replicated_start : self.numel]
            region.copy_(rows[0])
            for r in range(1, self.world):
                region.add_(rows[r])
            self._replicated_handle = None
        self._record("grad_wait", -1)
        for bucket in reversed(self.buckets):
            for handle in bucket.handles:
                handle.wait()
            if bucket.handles:
                own = sum(bucket.counts[: self.rank])
                start = bucket.start + own
                owned = self._bound()[start : start + bucket.counts[self.rank]]
                assert bucket.recv is not None  # a bucket with handles received into it
                fold_in_rank_order(owned, bucket.recv, self.rank)
            bucket.handles, bucket.launched = [], False
            bucket.ready.clear()
            self._record("grad_wait", bucket.index)
        self._next = len(self.buckets) - 1

    def _record(self, what: str, index: int) -> None:
        if self.events is not None:
            self.events.append((what, index))
