"""The DiPaCo task queue on both real databases: SQLite (WAL) and a throwaway PostgreSQL server.

Semantics under test: idempotent enqueue, dependencies and priorities, leases that expire on the
database's clock, heartbeats, fencing tokens (a zombie's completion is rejected, a repeated one
accepted), max_attempts stopping every worker, no task claimed twice under concurrent claims.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from megatron_ext.bench._postgres import PostgresServer, find_postgres_bin
from megatron_ext.dipaco.queue.database import connect
from megatron_ext.dipaco.queue.task_queue import TaskFailedError, TaskQueue, TaskSpec
from megatron_ext.dipaco.queue.url import parse_queue_url
from megatron_ext.errors import ConfigError
from tests.conftest import free_port
from tests.support.postgres import postgres_server


@pytest.fixture(scope="module")
def postgres():
    with postgres_server() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request, tmp_path: Path) -> str:
    """A fresh, empty queue database of each backend."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path}/queue.db"
    return request.getfixturevalue("postgres").new_database()


def open_queue(url: str, lease: float = 30.0, attempts: int = 3, worker: str = "") -> TaskQueue:
    return TaskQueue(
        parse_queue_url(url), lease_seconds=lease, max_attempts=attempts, worker=worker
    )


def test_enqueue_is_idempotent_and_refuses_other_content(url: str) -> None:
    q = open_queue(url)
    tasks = [TaskSpec("a", "train", {"path": 0}), TaskSpec("b", "train", {"path": 1}, deps=("a",))]
    assert q.enqueue(tasks) == 2
    assert q.enqueue(tasks) == 0
    assert open_queue(url).enqueue(tasks[:1]) == 0  # another connection, same answer
    with pytest.raises(ConfigError, match="already queued with other content"):
        q.enqueue([TaskSpec("a", "train", {"path": 7})])
    assert q.counts() == {"train": {"pending": 2, "running": 0, "done": 0, "failed": 0}}


def test_dependencies_and_priorities_decide_what_is_claimable(url: str) -> None:
    q = open_queue(url)
    q.enqueue(
        [
            TaskSpec("outer", "outer", priority=0, deps=("t1", "t2")),
            TaskSpec("t2", "train", priority=2),
            TaskSpec("t1", "train", priority=1),
        ]
    )
    first, second = q.claim(), q.claim()
    assert (first.task, second.task) == ("t1", "t2")  # the outer task waits for both
    assert q.claim() is None
    assert q.complete(first, {"loss": 1.0})
    assert q.claim() is None  # t2 still running
    assert q.complete(second)
    last = q.claim()
    assert last.task == "outer" and last.kind == "outer"
    assert q.claim(kinds=["train"]) is None
    assert q.complete(last) and q.unfinished() == 0
    assert q.result("t1") == {"loss": 1.0}


def _wait_past(queue, moment: float) -> None:
    """Until the database clock has passed ``moment`` (an event, not a guess at how long the
    machine takes)."""
    while queue.db.now() <= moment:
        time.sleep(0.02)


def test_lease_expiry_takeover_and_zombie_fencing(url: str) -> None:
    a = open_queue(url, lease=2.0, worker="A")
    b = open_queue(url, lease=2.0, worker="B")
    a.enqueue([TaskSpec("t", "train")])
    before = a.db.now()
    lease_a = a.claim()
    after = a.db.now()
    assert lease_a.attempt == 1 and not lease_a.taken_over
    # the expiry is the database clock at the claim plus the lease
    assert before + 2.0 - 1e-3 <= lease_a.expires <= after + 2.0 + 1e-3
    assert b.claim() is None  # leased
    _wait_past(a, lease_a.expires)
    lease_b = b.claim()
    assert lease_b.task == "t" and lease_b.attempt == 2 and lease_b.taken_over
    assert lease_b.token != lease_a.token
    assert not a.heartbeat(lease_a)  # the zombie learns it lost the task...
    assert not a.complete(lease_a, {"who": "A"})  # ...and its completion is rejected
    assert b.complete(lease_b, {"who": "B"})
    assert b.complete(lease_b, {"who": "B"})  # the same completion again: accepted
    assert not a.complete(lease_a, {"who": "A"})
    assert a.result("t") == {"who": "B"} and a.token("t") == lease_b.token
    assert [e[4] for e in a.events()] == ["claim", "take-over", "rejected", "complete", "rejected"]


