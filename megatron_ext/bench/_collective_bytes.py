"""Count the payload bytes of ``torch.distributed`` collectives, whoever calls them.

``bench layerwise --against megatron-core`` compares two optimizers whose communication is
written differently (megatron-core: DDP's bucket all-reduce, an uneven all-gather; megatron-ext:
a reduce-scatter-v of point-to-point sends and receives in one ``batch_isend_irecv``, the
element-sharded AdamW parts' reduce-scatter, per-rank broadcasts).  Neither side's own counters
can be compared with the other's, so :class:`CollectiveBytes` wraps the collectives in the
``torch.distributed`` namespace itself (both sides look them up there at call time) and counts
what each call moves for this rank under one model of the wire, into the phase that is open
and its kind (``gather``: all-gathers and broadcasts; ``reduce``: the rest):

* ``all_reduce`` of B bytes: a ring's 2·(n−1)/n·B sent and as much received;
* ``all_gather`` / ``all_gather_into_tensor`` / ``_all_gather_base``: sent the own segment once,
  received the others';
* ``reduce_scatter_tensor`` / ``_reduce_scatter_base``: sent the input except the own segment,
  received (n−1) own-segment sizes;
* ``broadcast``: the source sends the tensor once, every other rank receives it;
* ``all_to_all_single``: sent the input except the own slice, received the output except it;
* ``batch_isend_irecv``: sent every ``isend``'s tensor, received every ``irecv``'s.

A call outside an open phase is not counted (the bench's own loss all-reduce, barriers).  The
wrappers are installed for the worker process only (:meth:`install`), never by the library.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "all_to_all_single",
    "batch_isend_irecv",
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


GATHERS = ("all_gather", "all_gather_into_tensor", "_all_gather_base", "broadcast")


def _zero() -> dict[str, float]:
    return {"sent": 0.0, "received": 0.0, "calls": 0}


class CollectiveBytes:
    """Per phase and kind ``{"sent": bytes, "received": bytes, "calls": n}`` of this rank."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.totals: dict[tuple[str, str], dict[str, float]] = defaultdict(_zero)
        self._originals: dict[str, Any] = {}
        self._aliases: list[tuple[Any, str, Any]] = []

    @contextlib.contextmanager
    def counting(self, phase: str) -> Iterator[None]:
        """Count the collectives called inside the block into ``phase``."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def take(self, phase: str) -> dict[str, dict[str, float]]:
        """``phase``'s totals so far per kind (``gather``, ``reduce``), reset to zero."""
        return {kind: self.totals.pop((phase, kind), _zero()) for kind in ("gather", "reduce")}

    def install(self) -> None:
        """Wrap the collectives of :data:`WRAPPED` in ``torch.distributed``, and the aliases
        megatron-core's gradient buffer binds to two of them when it is imported
        (``dist_reduce_scatter_func``, ``dist_all_gather_func``: its padded layout's
        reduce-scatter and buffer all-gather)."""
        for name in WRAPPED:
            original = getattr(dist, name)
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))
        try:
            import megatron.core.distributed.param_and_grad_buffer as buffers
        except ImportError:  # megatron-core absent: only torch.distributed's names
            return
        by_function = {id(fn): name for name, fn in self._originals.items()}
        for alias in ("dist_reduce_scatter_func", "dist_all_gather_func"):
            fn = getattr(buffers, alias, None)
            if id(fn) in by_function:
                self._aliases.append((buffers, alias, fn))
                setattr(buffers, alias, self._wrap(by_function[id(fn)], fn))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        for module, alias, original in self._aliases:
            setattr(module, alias, original)
        self._originals.clear()
        self._aliases.clear()

    def _add(self, kind: str, sent: float, received: float) -> None:
        if self.phase is None:
            return
        t = self.totals[(self.phase, kind)]
        t["sent"] += sent
        t["received"] += received
        t["calls"] += 1

    def _wrap(self, name: str, original: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.phase is not None:
                group = _p2p_group(args[0]) if name == "batch_isend_irecv" else kwargs.get("group")
                n = dist.get_world_size(group)
                if n > 1:
                    kind = "gather" if name in GATHERS else "reduce"
                    self._add(kind, *_payload(name, n, dist.get_rank(group), args, kwargs))
            return original(*args, **kwargs)

        return counted


def _p2p_name(op: Any) -> str:
    """``isend`` or ``irecv``: the operation of a ``dist.P2POp`` (its function's name, so a
    wrapped or re-bound function is recognised too)."""
    return getattr(op.op, "__name__", "").lstrip("_")


def _p2p_group(ops: Any) -> Any:
    """The process group of a ``batch_isend_irecv`` (every op of a batch shares one)."""
    return ops[0].group if ops else None


def _payload(
    name: str, n: int, rank: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[float, float]:
    """(sent, received) bytes of one call for this rank (the module docstring's model)."""
    if name == "batch_isend_irecv":
        ops = args[0]
        sent = sum(_nbytes(op.tensor) for op in ops if _p2p_name(op) == "isend")
        return sent, sum(_nbytes(op.tensor) for op in ops if _p2p_name(op) == "irecv")
    if name == "all_reduce":
        b = 2 * (n - 1) / n * _nbytes(args[0])
        return b, b
    if name == "all_gather":
        parts = args[0]
        mine = _nbytes(args[1])
        return mine, sum(_nbytes(p) for p in parts) - mine
    if name in ("all_gather_into_tensor", "_all_gather_base"):
        mine = _nbytes(args[1])
        return mine, (n - 1) * mine
    if name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
        mine = _nbytes(args[0])
        return (n - 1) * mine, (n - 1) * mine
    if name == "broadcast":
        src = kwargs.get("src", args[1] if len(args) > 1 else 0)
        group = kwargs.get("group")
        src_in_group = dist.get_group_rank(group, src) if group is not None else src
        b = _nbytes(args[0])
        return (b, 0.0) if src_in_group == rank else (0.0, b)
    if name == "all_to_all_single":
        out, inp = args[0], args[1]
        out_splits = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
        in_splits = kwargs.get("input_split_sizes", args[3] if len(args) > 3 else None)
        row_out = _nbytes(out) / max(out.shape[0], 1) if out.dim() else _nbytes(out)
        row_in = _nbytes(inp) / max(inp.shape[0], 1) if inp.dim() else _nbytes(inp)
        own_out = out_splits[rank] * row_out if out_splits else _nbytes(out) / n
        own_in = in_splits[rank] * row_in if in_splits else _nbytes(inp) / n
        return _nbytes(inp) - own_in, _nbytes(out) - own_out
    raise AssertionError(f"no payload model for {name}")
