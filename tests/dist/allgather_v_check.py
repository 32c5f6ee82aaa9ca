"""Run under torchrun (gloo) or mpiexec (mpi): variable-size all-gathers with zero-length and
uneven segments; every rank checks every segment and the payload byte counts.

Usage: allgather_v_check.py gloo|mpi OUT_DIR
"""

import json
import os
import sys

import torch

from megatron_ext.distributed.allgather_v import make_allgather_v, segment_offsets
from tests.dist.ending import leave


def expected(counts: list[int], dtype: torch.dtype) -> torch.Tensor:
    """Rank r's segment holds r*1000 + 0, 1, 2, ... (distinct per rank and position)."""
    parts = [r * 1000 + torch.arange(n, dtype=torch.float64) for r, n in enumerate(counts)]
    return torch.cat(parts).to(dtype)


def main(backend: str, out_dir: str) -> None:
    if backend == "mpi":
        gather = make_allgather_v(backend="mpi")
    else:
        torch.distributed.init_process_group("gloo")
        gather = make_allgather_v()
    rank, world = gather.rank, gather.world
    cases = [
        [3] * world,
        [5, 0, 7, 1][:world],
        [0] * (world - 1) + [11],
        [(r + 1) * 17 for r in range(world)],
    ]
    pendings = []
    for i, counts in enumerate(cases):
        dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
        buf = torch.full((sum(counts),), float("nan"), dtype=dtype)
        off = segment_offsets(counts)[rank]
        buf[off : off + counts[rank]] = expected(counts, dtype)[off : off + counts[rank]]
        pendings.append((counts, gather.start(buf, counts)))  # all in flight together
    for counts, pending in pendings:
        got = pending.wait()
        want = expected(counts, got.dtype)
        if not torch.equal(got, want):
            raise SystemExit(f"rank {rank}: wrong all-gather-v result for counts {counts}")
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(
            {
                "backend": gather.name,
                "sent": gather.stats.sent,
                "received": gather.stats.received,
                "world": world,
            },
            f,
        )
    if backend != "mpi":
        leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
