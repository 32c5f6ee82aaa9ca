"""A throwaway PostgreSQL server (the queue tests, ``bench dipaco``): initdb into a temporary
folder, ``pg_ctl start`` on a free loopback port with its unix socket in that folder, one fresh
database per test or measurement, everything removed at the end.

The server binaries are looked up on PATH, then in Debian's ``/usr/lib/postgresql/*/bin``.
PostgreSQL refuses to run as root: under root the server runs as the ``postgres`` user (or
``nobody``), which then owns the temporary folder.

For the simulated cluster's tests (tests/test_multinode_dipaco.py) the server can listen on
another address (``listen``, e.g. a node's), accept password-less connections from the networks
that address is on (``samenet``), and run inside a network namespace (``run_in``: the command
prefix that enters it, e.g. ``ip netns exec NAME``); its unix socket, a file in the temporary
folder, reaches it from anywhere on the machine (:meth:`PostgresServer.socket_url`).
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Sequence
from pathlib import Path

__all__ = ["PostgresServer", "find_postgres_bin"]


def find_postgres_bin() -> Path | None:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``, or None if there is none."""
    on_path = shutil.which("initdb")
    candidates = [Path(on_path).resolve().parent] if on_path else []
    candidates += sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)
    for folder in candidates:
        if all((folder / tool).is_file() for tool in ("initdb", "pg_ctl", "postgres")):
            return folder
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """``start()`` a private server; ``url(dbname)`` for psycopg; ``new_database()`` per test."""

    def __init__(
        self, bindir: Path, *, listen: str = "127.0.0.1", run_in: Sequence[str] = ()
    ) -> None:
        self.bindir, self.listen, self.run_in = bindir, listen, list(run_in)
        self.root = Path(tempfile.mkdtemp(prefix="dipaco-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres" if _has_user("postgres") else "nobody"
            info = pwd.getpwnam(self.user)
            os.chown(self.root, info.pw_uid, info.pw_gid)

    def _run(self, *args: str, timeout: int = 120) -> None:
        command = [str(self.bindir / args[0]), *args[1:]]
        user = self.user
        if self.run_in and user is not None:  # entering a namespace needs root: switch after
            command, user = [*self.run_in, "runuser", "-u", user, "--", *command], None
        else:
            command = [*self.run_in, *command]
        proc = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout, user=user, cwd=self.root
        )
        if proc.returncode:
            raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")

    def start(self) -> None:
        """initdb, then ``pg_ctl start``. PostgreSQL cannot be told to bind a port of the
        kernel's choosing, so the free port chosen may be taken by another process before the
        server binds it: then (the log says so, and only then) a new port is chosen, up to
        three times."""
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        if self.listen != "127.0.0.1":  # initdb's rules admit loopback clients only
            with open(self.data / "pg_hba.conf", "a", encoding="utf-8") as hba:
                hba.write("host all all samenet trust\n")
        for attempt in range(3):
            options = (
                f"-c listen_addresses={self.listen} -p {self.port} -k {self.root} -c fsync=off"
            )
            try:
                self._run(
                    "pg_ctl",
                    "start",
                    "-w",
                    "-D",
                    str(self.data),
                    "-l",
                    str(self.log),
                    "-o",
                    options,
                )
                return
            except RuntimeError:
                taken = "Address already in use" in self.log.read_text(errors="replace")
                if not taken or attempt == 2:
                    raise
                self.log.unlink()
                self.port = free_port()

    @property
    def log(self) -> Path:
        return self.root / "log"

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "stop", "-m", "immediate", "-w", "-D", str(self.data))
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, dbname: str = "postgres", host: str = "") -> str:
        """The URL over TCP: to ``host`` (default: the listen address)."""
        return f"postgresql://postgres@{host or self.listen}:{self.port}/{dbname}"

    def socket_url(self, dbname: str = "postgres") -> str:
        """The URL over the unix socket (from this machine, whatever the namespace)."""
        return f"postgresql://postgres@:{self.port}/{dbname}?host={self.root}"

    def new_database(self, host: str = "") -> str:
        """Create an empty database; returns its URL (to ``host``, as :meth:`url`)."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.socket_url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name, host)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
