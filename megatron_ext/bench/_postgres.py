"""A throwaway PostgreSQL server (the queue tests, ``bench dipaco``): initdb into a temporary
folder, ``pg_ctl start`` on a free loopback port with its unix socket in that folder, one fresh
database per test or measurement, everything removed at the end.

The server binaries are looked up on PATH, then in Debian's ``/usr/lib/postgresql/*/bin``.
PostgreSQL refuses to run as root: under root the server runs as the ``postgres`` user (or
``nobody``), which then owns the temporary folder.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
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

    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="dipaco-pg-"))
        self.data = self.root / "data"
        self.port = free_port()
        self.user: str | None = None
        if os.geteuid() == 0:
            self.user = "postgres" if _has_user("postgres") else "nobody"
            info = pwd.getpwnam(self.user)
            os.chown(self.root, info.pw_uid, info.pw_gid)

    def _run(self, *args: str, timeout: int = 120) -> None:
        proc = subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            capture_output=True,
            text=True,
            timeout=timeout,
            user=self.user,
            cwd=self.root,
        )
        if proc.returncode:
            raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}")

    def start(self) -> None:
        """initdb, then ``pg_ctl start``. PostgreSQL cannot be told to bind a port of the
        kernel's choosing, so the free port chosen may be taken by another process before the
        server binds it: then (the log says so, and only then) a new port is chosen, up to
        three times."""
        self._run("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust", "-E", "UTF8")
        for attempt in range(3):
            options = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root} -c fsync=off"
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

    def url(self, dbname: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{dbname}"

    def new_database(self) -> str:
        """Create an empty database; returns its URL."""
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True
