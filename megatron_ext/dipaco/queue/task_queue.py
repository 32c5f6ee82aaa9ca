"""The DiPaCo task queue: one schema and one interface over SQLite (WAL) or PostgreSQL.

A task is a row: ``id`` (e.g. ``train/phase0001/path0003``), ``kind``, a JSON ``payload``, a
``priority`` (lower first) and the ids it depends on. A task is claimable when it is pending,
or running with an expired lease, and every task it depends on is done.

- :meth:`TaskQueue.enqueue` is idempotent: a task already queued with the same content is left
  as it is (a different content under the same id is an error: another run's queue).
- :meth:`TaskQueue.claim` leases one claimable task: a new lease token (the attempt number and a
  random part), an expiry ``lease_seconds`` after the *database's* clock. Claiming a task for
  the ``max_attempts + 1``-th time marks it failed instead, and :class:`TaskFailedError` stops
  every worker (each later claim raises it too).
- :meth:`TaskQueue.heartbeat` renews a lease; it returns False when the token is no longer the
  task's (the lease expired and another worker claimed it): the worker must drop the task.
- :meth:`TaskQueue.complete` is accepted only with the task's current token (fencing). A late
  "zombie" worker whose lease was taken over gets False (and its files are to be discarded);
  the same completion repeated with the current token is accepted again (idempotent).
- :meth:`TaskQueue.fail` gives a task back after an error (it counts as an attempt);
  :meth:`TaskQueue.release` gives it back unfinished when its worker is asked to stop (it does
  not count).

Every claim, take-over, completion, rejection, failure and release is also an event row (for
the status command and the fault benchmark).
"""

from __future__ import annotations

import json
import os
import socket
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from megatron_ext.dipaco.queue.database import Database, connect
from megatron_ext.dipaco.queue.url import QueueURL
from megatron_ext.errors import ConfigError

__all__ = ["Lease", "TaskFailedError", "TaskQueue", "TaskSpec", "new_worker_id"]

