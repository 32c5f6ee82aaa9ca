"""One connection to the queue's database, SQLite or PostgreSQL, behind the same few calls.

The queue (:mod:`.queue`) writes its SQL once, with ``?`` placeholders and ``{now}`` for the
database clock (seconds since the epoch, a float); a :class:`Database` translates both for its
backend and runs statements inside :meth:`Database.transaction`, which holds the write lock:

- SQLite: ``BEGIN IMMEDIATE`` (the one writer lock of a WAL database), journal in WAL mode,
  ``synchronous=FULL`` (an accepted completion survives a power cut), a generous busy timeout;
- PostgreSQL (psycopg 3): a transaction in which the queue takes row locks
  (``FOR UPDATE SKIP LOCKED`` where :attr:`Database.skip_locked` says so).

Leases are computed from the database's clock, never a worker's, so workers on hosts with
skewed clocks agree on when a lease expires.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from megatron_ext.dipaco.queue.url import QueueURL
from megatron_ext.errors import ConfigError

__all__ = ["Database", "connect"]

BUSY_TIMEOUT_S = 60.0
_NOW = {
    "sqlite": "((julianday('now') - 2440587.5) * 86400.0)",
    "postgresql": "extract(epoch from clock_timestamp())::double precision",
}
# An increasing row id: orders events written within the clock's resolution (SQLite's
# julianday('now') has 1 ms), where ordering by time alone would be arbitrary.
_SERIAL = {"sqlite": "INTEGER PRIMARY KEY AUTOINCREMENT", "postgresql": "BIGSERIAL PRIMARY KEY"}


class Database:
    """A connection: :meth:`execute` / :meth:`query` inside or outside :meth:`transaction`."""

    def __init__(self, url: QueueURL, connection: Any) -> None:
        self.url = url
        self.backend = url.backend
        self._conn = connection
        self.skip_locked = " FOR UPDATE SKIP LOCKED" if self.backend == "postgresql" else ""

    def sql(self, statement: str) -> str:
        """``statement`` in this backend's dialect: ``?`` placeholders, ``{now}`` clock,
        ``{serial}`` an auto-incremented integer primary key."""
        text = statement.replace("{now}", _NOW[self.backend])
        text = text.replace("{serial}", _SERIAL[self.backend])
        return text.replace("?", "%s") if self.backend == "postgresql" else text

    def execute(self, statement: str, params: Sequence[Any] = ()) -> int:
        """Run one statement; returns the number of rows it changed."""
        cursor = self._conn.execute(self.sql(statement), tuple(params))
        return cursor.rowcount

    def query(self, statement: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        """Rows of one SELECT, as tuples."""
        cursor = self._conn.execute(self.sql(statement), tuple(params))
        return [tuple(row) for row in cursor.fetchall()]

    def now(self) -> float:
        """The database clock, seconds since the epoch."""
        return float(self.query("SELECT {now}")[0][0])

    @contextmanager
    def transaction(self) -> Iterator[Database]:
        """One atomic unit holding the write lock (SQLite) / row locks (PostgreSQL)."""
        if self.backend == "sqlite":
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                yield self
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")
        else:
            with self._conn.transaction():
                yield self

    def advisory_lock(self, key: int) -> None:
        """PostgreSQL: serialise a transaction with every other one taking lock ``key``, until
        it ends (SQLite: every write transaction holds the one write lock already)."""
        if self.backend == "postgresql":
            self.execute("SELECT pg_advisory_xact_lock(?)", (key,))

    def close(self) -> None:
        self._conn.close()


def connect(url: QueueURL) -> Database:
    """Open ``url``; ``ConfigError`` (one line, the fix) when the database cannot be reached."""
    if url.backend == "sqlite":
        assert url.path is not None
        if not url.path.parent.is_dir():
            raise ConfigError(
                f"queue {url.display}: folder {url.path.parent} does not exist; create it or "
                f"point dipaco.queue elsewhere"
            )
        conn, mode = _open_sqlite(url)
        if str(mode).lower() != "wal":
            raise ConfigError(
                f"queue {url.display}: the file system refused WAL mode ({mode}); put the "
                f"queue on a local disk or use a postgresql:// queue"
            )
        return Database(url, conn)
    try:
        import psycopg
    except ImportError as exc:
        raise ConfigError(
            "a postgresql:// queue needs psycopg 3: pip install 'psycopg[binary]'"
        ) from exc
    try:
        conn = psycopg.connect(url.conninfo, autocommit=True, connect_timeout=10)
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        raise ConfigError(
            f"queue {url.display} is unreachable ({reason}); start the server or fix dipaco.queue"
        ) from exc
    return Database(url, conn)


def _open_sqlite(url: QueueURL) -> tuple[sqlite3.Connection, str]:
    """A connection in WAL mode and its journal mode. Setting the journal mode can fail with
    "database is locked" at once, without the busy timeout, while another connection is taking
    or giving up the WAL file (seen with two workers starting together): retried for up to
    ``BUSY_TIMEOUT_S``."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        conn = None
        try:
            conn = sqlite3.connect(url.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
            mode = conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            conn.execute("PRAGMA synchronous=FULL")
            return conn, str(mode)
        except sqlite3.Error as exc:
            if conn is not None:
                conn.close()
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise ConfigError(f"queue {url.display} cannot be opened: {exc}") from exc
            time.sleep(0.05)
