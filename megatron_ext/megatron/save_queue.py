"""megatron-core's checkpoint writer without a fresh interpreter per rank.

``dist_checkpointing.save`` (torch_dist format) writes each rank's shards from threads that
report to a multiprocessing ``Manager`` queue, created on a process's first save by
:func:`~megatron.core.dist_checkpointing.strategies.filesystem_async.get_write_results_queue`
with the ``spawn`` context. That Manager is a new interpreter which, to unpickle the first
``WriteResult`` it is handed, imports torch and ``torch.distributed.checkpoint``: measured on a
2-core CPU host, the first save of a 0.9M-parameter model took 1.5 s of which 1.4 s waited on
it, and the rank's exit waited ~1 s more for the Manager to end (two ranks: twice the CPU).

Our saves are synchronous (the rank waits for its writes), so nothing needs the Manager to be
a clean interpreter: :func:`fork_results_queue` creates megatron-core's one queue first, from
the ``fork`` context — the Manager starts as a copy of the rank, with torch already imported,
and runs only the Manager's server loop (no tensor, no CUDA, no collective). The queue is
megatron-core's own (its public function, its module's cache); later saves reuse it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["fork_results_queue"]


def fork_results_queue() -> Any:
    """megatron-core's write-results queue, created now with a forked Manager unless a save of
    this process created it already; returns it. Call before ``dist_checkpointing.save``."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return filesystem_async.get_write_results_queue(mp_mode="fork")
