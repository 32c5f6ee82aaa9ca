"""The one way every test rank script ends: together, and without gloo's teardown.

A rank destroying its gloo pairs while a peer still closes its own aborted now and then, after a
barrier too ("terminate called without an active exception", exit -6; seen in clean-clone runs
of several scripts, mended one by one before this module). So a script's last line is
:func:`leave`: a barrier (every rank is past its last collective, all results on disk), then
:func:`tests.warm.end_rank` (threads joined, ``atexit`` run, streams flushed, ``os._exit``) —
no ``destroy_process_group``, no interpreter teardown of the C++ objects. Warm ranks
(:mod:`tests.warm`) end through ``end_rank`` whatever the script does.
"""

from __future__ import annotations

from typing import NoReturn

from tests.warm import end_rank


def leave(code: int = 0) -> NoReturn:
    """Wait for every rank of the default group (when there is one), then end this process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
    end_rank(code)
    raise AssertionError("unreachable")  # end_rank does not return