def test_a_released_task_is_claimable_at_once_without_spending_an_attempt(url: str) -> None:
    a = open_queue(url, attempts=1, worker="A")
    b = open_queue(url, attempts=1, worker="B")
    a.enqueue([TaskSpec("t", "train")])
    lease_a = a.claim()
    assert a.release(lease_a, "SIGTERM")
    assert not a.release(lease_a, "SIGTERM")  # once: the token is no longer the task's
    lease_b = b.claim()  # at once, not after the lease, and max_attempts=1 is not spent
    assert lease_b.task == "t" and lease_b.attempt == 1 and not lease_b.taken_over
    assert lease_b.token != lease_a.token
    assert not a.complete(lease_a, {"who": "A"})  # the released claim cannot complete
    assert b.complete(lease_b, {"who": "B"}) and a.result("t") == {"who": "B"}
    assert [e[4] for e in a.events()] == ["claim", "released", "claim", "rejected", "complete"]
    assert a.events("released")[0][5] == "SIGTERM"


def test_heartbeats_keep_a_lease(url: str) -> None:
    """Heartbeats every 0.2 s keep a 1.5 s lease past its first expiry: no other worker can
    claim the task then (a pause of more than 1.5 s between two heartbeats would lose it)."""
    a = open_queue(url, lease=1.5, worker="A")
    b = open_queue(url, lease=1.5, worker="B")
    a.enqueue([TaskSpec("t", "train")])
    lease = a.claim()
    first_expiry = lease.expires
    beats = 0
    while a.db.now() <= first_expiry + 0.5:
        time.sleep(0.2)
        assert a.heartbeat(lease)
        beats += 1
    assert beats >= 2 and b.claim() is None  # past the first expiry, still A's
    assert a.complete(lease)
    workers = {w[0]: w for w in a.workers()}
    assert set(workers) == {"A", "B"}


def test_max_attempts_stops_every_worker_with_one_message(url: str) -> None:
    a = open_queue(url, attempts=2, worker="A")
    a.enqueue([TaskSpec("t", "train"), TaskSpec("u", "train", priority=5)])
    for _ in range(2):
        lease = a.claim()
        assert lease.task == "t"
        a.fail(lease, "ValueError: boom")
    with pytest.raises(TaskFailedError, match=r"task t failed 2 times.*max_attempts=2.*boom"):
        a.claim()
    with pytest.raises(TaskFailedError, match="task t failed"):
        open_queue(url, worker="B").claim()  # every worker stops, not just the one that saw it
    assert a.counts()["train"]["failed"] == 1


def test_expired_leases_count_as_attempts(url: str) -> None:
    q = open_queue(url, lease=0.2, attempts=2)
    q.enqueue([TaskSpec("t", "train")])
    first = q.claim()
    assert first.attempt == 1
    _wait_past(q, first.expires)
    second = q.claim()
    assert second.attempt == 2
    _wait_past(q, second.expires)
    with pytest.raises(TaskFailedError, match="lease expired 2 times"):
        q.claim()


def test_concurrent_claims_never_hand_out_a_task_twice(url: str) -> None:
    open_queue(url).enqueue([TaskSpec(f"t{i:02d}", "train", priority=i) for i in range(24)])
    claimed: list[str] = []
    lock = threading.Lock()

    def work(name: str) -> None:
        q = open_queue(url, worker=name)
        while (lease := q.claim()) is not None:
            with lock:
                claimed.append(lease.task)
            assert q.complete(lease)
        q.close()

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(claimed) == [f"t{i:02d}" for i in range(24)]
    assert open_queue(url).unfinished() == 0


