"""The activations a pipeline rank holds at once under megatron-core's 1F1B schedules: how many
micro-batches are in flight, and, with virtual pipeline stages, which model chunk each one is.

megatron-core 0.19 (``pipeline_parallel/schedules.py``) runs on pipeline rank ``r`` of ``pp``:

- a warmup of forward passes -- ``pp − r − 1`` without virtual stages; with ``V`` chunks per
  rank ``(pp − r − 1)·2 + (V − 1)·G`` (``G``: ``microbatch_group_size_per_vp_stage``, default
  ``pp``), capped at the ``M·V`` passes of the step (``get_pp_rank_microbatches``);
- then one forward and one backward at a time, and the remaining backwards.

Forward pass ``k`` runs chunk ``c`` on micro-batch ``m`` of ``get_schedule_table``'s entry
``k`` (groups of ``G`` micro-batches through chunk 0, then chunk 1, ...); backward pass ``k``
runs the same micro-batch through chunk ``V − 1 − c`` (the chunks in reverse). A forward's
activations are held until the backward of the same (micro-batch, chunk). :func:`peak_held`
replays that order with each chunk's bytes: the largest sum is the rank's activation peak
(chunks differ: the first holds the embedding's, the last the logits'). Torch-free; the
tests compare :func:`warmup` and :func:`schedule_table` with megatron-core's own functions.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["peak_held", "schedule_table", "warmup"]


def warmup(pp: int, rank: int, micro_batches: int, chunks: int, group: int) -> int:
    """Forward passes before the first backward on pipeline rank ``rank``."""
    total = micro_batches * chunks
    if pp == 1:
        return 0
    passes = pp - rank - 1 if chunks == 1 else (pp - rank - 1) * 2 + (chunks - 1) * group
    return min(passes, total)


def schedule_table(micro_batches: int, chunks: int, group: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of each forward pass, in order: each group of ``group``
    micro-batches through every chunk in turn (the last group: what is left)."""
    table = []
    for first in range(0, micro_batches, group):
        members = range(first, min(first + group, micro_batches))
        table += [(m, c) for c in range(chunks) for m in members]
    return table


def peak_held(
    kept: Sequence[int], pp: int, rank: int, micro_batches: int, group: int | None = None
) -> tuple[int, int]:
    """(bytes, forward passes) held at the rank's peak; ``kept[c]``: the bytes one micro-batch
    keeps in chunk ``c`` for its backward; ``group`` defaults to ``pp``."""
    chunks = len(kept)
    table = schedule_table(micro_batches, chunks, group or pp)
    first = warmup(pp, rank, micro_batches, chunks, group or pp)
    held: dict[tuple[int, int], int] = {}
    peak = (0, 0)

    def forward(k: int) -> None:
        nonlocal peak
        held[table[k]] = kept[table[k][1]]
        peak = max(peak, (sum(held.values()), len(held)))

    def backward(k: int) -> None:
        m, c = table[k]
        del held[(m, chunks - 1 - c)]

    for k in range(first):
        forward(k)
    for k in range(len(table) - first):
        forward(k + first)
        backward(k)
    return peak
