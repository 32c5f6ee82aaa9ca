"""The heartbeat of a worker: a thread that renews the current lease every ``heartbeat_seconds``
and notes when the lease was lost (another worker took the task over)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from megatron_ext.dipaco.queue.task_queue import Lease, TaskQueue

__all__ = ["Heartbeat"]


class Heartbeat:
    """A thread renewing the current lease on its own connection (made in the thread: an
    SQLite connection belongs to the thread that opened it)."""

    def __init__(self, connect: Callable[[], TaskQueue], every: float) -> None:
        self.every = every
        self.lease: Lease | None = None
        self.lost = False
        self._busy = threading.Lock()  # held while a heartbeat is in flight
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(connect,), daemon=True, name="dipaco-heartbeat"
        )
        self._thread.start()

    def hold(self, lease: Lease | None) -> None:
        """Renew ``lease`` from now on (None: nothing); returns once no heartbeat of the
        previous lease is in flight."""
        with self._busy:
            self.lease, self.lost = lease, False

    def _run(self, connect: Callable[[], TaskQueue]) -> None:
        queue = connect()
        try:
            while not self._stop.wait(self.every):
                with self._busy:
                    lease = self.lease
                    if lease is not None and not self.lost and not queue.heartbeat(lease):
                        self.lost = True
        finally:
            queue.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
