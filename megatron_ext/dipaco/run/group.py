"""A multi-rank worker: ``dipaco.ranks_per_worker`` = R consecutive global ranks train one path
data-parallel, as one worker of the queue.

- The worker's first rank (the *leader*) is the only one that talks to the queue as a worker:
  it claims, renews the lease, writes the task's files and completes it. It sends each claimed
  ``train`` task to the other ranks (the *followers*) over a gloo group (``broadcast``); every
  other kind of task (prepare, base, route, outer, score, final, eval) runs on the leader alone
  while the followers wait for the next train task, or for the end of the run.
- Inside a train task the R ranks split each inner step's micro-batches (contiguously: rank r
  takes micro-batches ``r·n/R ... (r+1)·n/R − 1`` of n), compute each micro-batch's gradient on
  its own, all-gather them, and add them **in micro-batch order**, exactly as the one-rank
  worker accumulates them in ``.grad``: every rank then holds the one-rank gradient bit for
  bit, takes the same optimizer step, and the modules a 2-rank worker writes are bit-identical
  to a 1-rank worker's. A sum reduction would change the order of the additions, and the bits:
  adding the two ranks' partial sums instead moves ``dipaco_tiny``'s final modules by up to
  4e-7 after 2 phases of the test run (tests/test_dipaco_trainer.py shows the bit-identity;
  the partial-sum variant fails it).
  The cost: each rank receives n gradient vectors per step instead of one.
- Whether the lease was lost is the leader's to say; it is agreed at every inner step
  (:meth:`WorkerGroup.agree`), so all ranks drop a lost task at the same step.

The control group has a long timeout: followers wait in a broadcast for as long as the leader
works alone (a base run can take hours). A rank that crashes takes its worker down (torchrun
stops the job's other local ranks); its task is re-leased when the lease expires.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_ext.errors import TrainingDivergedError

__all__ = ["WorkerGroup", "data_parallel_inner_steps"]

CONTROL_TIMEOUT = timedelta(days=7)
LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


@dataclass(frozen=True)
class WorkerGroup:
    """This rank's worker: global ``ranks`` (the first is the leader) and this rank's index in
    them. A one-rank worker has no groups and never communicates."""

    ranks: tuple[int, ...]
    index: int
    control: Any = None  # gloo group: tasks and lease agreement
    data: Any = None  # default-backend group: gradients

    @classmethod
    def single(cls) -> WorkerGroup:
        return cls((0,), 0)

    @classmethod
    def form(cls, ranks_per_worker: int) -> WorkerGroup:
        """Split the job's ranks into workers of ``ranks_per_worker`` consecutive ranks
        (collective over the whole job: every rank makes every group, in the same order)."""
        if ranks_per_worker == 1 or not dist.is_initialized():
            return cls.single()
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % ranks_per_worker:
            raise ValueError(f"{world} ranks do not split into workers of {ranks_per_worker}")
        mine = None
        for first in range(0, world, ranks_per_worker):
            ranks = list(range(first, first + ranks_per_worker))
            control = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT)
            data = dist.new_group(ranks)
            if rank in ranks:
                mine = cls(tuple(ranks), ranks.index(rank), control, data)
        assert mine is not None
        return mine

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def leader(self) -> bool:
        return self.index == 0

    def broadcast(self, obj: Any = None) -> Any:
        """The leader's ``obj`` on every rank of the worker."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=self.ranks[0], group=self.control)
        return box[0]

    def agree(self, lost: bool) -> bool:
        """The leader's ``lost`` on every rank (followers pass anything)."""
        if self.size == 1:
            return lost
        flag = torch.tensor([int(lost)], dtype=torch.int64)
        dist.broadcast(flag, src=self.ranks[0], group=self.control)
        return bool(flag.item())

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        """(R·k, d): every rank's (k, d) ``local`` rows, rank by rank."""
        parts = [torch.empty_like(local) for _ in self.ranks]
        dist.all_gather(parts, local.contiguous(), group=self.data)
        return torch.cat(parts)


def data_parallel_inner_steps(
    model: torch.nn.Module,
    optimizer: Any,
    batches: Iterable[list[torch.Tensor]],
    lrs: Sequence[float],
    loss_fn: LossFn,
    group: WorkerGroup,
    where: str = "",
) -> list[float]:
    """:func:`megatron_ext.dipaco.steps.inner.inner_steps` over ``group``'s ranks, with the same
    results bit for bit (see the module docstring). ``batches``: each step's n micro-batches,
    n divisible by the group size; returns the steps' losses (the mean over micro-batches)."""
    params = [p for p in model.parameters() if p.requires_grad]
    losses = []
    model.train()
    for k, (lr, micro) in enumerate(zip(lrs, batches, strict=False)):
        n = len(micro)
        if n % group.size:
            raise ValueError(f"{n} micro-batches do not split over {group.size} ranks")
        share = n // group.size
        mine = micro[group.index * share : (group.index + 1) * share]
        rows, values, used = [], [], None
        for part in mine:
            optimizer.zero_grad()
            loss = loss_fn(model, part) / n
            loss.backward()
            values.append(loss.detach().reshape(1).double())
            has = [p.grad is not None for p in params]
            if used is not None and has != used:
                raise RuntimeError(f"{where}: micro-batches reach different parameters")
            used = has
            grads = [p.grad.reshape(-1) for p in params if p.grad is not None]
            rows.append(torch.cat(grads))
        per_micro = group.gather(torch.stack(rows))  # (n, d), in micro-batch order
        loss_values = group.gather(torch.stack(values))  # (n, 1)
        total = per_micro[0].clone()
        for row in per_micro[1:]:
            total += row
        value = 0.0
        for x in loss_values[:, 0].tolist():
            value += x
        if not math.isfinite(value):
            raise TrainingDivergedError(
                f"{where} inner step {k}: loss is {value}; lower optimizer.lr or enable "
                f"optimizer.clip_grad",
                on_every_rank=False,
            )
        optimizer.zero_grad()
        offset = 0
        for p, has in zip(params, used, strict=True):
            if has:
                p.grad = total[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        optimizer.step(lr)
        losses.append(value)
    if len(losses) != len(lrs):
        raise ValueError(f"{where}: {len(lrs)} inner steps but only {len(losses)} batches")
    return losses
