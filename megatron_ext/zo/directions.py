"""Splitting one estimator's probe directions over ranks (DDPP).

Every rank evaluates the losses of a contiguous block of the ``n_pert`` directions, the ranks
exchange only those scalar loss differences, and every rank then rebuilds the same estimate from
all differences and all probes (regenerated locally from their counter-based seeds). The
gathered differences are bit-identical to the ones a single rank would have computed, and
:func:`megatron_ext.zo.spsa.spsa_estimate` is a function of them and the probes only, so the
update equals a single-rank run's bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DirectionSplit:
    """Directions ``0..n_pert-1`` cut into ``world`` contiguous blocks of ``ceil(n_pert/world)``
    (the last ones shorter, possibly empty). ``group`` is a torch.distributed process group
    (``None`` = the default group); with ``world == 1`` nothing is communicated."""

    n_pert: int
    rank: int = 0
    world: int = 1
    group: Any = None

    @property
    def block(self) -> int:
        return -(-self.n_pert // self.world)

    def local(self) -> range:
        """This rank's directions."""
        start = min(self.rank * self.block, self.n_pert)
        return range(start, min(start + self.block, self.n_pert))

    def gather(self, local_diffs: torch.Tensor) -> torch.Tensor:
        """(len(local),) loss differences -> (n_pert,) in direction order, on every rank.

        One all-gather of ``block`` values per rank (padding of the short last blocks is sliced
        off; it never enters the estimate)."""
        if self.world == 1:
            return local_diffs
        padded = local_diffs.new_zeros(self.block)
        padded[: local_diffs.numel()] = local_diffs
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)  # gloo has no all_gather_into_tensor
        return torch.cat(parts)[: self.n_pert]