def test_workers_starting_together_bind_and_enqueue_once(url: str) -> None:
    """Several workers joining an empty queue at the same moment (a job's ranks do): each
    binds the run and enqueues the whole plan; the queue ends with one plan, no worker fails."""
    plan = [
        TaskSpec(f"t{i:02d}", "train", priority=i, deps=("t00",) if i else ()) for i in range(40)
    ]
    workers = 4
    start, errors, added = threading.Barrier(workers), [], []

    def join(name: str) -> None:
        q = open_queue(url, worker=name)  # one connection per thread, as workers have
        start.wait()
        try:
            q.bind_run("abc", "runs/one")
            added.append(q.enqueue(plan))
        except Exception as exc:  # what the test is about
            errors.append(exc)
        finally:
            q.close()

    check = open_queue(url)
    for _ in range(3):  # a few rounds on emptied tables: the race is a matter of timing
        threads = [threading.Thread(target=join, args=(f"w{i}",)) for i in range(workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        assert sorted(added) == [0] * (workers - 1) + [40]
        assert check.unfinished() == 40
        with check.db.transaction() as db:
            for table in ("dipaco_deps", "dipaco_tasks", "dipaco_meta"):
                db.execute(f"DELETE FROM {table}")
        added.clear()
    check.close()


def test_sqlite_queues_opened_together_for_the_first_time_all_open(tmp_path: Path) -> None:
    """Connections switching a new SQLite file to WAL mode at the same moment (a job's workers
    starting together): SQLite answers some "database is locked" at once, without waiting for
    the busy timeout (about 1 round in 70 here); every one must open. 400 rounds of 4."""
    errors: list[Exception] = []
    for round_ in range(400):
        url = parse_queue_url(f"sqlite:///{tmp_path}/q{round_}.db")
        start = threading.Barrier(4)

        def open_one(url=url, start=start) -> None:
            start.wait()
            try:
                connect(url).close()
            except Exception as exc:  # what the test is about
                errors.append(exc)

        threads = [threading.Thread(target=open_one) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, f"{len(errors)} of 1600 failed to open: {errors[0]}"


def test_a_queue_belongs_to_one_run(url: str) -> None:
    open_queue(url).bind_run("abc", "runs/one")
    open_queue(url).bind_run("abc", "runs/one")
    with pytest.raises(ConfigError, match=r"another run's tasks \(runs/one\)"):
        open_queue(url).bind_run("xyz", "runs/two")


def test_unreachable_queues_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        open_queue(f"sqlite:///{tmp_path}/missing/queue.db")
    with pytest.raises(ConfigError, match="is unreachable"):
        open_queue(f"postgresql://nobody@127.0.0.1:{free_port()}/db")
    assert list(tmp_path.iterdir()) == []


def test_the_server_moves_to_another_port_when_its_port_is_taken() -> None:
    """The free port a server is given can be taken before it binds (another process, another
    test): ``start`` then picks another, and says nothing of other start failures."""
    import socket

    bindir = find_postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries: apt-get install postgresql")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = PostgresServer(bindir)
        server.port = taken.getsockname()[1]
        try:
            server.start()
            assert server.port != taken.getsockname()[1]
            import psycopg

            with psycopg.connect(server.url()) as conn:
                assert conn.execute("SELECT 1").fetchone() == (1,)
        finally:
            server.stop()


def test_the_queue_package_works_in_an_interpreter_without_torch(tmp_path: Path) -> None:
    """``megatron_ext.dipaco.queue`` is torch-free (the launcher and ``dipaco status`` use it
    before any torch import): in a fresh interpreter where ``import torch`` raises, every module
    of it imports, a status report is made and an SQLite queue enqueues, claims, completes."""
    script = textwrap.dedent(
        f"""
        import importlib, pkgutil, sys
        sys.modules["torch"] = None  # from here on, any import of torch raises ImportError
        import megatron_ext.dipaco.queue as package
        for info in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"megatron_ext.dipaco.queue.{{info.name}}")
        from megatron_ext.dipaco.queue.task_queue import TaskQueue, TaskSpec
        from megatron_ext.dipaco.queue.url import parse_queue_url
        url = parse_queue_url("sqlite:///{tmp_path}/queue.db")
        queue = TaskQueue(url, lease_seconds=30, max_attempts=1, worker="w")
        assert queue.enqueue([TaskSpec("a", "train", {{"path": 0}})]) == 1
        lease = queue.claim()
        assert lease is not None and lease.task == "a"
        assert queue.complete(lease, {{"loss": 1.5}})
        assert queue.result("a") == {{"loss": 1.5}} and queue.unfinished() == 0
        print("modules:", sorted(m for m in sys.modules if m.startswith("megatron_ext.dipaco")))
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = proc.stdout.split("modules:", 1)[1]
    for name in ("database", "heartbeat", "status", "task_queue", "url"):
        assert f"megatron_ext.dipaco.queue.{name}" in imported, (name, imported)
