"""Variable-size all-gather of one flat buffer, asynchronous, behind one interface.

The layer-wise optimizer keeps each bucket of parameters in one flat buffer laid out rank by
rank: rank ``r`` owns ``buffer[offset_r : offset_r + counts[r]]`` (its updated matrices).  After
:meth:`AllGatherV.start` and :meth:`Pending.wait`, every rank holds every segment.  Nothing is
padded on the wire: each rank sends exactly its own segment and receives exactly the others'.

Backends, chosen from the process group by :func:`make_allgather_v`:

* ``nccl`` -- ``torch.distributed.all_gather`` with per-rank views of different sizes (NCCL runs
  uneven all-gathers as grouped broadcasts inside one NCCL group call).
* ``gloo`` -- one asynchronous ``broadcast`` per rank that owns a non-empty segment: gloo's
  all-gather needs equal sizes, and broadcasting each segment from its owner avoids padding.
* ``mpi`` -- ``MPI_Iallgatherv`` through mpi4py on the CPU buffer (processes started by
  mpirun/mpiexec; the communicator is ``MPI.COMM_WORLD`` unless one is given).

Buffers and work handles stay referenced by the :class:`Pending` object until it is waited on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

_RAW_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements reinterpreted as integers of the same width (any dtype, bf16 too)."""
    return tensor.view(_RAW_INT[tensor.element_size()])


def segment_offsets(counts: Sequence[int]) -> list[int]:
    """Start of each rank's segment in the flat buffer (exclusive prefix sum of ``counts``)."""
    return [0, *accumulate(counts)][:-1]


@dataclass
class Pending:
    """An all-gather in flight. ``wait()`` blocks until every segment has arrived."""

    buffer: torch.Tensor
    handles: list[Any] = field(default_factory=list)
    keepalive: Any = None  # e.g. a send buffer that must outlive the transfer
    done: bool = False

    def wait(self) -> torch.Tensor:
        if not self.done:
            for handle in self.handles:
                handle.wait()
            self.handles.clear()
            self.done = True
        return self.buffer


@dataclass
class WireStats:
    """Payload bytes this rank sent (its own segments) and received (everyone else's)."""

    sent: int = 0
    received: int = 0


class AllGatherV(ABC):
    """In-place variable-size all-gather over ``group`` (see the module docstring)."""

    name: str = ""

    def __init__(self, group: Any = None) -> None:
        self.group = group
        self.stats = WireStats()

    @property
    @abstractmethod
    def rank(self) -> int: ...

    @property
    @abstractmethod
    def world(self) -> int: ...

    def start(self, buffer: torch.Tensor, counts: Sequence[int]) -> Pending:
        """Begin gathering; ``buffer`` is 1-D and ``sum(counts)`` long."""
        if buffer.dim() != 1 or buffer.numel() != sum(counts) or len(counts) != self.world:
            raise ValueError(
                f"buffer of {buffer.numel()} elements does not match counts "
                f"{list(counts)} over {self.world} ranks"
            )
        item = buffer.element_size()
        self.stats.sent += counts[self.rank] * item
        self.stats.received += (sum(counts) - counts[self.rank]) * item
        return self._start(buffer, list(counts), segment_offsets(counts))

    @abstractmethod
    def _start(self, buffer: torch.Tensor, counts: list[int], offsets: list[int]) -> Pending: ...


class _TorchGroup(AllGatherV):
    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    def _global(self, group_rank: int) -> int:
        return (
            dist.get_global_rank(self.group, group_rank) if self.group is not None else (group_rank)
        )


class BroadcastAllGatherV(_TorchGroup):
    """gloo: one async broadcast per non-empty segment, from its owner."""

    name = "gloo"

    def _start(self, buffer: torch.Tensor, counts: list[int], offsets: list[int]) -> Pending:
        handles = [
            dist.broadcast(
                buffer[off : off + n], src=self._global(r), group=self.group, async_op=True
            )
            for r, (off, n) in enumerate(zip(offsets, counts, strict=True))
            if n
        ]
        return Pending(buffer, handles)


class NcclAllGatherV(_TorchGroup):
    """NCCL: uneven ``all_gather`` into views of the flat buffer."""

    name = "nccl"

    def _start(self, buffer: torch.Tensor, counts: list[int], offsets: list[int]) -> Pending:
        views = [buffer[off : off + n] for off, n in zip(offsets, counts, strict=True)]
        handle = dist.all_gather(views, views[self.rank], group=self.group, async_op=True)
        return Pending(buffer, [handle])


class MpiAllGatherV(AllGatherV):
    """MPI: ``Iallgatherv`` via mpi4py on a CPU buffer."""

    name = "mpi"

    def __init__(self, comm: Any = None) -> None:
        from mpi4py import MPI

        super().__init__(None)
        self.comm = comm if comm is not None else MPI.COMM_WORLD

    @property
    def rank(self) -> int:
        return self.comm.Get_rank()

    @property
    def world(self) -> int:
        return self.comm.Get_size()

    def _start(self, buffer: torch.Tensor, counts: list[int], offsets: list[int]) -> Pending:
        from mpi4py import MPI

        if buffer.device.type != "cpu":
            raise ValueError("the MPI all-gather-v backend works on CPU buffers only")
        # Move raw elements: an integer view of the same width carries any dtype (bf16 too,
        # which numpy lacks) bit for bit.
        array = raw_bits(buffer).numpy()
        own = array[offsets[self.rank] : offsets[self.rank] + counts[self.rank]].copy()
        mpi_type = MPI._typedict[array.dtype.char]
        request = self.comm.Iallgatherv(own, [array, counts, offsets, mpi_type])
        return Pending(buffer, [_MpiRequest(request)], keepalive=own)


@dataclass
class _MpiRequest:
    request: Any

    def wait(self) -> None:
        self.request.Wait()


def make_allgather_v(group: Any = None, backend: str = "auto") -> AllGatherV:
    """The backend for ``group``: ``auto`` picks NCCL or gloo from the group's backend."""
    if backend == "mpi":
        return MpiAllGatherV()
    if backend == "auto":
        backend = dist.get_backend(group)
    if backend == "nccl":
        return NcclAllGatherV(group)
    if backend == "gloo":
        return BroadcastAllGatherV(group)
    raise ValueError(f"no all-gather-v backend for {backend!r}; use nccl, gloo or mpi")
