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
    tally.send(session.config)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: object, error: object) -> None:
    """pytest-xdist: a worker ended; add its process-start counts to the report."""
    tally.receive(node)


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
    tiers.process_heavy_files_first(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    with tiers.guard_process_starts(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> object:
    with tiers.guard_process_starts(item):
        return (yield)


def run_cli(argv: list[str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    """``megatron-ext ARGV`` as a user runs it: its own process (2 OpenMP threads, warnings
    off), output captured; fails the test with the output's tail when it exits non-zero."""
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, "-m", "megatron_ext.launch.cli", *argv],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def warm_launch_run(recipe: str, overrides: list[str], run_dir: Path, label: str) -> Path:
    """:func:`megatron_ext.bench.common.launch_run` with the ranks forked from the session's
    zygote (:func:`run_torchrun`) instead of a launcher process starting torchrun cold.

    The command is the launcher's own (``build_launch_command``: the recipe checked at the job's
    world size, the rank entry ``megatron-ext train`` with the recipe and overrides, the ranks'
    thread count); what it skips is the launcher's process supervision, which the launcher's
    tests and the cold smoke runs cover. The ranks' output goes to ``run_dir/run.log``; a run
    that fails raises as ``launch_run`` does. A benchmark may call it from several threads
    (``bench paper`` runs two at a time); the zygote forks one launch at a time."""
    from megatron_ext.launch.launcher import LaunchRequest, build_launch_command, probe_host

    run_dir.mkdir(parents=True, exist_ok=True)
    request = LaunchRequest(recipe, (*overrides, f"run_dir={run_dir}"))
    argv, env = build_launch_command(request, os.environ, probe_host())
    torchrun = argv.index("torch.distributed.run")
    nproc = int(argv[argv.index("--nproc-per-node", torchrun) + 1])
    entry = argv.index("-m", torchrun)  # the rank entry: -m megatron_ext.launch.cli train ...
    rank_env = {k: v for k, v in env.items() if k != "PYTHONUNBUFFERED"}  # the zygote's lines
    proc = run_torchrun(
        argv[entry + 1], nproc, *argv[entry + 2 :], module=True, env=rank_env, check=False
    )
    (run_dir / "run.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-5:]
        raise RuntimeError(f"the {label} run failed (exit {proc.returncode}):\n" + "\n".join(tail))
    return run_dir


@pytest.fixture
def warm_benchmark_runs(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Every benchmark's launcher run (``bench.common.launch_run``, looked up at call time) goes
    through :func:`warm_launch_run` for the test; returns a counter of the runs
    (``counter["calls"]``) so that a test can assert its runs took this path."""
    from megatron_ext.bench import common

    counter = {"calls": 0}

    def counted(recipe: str, overrides: list[str], run_dir: Path, label: str) -> Path:
        counter["calls"] += 1
        return warm_launch_run(recipe, overrides, run_dir, label)

    monkeypatch.setattr(common, "launch_run", counted)
    return counter
