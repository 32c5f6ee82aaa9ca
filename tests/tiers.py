"""The suite's two lanes: ``make test`` runs everything; ``make test-fast`` only what stays in
the pytest process (no torchrun, no subprocess), for the edit-test loop.

Markers are applied at collection (:func:`mark_items`), never by hand: a test is ``torchrun``
when it reaches :func:`tests.conftest.run_torchrun`, and ``subprocess`` when it reaches anything
that starts a process (:data:`SPAWNS`) — through its own body, its fixtures, and the helper
functions of its module and of ``conftest`` that those call, followed transitively by name.
In the fast lane (``MEGATRON_EXT_FAST_LANE=1``) :func:`guard_process_starts` makes a Python or
torchrun process start inside an unmarked test fail it, naming this module, so that a helper
the reading missed cannot slow the lane down unnoticed.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import os
import subprocess
import textwrap
from collections.abc import Callable, Iterable, Iterator
from types import ModuleType
from typing import Any

import pytest

#: names whose use starts a process (the stdlib's, the harness's, and the product functions
#: that start one: a launcher run, DiPaCo's worker processes and fault scenarios, a PostgreSQL
#: server)
SPAWNS = frozenset(
    {
        "subprocess",
        "Popen",
        "run_torchrun",
        "warm_zygote",
        "Zygote",
        "run_ranks",
        "launch_run",
        "small_run",
        "PostgresServer",
        "postgres_server",
        "fault_run",
        "stopped_job_run",
        "signalled_run",
        "multiprocessing",
        "ProcessPoolExecutor",
    }
)
FIXTURE = "fixture:"  # prefix of a fixture reached by name (getfixturevalue)
#: what marks a Python process start as this project's (the CLI, the harness, torchrun)
OURS = ("megatron_ext", "megatron-ext", "tests.", "tests/", "torch.distributed.run")
MARKERS = {
    "torchrun": "starts ranks under run_torchrun (warm or cold)",
    "subprocess": "starts a process (CLI, torchrun, a server); not in make test-fast",
}


def register(config: pytest.Config) -> None:
    for name, text in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def mark_items(items: Iterable[pytest.Item], conftest: ModuleType) -> None:
    """Add ``torchrun`` / ``subprocess`` to every test that reaches them."""
    cache: dict[int, set[str]] = {}
    for item in items:
        if not isinstance(item, pytest.Function):
            continue
        names = _reached(item, conftest, cache)
        if "run_torchrun" in names:
            item.add_marker("torchrun")
        if names & SPAWNS:
            item.add_marker("subprocess")


def process_heavy_files_first(items: list[pytest.Item]) -> None:
    """Reorder ``items`` in place: files by their number of ``subprocess`` tests, most first
    (stable: files with as many keep their order, tests keep theirs within a file).

    ``make test`` hands whole files to two pytest-xdist workers in this order
    (``--dist loadfile``); the files that start processes are the long ones, and a long file
    handed out last leaves the other worker idle while it runs."""
    heavy: dict[str, int] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        heavy[path] = heavy.get(path, 0) + (item.get_closest_marker("subprocess") is not None)
    order = {path: rank for rank, path in enumerate(heavy)}
    items.sort(
        key=lambda item: (
            -heavy[item.nodeid.split("::", 1)[0]],
            order[item.nodeid.split("::", 1)[0]],
        )
    )


def _reached(item: pytest.Function, conftest: ModuleType, cache: dict[int, set[str]]) -> set:
    """Every name the test's body, fixtures and same-module helpers refer to, transitively."""
    module = item.module
    helpers = {**_functions(conftest), **_functions(module)}
    fixtures = [
        fixturedef.func
        for defs in item._fixtureinfo.name2fixturedefs.values()
        for fixturedef in defs
    ]
    todo: list[Callable[..., Any]] = [item.function, *fixtures]
    seen: set[int] = set()
    names: set[str] = set()
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen.add(id(fn))
        if id(fn) not in cache:
            cache[id(fn)] = _names_in(fn)
        found = cache[id(fn)]
        names |= found
        todo.extend(helpers[n] for n in found if n in helpers)
        for name in (n.removeprefix(FIXTURE) for n in found if n.startswith(FIXTURE)):
            defs = item.session._fixturemanager.getfixturedefs(name, item) or ()
            todo.extend(fixturedef.func for fixturedef in defs)
    return names


def _functions(module: ModuleType) -> dict[str, Callable[..., Any]]:
    """The module's functions, and those it imported from other test modules."""
    return {
        name: value
        for name, value in vars(module).items()
        if inspect.isfunction(value)
        and (value.__module__ == module.__name__ or value.__module__.startswith("tests."))
    }


def _names_in(fn: Callable[..., Any]) -> set[str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif (  # request.getfixturevalue("name"): the fixture is reached too
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "getfixturevalue"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(FIXTURE + str(node.args[0].value))
    return names


@contextlib.contextmanager
def guard_process_starts(item: pytest.Item) -> Iterator[None]:
    """In the fast lane, fail an unmarked test the moment it starts a Python process of this
    project (:data:`OURS`; a library's own helper process, e.g. a compiler worker, is not)."""
    if os.environ.get("MEGATRON_EXT_FAST_LANE") != "1" or item.get_closest_marker("subprocess"):
        yield
        return
    real_init = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        argv = [str(a) for a in ([args] if isinstance(args, str | os.PathLike) else args)]
        program = os.path.basename(argv[0]) if argv else ""
        ours = any(word in a for a in argv for word in OURS)  # not a library's own helper
        if program.startswith("megatron-ext") or (program.startswith("python") and ours):
            pytest.fail(
                f"{item.nodeid} started {' '.join(map(str, argv))[:200]} in the fast lane, but "
                "the marker hook (tests/tiers.py) did not mark it: add the helper that starts "
                "it to tests/tiers.py::SPAWNS"
            )
        real_init(self, args, *rest, **kwargs)

    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]
    try:
        yield
    finally:
        subprocess.Popen.__init__ = real_init  # type: ignore[method-assign]
