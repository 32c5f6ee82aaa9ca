"""The queue's database URL: which backend, and where (torch-free, no database driver import).

- ``sqlite:///relative/path.db`` or ``sqlite:////absolute/path.db`` (SQLAlchemy's spelling): an
  SQLite file, opened in WAL mode; for workers on one host (or a file system with working
  POSIX locks);
- ``postgresql://user:password@host:port/dbname`` (or ``postgres://``, or a unix socket as
  ``postgresql:///dbname?host=/run/postgresql``): a PostgreSQL server, for several nodes.

An empty ``dipaco.queue`` means ``sqlite:///<run_dir>/queue.db``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qs, urlsplit

from megatron_ext.errors import ConfigError

__all__ = ["QueueURL", "parse_queue_url"]

Backend = Literal["sqlite", "postgresql"]
_EXAMPLES = "sqlite:///runs/x/queue.db or postgresql://user@host:5432/dbname"


@dataclass(frozen=True)
class QueueURL:
    """A parsed queue URL. ``path``: the SQLite file; ``conninfo``: the PostgreSQL URL as given
    (psycopg reads it). ``display``: the URL without its password, for messages and status."""

    backend: Backend
    path: Path | None
    conninfo: str
    display: str


def parse_queue_url(url: str, run_dir: str = "") -> QueueURL:
    """Parse ``url`` (empty: the run's SQLite file); ``ConfigError`` names what is malformed."""
    if not url:
        return parse_queue_url(f"sqlite:///{run_dir or '.'}/queue.db")
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError for a non-numeric or out-of-range port
    except ValueError as exc:
        raise ConfigError(
            f"dipaco.queue={url!r} is not a valid URL ({exc}); use {_EXAMPLES}"
        ) from None
    if parts.scheme == "sqlite":
        if parts.netloc or not parts.path.startswith("/") or parts.path in ("/", "//"):
            raise ConfigError(
                f"dipaco.queue={url!r}: an SQLite URL is sqlite:///relative/file.db or "
                f"sqlite:////absolute/file.db (three slashes, then the path, no host)"
            )
        if parts.query or parts.fragment:
            raise ConfigError(f"dipaco.queue={url!r}: an SQLite URL takes no ?query or #fragment")
        path = Path(parts.path[1:])
        if path.name in ("", ".", ".."):
            raise ConfigError(f"dipaco.queue={url!r}: the SQLite URL names no file")
        return QueueURL("sqlite", path, "", f"sqlite:///{path}")
    if parts.scheme in ("postgresql", "postgres"):
        database = parts.path.lstrip("/")
        query = parse_qs(parts.query)
        if not parts.hostname and "host" not in query:
            raise ConfigError(
                f"dipaco.queue={url!r} names no server: give postgresql://user@host:port/dbname "
                f"or postgresql:///dbname?host=/path/to/socket/dir"
            )
        if not database or "/" in database:
            raise ConfigError(
                f"dipaco.queue={url!r} names no database (or more than one path segment): "
                f"end it with /dbname"
            )
        if port == 0:
            raise ConfigError(f"dipaco.queue={url!r}: port 0 is not a server port")
        netloc = parts.hostname or ""
        if parts.username:
            netloc = f"{parts.username}@{netloc}"
        if port:
            netloc += f":{port}"
        display = f"postgresql://{netloc}/{database}" + (f"?{parts.query}" if parts.query else "")
        return QueueURL("postgresql", None, url, display)
    raise ConfigError(
        f"dipaco.queue={url!r}: unknown scheme {parts.scheme!r}; use {_EXAMPLES} "
        f"(empty: an SQLite file in the run folder)"
    )
