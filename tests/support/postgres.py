"""A throwaway PostgreSQL server for the queue and fault tests: the benchmark's own helper
(:class:`megatron_ext.bench._postgres.PostgresServer`), skipped where no server binaries exist.

Why not pytest-postgresql: its executor runs ``initdb`` and ``pg_ctl`` as the current user and
has no way to run them as another one, and PostgreSQL refuses to run as root, which is how CI
and the development machines run (``pg_ctl: cannot be run as root``); ``bench dipaco`` starts a
throwaway server too, outside pytest, so the helper ships with the benchmarks anyway.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest

from megatron_ext.bench._postgres import PostgresServer, find_postgres_bin

__all__ = ["postgres_server"]


@contextmanager
def postgres_server(
    listen: str = "127.0.0.1", run_in: Sequence[str] = ()
) -> Iterator[PostgresServer]:
    """A started server, stopped (and its folder removed) on exit; skips the test without
    server binaries (initdb, pg_ctl, postgres on PATH or in /usr/lib/postgresql/*/bin).
    ``listen``, ``run_in``: as :class:`PostgresServer` takes them (a simulated node's)."""
    bindir = find_postgres_bin()
    if bindir is None:
        pytest.skip(
            "no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH or in "
            "/usr/lib/postgresql/*/bin: apt-get install postgresql"
        )
    server = PostgresServer(bindir, listen=listen, run_in=run_in)
    server.start()
    try:
        yield server
    finally:
        server.stop()