SCHEMA_LOCK = 0x44495041  # PostgreSQL advisory lock key of the schema creation ("DIPA")
# ... and of binding the run and enqueueing its plan: workers that start together both find no
# row and both insert it otherwise (SQLite's BEGIN IMMEDIATE serialises them already)
SETUP_LOCK = 0x44495042
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS dipaco_meta (
        key TEXT PRIMARY KEY, value TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS dipaco_tasks (
        id TEXT PRIMARY KEY, kind TEXT NOT NULL, payload TEXT NOT NULL,
        priority BIGINT NOT NULL, state TEXT NOT NULL, attempts INTEGER NOT NULL,
        token TEXT, worker TEXT, lease_expires DOUBLE PRECISION, result TEXT, error TEXT,
        created DOUBLE PRECISION NOT NULL, finished DOUBLE PRECISION)""",
    """CREATE TABLE IF NOT EXISTS dipaco_deps (
        task TEXT NOT NULL, dep TEXT NOT NULL, PRIMARY KEY (task, dep))""",
    """CREATE TABLE IF NOT EXISTS dipaco_workers (
        id TEXT PRIMARY KEY, host TEXT NOT NULL, pid INTEGER NOT NULL,
        started DOUBLE PRECISION NOT NULL, last_seen DOUBLE PRECISION NOT NULL, task TEXT)""",
    """CREATE TABLE IF NOT EXISTS dipaco_events (
        seq {serial}, time DOUBLE PRECISION NOT NULL, task TEXT NOT NULL,
        worker TEXT, token TEXT, event TEXT NOT NULL, detail TEXT)""",
    "CREATE INDEX IF NOT EXISTS dipaco_tasks_claim ON dipaco_tasks (state, priority, id)",
)
STATES = ("pending", "running", "done", "failed")
_CLAIMABLE = """
    SELECT t.id, t.kind, t.payload, t.attempts, t.state, t.error FROM dipaco_tasks t
    WHERE (t.state = 'pending' OR (t.state = 'running' AND t.lease_expires < {now}))
      AND NOT EXISTS (SELECT 1 FROM dipaco_deps d JOIN dipaco_tasks u ON u.id = d.dep
                      WHERE d.task = t.id AND u.state <> 'done')
      KINDS
    ORDER BY t.priority, t.id LIMIT 1"""


class TaskFailedError(RuntimeError):
    """A task failed ``max_attempts`` times: the run stops (every worker raises this)."""


@dataclass(frozen=True)
class TaskSpec:
    """A task to enqueue: ``deps`` are the ids that must be done before it can be claimed."""

    id: str
    kind: str
    payload: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    deps: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lease:
    """A claimed task. ``token``: this claim's fencing token; ``expires``: database seconds."""

    task: str
    kind: str
    payload: dict[str, Any]
    token: str
    attempt: int
    expires: float
    taken_over: bool  # the previous holder's lease had expired


def new_worker_id() -> str:
    """``host:pid:random``, unique per process."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class TaskQueue:
    """The queue in the database at ``url`` (tables created on first use).

    One instance is one connection: give each thread (the heartbeat) its own instance.
    """

    def __init__(
        self, url: QueueURL, *, lease_seconds: float, max_attempts: int, worker: str = ""
    ) -> None:
        self.url, self.lease_seconds, self.max_attempts = url, lease_seconds, max_attempts
        self.worker = worker or new_worker_id()
        self.db: Database = connect(url)
        with self.db.transaction() as db:
            db.advisory_lock(SCHEMA_LOCK)
            for statement in SCHEMA:
                db.execute(statement)

    def close(self) -> None:
        self.db.close()

    # ---------------------------------------------------------------- run identity
    def bind_run(self, fingerprint: str, description: str) -> None:
        """Mark the queue as this run's (first caller), or refuse another run's queue."""
        with self.db.transaction() as db:
            db.advisory_lock(SETUP_LOCK)
            rows = db.query("SELECT value FROM dipaco_meta WHERE key = 'run'")
            if not rows:
                db.execute("INSERT INTO dipaco_meta VALUES ('run', ?)", (fingerprint,))
                db.execute("INSERT INTO dipaco_meta VALUES ('description', ?)", (description,))
            elif rows[0][0] != fingerprint:
                other = db.query("SELECT value FROM dipaco_meta WHERE key = 'description'")
                raise ConfigError(
                    f"queue {self.url.display} holds another run's tasks "
                    f"({other[0][0] if other else rows[0][0]}); give this run its own "
                    f"dipaco.queue (or its own run_dir)"
                )

    # ---------------------------------------------------------------- tasks
    def enqueue(self, tasks: Iterable[TaskSpec]) -> int:
        """Add ``tasks`` (idempotent); returns how many were new."""
        added = 0
        with self.db.transaction() as db:
            db.advisory_lock(SETUP_LOCK)
            for t in tasks:
                payload = json.dumps(t.payload, sort_keys=True)
                rows = db.query("SELECT kind, payload FROM dipaco_tasks WHERE id = ?", (t.id,))
                if rows:
                    if rows[0] != (t.kind, payload):
                        raise ConfigError(
                            f"queue {self.url.display}: task {t.id} is already queued with other "
                            f"content; this queue belongs to another run or recipe"
                        )
                    continue
                db.execute(
                    "INSERT INTO dipaco_tasks (id, kind, payload, priority, state, attempts, "
                    "created) VALUES (?, ?, ?, ?, 'pending', 0, {now})",
                    (t.id, t.kind, payload, t.priority),
                )
                for dep in t.deps:
                    db.execute("INSERT INTO dipaco_deps VALUES (?, ?)", (t.id, dep))
                added += 1
        return added

    def claim(self, kinds: Sequence[str] = ()) -> Lease | None:
        """Lease the first claimable task (of ``kinds``, if given), or None if there is none."""
        kind_sql = f"AND t.kind IN ({', '.join('?' * len(kinds))})" if kinds else ""
        with self.db.transaction() as db:
            self._raise_if_failed(db)
            rows = db.query(_CLAIMABLE.replace("KINDS", kind_sql) + db.skip_locked, kinds)
            if not rows:
                self._seen(db, None)
                return None
            task, kind, payload, attempts, state, error = rows[0]
            if attempts >= self.max_attempts:
                why = error or f"its lease expired {attempts} times (the worker died or hung)"
                message = (
                    f"task {task} failed {attempts} times (dipaco.max_attempts="
                    f"{self.max_attempts}); last error: {why}"
                )
                db.execute(
                    "UPDATE dipaco_tasks SET state = 'failed', token = NULL, error = ?, "
                    "finished = {now} WHERE id = ?",
                    (message, task),
                )
                self._event(db, task, None, "failed", message)
                failed = message
            else:
                failed = ""
                token = f"{attempts + 1}:{uuid.uuid4().hex}"
                db.execute(
                    "UPDATE dipaco_tasks SET state = 'running', attempts = attempts + 1, "
                    "token = ?, worker = ?, lease_expires = {now} + ? WHERE id = ?",
                    (token, self.worker, self.lease_seconds, task),
                )
                expires = db.query("SELECT lease_expires FROM dipaco_tasks WHERE id = ?", (task,))
                self._event(db, task, token, "take-over" if state == "running" else "claim", "")
                self._seen(db, task)
        if failed:
            raise TaskFailedError(failed)
        return Lease(
            task, kind, json.loads(payload), token, attempts + 1, expires[0][0], state == "running"
        )

    def heartbeat(self, lease: Lease) -> bool:
        """Renew ``lease``; False if its token is no longer the task's (drop the task)."""
        with self.db.transaction() as db:
            changed = db.execute(
                "UPDATE dipaco_tasks SET lease_expires = {now} + ? "
                "WHERE id = ? AND token = ? AND state = 'running'",
                (self.lease_seconds, lease.task, lease.token),
            )
            self._seen(db, lease.task if changed else None)
        return changed == 1

    def complete(self, lease: Lease, result: dict[str, Any] | None = None) -> bool:
        """Finish ``lease``'s task with ``result`` (JSON); True when accepted (the current
        token, or the same completion again), False for a superseded token (a zombie)."""
        body = json.dumps(result or {}, sort_keys=True)
        with self.db.transaction() as db:
            changed = db.execute(
                "UPDATE dipaco_tasks SET state = 'done', result = ?, finished = {now}, "
                "lease_expires = NULL WHERE id = ? AND token = ? AND state = 'running'",
                (body, lease.task, lease.token),
            )
            if changed:
                self._event(db, lease.task, lease.token, "complete", "")
                self._seen(db, None)
                return True
            state, token = db.query(
                "SELECT state, token FROM dipaco_tasks WHERE id = ?", (lease.task,)
            )[0]
            if state == "done" and token == lease.token:
                return True
            self._event(db, lease.task, lease.token, "rejected", f"current token {token}")
            return False

    def fail(self, lease: Lease, error: str, *, fatal: bool = False) -> None:
        """Give ``lease``'s task back after ``error`` (a no-op for a superseded token);
        ``fatal``: the error would repeat (bad input), so the task fails and the run stops."""
        state = "failed" if fatal else "pending"
        with self.db.transaction() as db:
            db.execute(
                "UPDATE dipaco_tasks SET state = ?, token = NULL, error = ?, "
                "lease_expires = NULL WHERE id = ? AND token = ? AND state = 'running'",
                (state, error, lease.task, lease.token),
            )
            self._event(db, lease.task, lease.token, "failed" if fatal else "error", error)
            self._seen(db, None)

    def release(self, lease: Lease, reason: str) -> bool:
        """Give ``lease``'s task back unfinished without spending an attempt (a worker asked
        to stop, e.g. by SIGTERM): pending again at once, for any worker. False (a no-op) for
        a superseded token."""
        with self.db.transaction() as db:
            changed = db.execute(
                "UPDATE dipaco_tasks SET state = 'pending', token = NULL, "
                "attempts = attempts - 1, lease_expires = NULL "
                "WHERE id = ? AND token = ? AND state = 'running'",
                (lease.task, lease.token),
            )
            if changed:
                self._event(db, lease.task, lease.token, "released", reason)
            self._seen(db, None)
        return changed == 1

    # ---------------------------------------------------------------- reading
    def result(self, task: str) -> dict[str, Any] | None:
        """The accepted result of a done task (None if it is not done)."""
        rows = self.db.query("SELECT state, result FROM dipaco_tasks WHERE id = ?", (task,))
        return json.loads(rows[0][1]) if rows and rows[0][0] == "done" else None

    def token(self, task: str) -> str | None:
        """The task's current (or, when done, accepted) lease token."""
        rows = self.db.query("SELECT token FROM dipaco_tasks WHERE id = ?", (task,))
        return rows[0][0] if rows else None

    def counts(self) -> dict[str, dict[str, int]]:
        """Tasks by kind, then by state (every state present, zeros included)."""
        out: dict[str, dict[str, int]] = {}
        rows = self.db.query("SELECT kind, state, COUNT(*) FROM dipaco_tasks GROUP BY kind, state")
        for kind, state, n in rows:
            out.setdefault(kind, dict.fromkeys(STATES, 0))[state] = int(n)
        return out

    def unfinished(self) -> int:
        """Tasks not done yet (0: the run is complete)."""
        return int(self.db.query("SELECT COUNT(*) FROM dipaco_tasks WHERE state <> 'done'")[0][0])

    def events(self, event: str | None = None) -> list[tuple[Any, ...]]:
        """(time, task, worker, token, event, detail) rows in the order they were written."""
        where, params = ("WHERE event = ?", (event,)) if event else ("", ())
        return self.db.query(
            f"SELECT time, task, worker, token, event, detail FROM dipaco_events {where} "
            "ORDER BY seq",
            params,
        )

    def workers(self) -> list[tuple[Any, ...]]:
        """(id, host, pid, started, last_seen, task) of every worker that ever connected."""
        return self.db.query(
            "SELECT id, host, pid, started, last_seen, task FROM dipaco_workers ORDER BY started"
        )

    # ---------------------------------------------------------------- internals
    def _raise_if_failed(self, db: Database) -> None:
        rows = db.query("SELECT error FROM dipaco_tasks WHERE state = 'failed' ORDER BY id LIMIT 1")
        if rows:
            raise TaskFailedError(rows[0][0])

    def _event(self, db: Database, task: str, token: str | None, event: str, detail: str) -> None:
        db.execute(
            "INSERT INTO dipaco_events (time, task, worker, token, event, detail) "
            "VALUES ({now}, ?, ?, ?, ?, ?)",
            (task, self.worker, token, event, detail),
        )

    def _seen(self, db: Database, task: str | None) -> None:
        db.execute(
            "INSERT INTO dipaco_workers VALUES (?, ?, ?, {now}, {now}, ?) "
            "ON CONFLICT (id) DO UPDATE SET last_seen = excluded.last_seen, task = excluded.task",
            (self.worker, socket.gethostname(), os.getpid(), task),
        )
