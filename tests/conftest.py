"""Shared test helpers: running scripts under torchrun on CPU/gloo."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests import tally, tiers
from tests.warm import Zygote, differs_at_startup

ROOT = Path(__file__).resolve().parent.parent
DIST = Path(__file__).resolve().parent / "dist"
SITE = DIST / "site"  # sitecustomize.py for the processes run_torchrun starts


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    script: str | Path,
    nproc: int,
    *args: str,
    timeout: int = 600,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    check: bool = True,
    module: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``script`` (a file, or a module name with ``module=True``) with ``nproc`` gloo ranks
    on this host; fails the test with the output when it exits non-zero and ``check``."""
    full_env = {**rank_base_env(), **(env or {})}
    argv = [*(["-m"] if module else []), str(script), *args]
    zygote = warm_zygote()
    if zygote is not None and not differs_at_startup(full_env, zygote.env):
        code, out, err = zygote.launch(argv, nproc, full_env, cwd or ROOT, timeout)
        tally.warm_launch(nproc)
        proc = subprocess.CompletedProcess(["warm", str(nproc), *argv], code, out, err)
        return _checked(proc, check)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # the agent's store on a port it binds itself: no free-port race
        "--nproc-per-node",
        str(nproc),
        *argv,
    ]
    # Output goes to files, not pipes: helper processes that outlive a crashed rank (e.g.
    # dist_checkpointing's writer) would hold a pipe open and block the read until timeout.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        code = subprocess.run(
            cmd, stdout=out, stderr=err, timeout=timeout, cwd=cwd or ROOT, env=full_env
        ).returncode
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(cmd, code, out.read(), err.read())
    return _checked(proc, check)


def _checked(proc: subprocess.CompletedProcess, check: bool) -> subprocess.CompletedProcess:
    if check and proc.returncode != 0:
        pytest.fail(
            f"{' '.join(proc.args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def rank_base_env() -> dict[str, str]:
    """The environment of every rank ``run_torchrun`` starts: one OpenMP thread, warnings off,
    and each line one write (``dist/site/sitecustomize.py`` leads PYTHONPATH: torchrun runs its
    ranks unbuffered, ``python -u``, where a rank's print writes its text and its newline
    separately and the other rank's line can land in between; seen in CI)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(SITE), str(ROOT), *filter(None, [env.get("PYTHONPATH")])]
    )
    return env


def warm_zygote() -> Zygote | None:
    """The session's warm-rank server (:mod:`tests.warm`), started on first use; None with
    ``MEGATRON_EXT_TEST_COLD=1`` (every launch under torchrun, as before)."""
    if os.environ.get("MEGATRON_EXT_TEST_COLD") == "1":
        return None
    return Zygote.session(rank_base_env(), ROOT)


def pytest_sessionfinish(session: pytest.Session) -> None:
    Zygote.close_session()


@pytest.fixture(scope="module")
def one_torch_thread():
    """Small tensors: one thread is as fast, and avoids OpenMP barrier stalls (several times
    slower) when other jobs share the CPU. Use with ``pytest.mark.usefixtures``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def count_calls(monkeypatch):
    """``count_calls(module, name) -> counter``: replaces ``module.name`` for the test by a
    wrapper that counts its calls (``counter["calls"]``) and runs the original, so that a test
    can assert which path a forward took and cannot pass on a fallback alone."""

    def install(module: object, name: str) -> dict[str, int]:
        counter = {"calls": 0}
        real = getattr(module, name)

        def counting(*args: object, **kwargs: object) -> object:
            counter["calls"] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)
        return counter

    return install


def pytest_configure(config: pytest.Config) -> None:
    tiers.register(config)
    tally.install()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    tally.record(report)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    terminalreporter.section("suite cost (tests/tally.py)")
    for line in tally.summary():
        terminalreporter.write_line(line)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.mark_items(items, sys.modules[__name__])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    with tiers.guard_process_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    with tiers.guard_process_starts(item):
        return (yield)
