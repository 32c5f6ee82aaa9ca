"""``megatron-ext dipaco status RUN_DIR``: phases, tasks by state, workers, module versions,
read from the run's queue (its URL is in ``RUN_DIR/dipaco/run.json``)."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path
from typing import Any

from megatron_ext.dipaco.queue.task_queue import STATES, TaskQueue
from megatron_ext.dipaco.queue.url import QueueURL, parse_queue_url
from megatron_ext.errors import ConfigError

__all__ = ["run_status", "status_report"]


def _own_queue(run_dir: Path, url: QueueURL) -> QueueURL:
    """The queue to read. A copied run folder's run.json still names the original run's SQLite
    queue: reading it would show the other run's state as this one's, so that is refused where
    this folder has its own ``queue.db``. A relative SQLite path that does not resolve from
    here (status run from another folder) is this folder's ``queue.db``."""
    own = run_dir / "queue.db"
    if url.backend != "sqlite" or url.path is None or not own.is_file():
        return url
    if not url.path.exists():
        return parse_queue_url(f"sqlite:///{own}")
    if url.path.resolve() != own.resolve():
        raise ConfigError(
            f"{run_dir}/dipaco/run.json names the queue {url.display}, not this folder's "
            f"{own} (a copied run?): run status on the folder that queue belongs to"
        )
    return url


def status_report(run_dir: str | Path) -> dict[str, Any]:
    """The run's state as a JSON-able dict."""
    info_path = Path(run_dir) / "dipaco" / "run.json"
    if not info_path.is_file():
        raise ConfigError(
            f"{run_dir} is not a DiPaCo run folder (no dipaco/run.json): give the run_dir of a "
            f"run a worker has started"
        )
    try:
        info = json.loads(info_path.read_text(encoding="utf-8"))
        queue_text = info["queue"]
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError) as exc:
        raise ConfigError(
            f"{info_path} is not the run.json a DiPaCo run writes ({type(exc).__name__}: {exc}): "
            "give the run_dir of an unmodified run"
        ) from None
    url = parse_queue_url(queue_text)
    url = _own_queue(Path(run_dir), url)
    try:
        queue = TaskQueue(url, lease_seconds=1.0, max_attempts=1, worker="status")
    except sqlite3.DatabaseError as exc:
        raise ConfigError(
            f"{url.display} is not a DiPaCo queue database ({exc}): give the run_dir of an "
            "unmodified run"
        ) from None
    try:
        counts = queue.counts()
        tasks = queue.db.query("SELECT id, state, result FROM dipaco_tasks ORDER BY id")
        workers = queue.workers()
        now = queue.db.now()
        events = queue.events()
    finally:
        queue.close()
    versions: dict[str, int] = {}
    phases: dict[int, dict[str, int]] = {}
    for task, state, _ in tasks:
        parts = task.split("/")
        if parts[0] == "outer" and state == "done":
            versions[parts[2]] = max(versions.get(parts[2], 0), int(parts[1]) + 1)
        if parts[0] in ("train", "outer"):
            phase = phases.setdefault(int(parts[1]), dict.fromkeys(STATES, 0))
            phase[state] += 1
    kinds = [e[4] for e in events]
    return {
        "queue": url.display,
        "tasks": counts,
        "phases": {str(k): v for k, v in sorted(phases.items())},
        "module_versions": dict(sorted(versions.items())),
        "workers": [
            {
                "id": w[0],
                "host": w[1],
                "pid": w[2],
                "seen_s_ago": round(now - w[4], 1),
                "task": w[5],
            }
            for w in workers
            if w[0] != "status"
        ],
        "events": {k: kinds.count(k) for k in sorted(set(kinds))},
        "complete": all(v["done"] == sum(v.values()) for v in counts.values()) if counts else False,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def run_status(run_dir: str, as_json: bool) -> int:
    report = status_report(run_dir)
    if as_json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"queue {report['queue']}  ({'complete' if report['complete'] else 'in progress'})")
    for kind, states in report["tasks"].items():
        print(f"  {kind:<8} " + "  ".join(f"{s} {n}" for s, n in states.items()))
    for phase, states in report["phases"].items():
        print(f"  phase {phase}: " + "  ".join(f"{s} {n}" for s, n in states.items() if n))
    if report["module_versions"]:
        print(
            "  module versions: "
            + ", ".join(f"{m} v{v}" for m, v in report["module_versions"].items())
        )
    for w in report["workers"]:
        print(f"  worker {w['id']} (seen {w['seen_s_ago']} s ago) task {w['task']}")
    if report["events"]:
        print("  events: " + ", ".join(f"{k} {n}" for k, n in report["events"].items()))
    return 0
