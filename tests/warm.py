"""Warm ranks for the tests: one process imports torch, megatron-core and megatron-ext once, and
every launch of :func:`tests.conftest.run_torchrun` forks its ranks from it.

A rank started cold spends ~8 s of CPU importing torch and megatron-core before its first line
of work, and torchrun's own interpreter ~3 s more; ~100 launches of 2 ranks on 2 cores made that
most of the suite's time. Here the imports happen once per test session, in the *zygote* (this
module run as a server); a launch sends it one request and it forks the ranks.

Each rank gets what torchrun gives a worker, and nothing of the zygote's run time (it never runs
a tensor operation, so it starts no thread pool):

- the environment torchrun sets (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
  ``GROUP_RANK``, ``ROLE_*``, ``TORCHELASTIC_*``), with the rendezvous store hosted by the zygote
  as torchrun's agent hosts it (``TORCHELASTIC_USE_AGENT_STORE``; bound to a port the kernel
  picks, so no other process can take it between choosing and binding, which made a rank fail
  with ``EADDRINUSE`` now and then)
  over the launch's own environment, its working directory, ``sys.argv`` and ``sys.path`` as
  ``python SCRIPT`` / ``python -m MODULE`` would set them, the launch's ``PYTHONPATH`` in front;
- its stdout and stderr appended, line by line, to the launch's two files (as torchrun's ranks
  share its pipes), stdin closed; ``torch.set_num_threads(OMP_NUM_THREADS)``;
- Python's ``random`` and torch's default generator reseeded from the OS, as a fresh process
  starts them (forks would share the zygote's); ``tests/test_warm.py`` compares a warm rank
  with a torchrun one;
- torchrun's rule on failure: when a rank exits non-zero the others get SIGTERM, SIGKILL
  :data:`GRACE_S` later, and the launch exits 1; a launch past its timeout is killed whole.

A rank ends the way every test rank ends (:func:`end_rank`): non-daemon threads joined, ``atexit``
handlers run, streams flushed, then ``os._exit`` — without the interpreter's teardown of C++
objects, where gloo's transport, torn down while a peer still closes its own, aborted a rank now
and then (``terminate called without an active exception``, exit -6).

A launch whose environment differs from the zygote's in what an interpreter or a native library
reads once at start-up (:data:`STARTUP_PREFIXES`) is not warm-started: ``run_torchrun`` runs it
under torchrun, as it runs everything with ``MEGATRON_EXT_TEST_COLD=1``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import json
import os
import random
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

#: what the zygote imports before it serves (what the test ranks import)
PRELOAD = (
    "numpy",
    "torch",
    "torch.distributed",
    "megatron.core",
    "megatron.core.models.gpt",
    "megatron.core.dist_checkpointing",
    "megatron.core.distributed",
    "megatron.core.optimizer",
    "megatron_ext.launch.cli",
    "megatron_ext.run.entry",
    "megatron_ext.gpt.trainer",
    "megatron_ext.distributed.layerwise",
    "megatron_ext.soma.trainer",
    "megatron_ext.dipaco.trainer",
    "sklearn.feature_extraction.text",
)
#: environment variables read once at interpreter or library start-up: a launch that sets one
#: of them differently from the zygote runs cold (PYTHONPATH and OMP_NUM_THREADS are applied)
STARTUP_PREFIXES = ("PYTHON", "LD_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "MALLOC_")
APPLIED = ("PYTHONPATH", "OMP_NUM_THREADS")
GRACE_S = 10.0  # SIGTERM -> SIGKILL for the ranks left when one fails


def differs_at_startup(env: dict[str, str], base: dict[str, str]) -> list[str]:
    """The start-up variables (:data:`STARTUP_PREFIXES`) that ``env`` sets otherwise than
    ``base``."""
    keys = {k for k in (*env, *base) if k.startswith(STARTUP_PREFIXES) and k not in APPLIED}
    return sorted(k for k in keys if env.get(k) != base.get(k))


# ---------------------------------------------------------------------------------------------
# the zygote


def serve(socket_path: str) -> None:
    """Import :data:`PRELOAD`, then fork the ranks of one request at a time, forever."""
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(4)
    listener.settimeout(5.0)
    parent = os.getppid()
    print("ready", flush=True)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if os.getppid() != parent:  # the test session is gone (killed): so is its server
                return
            continue
        conn.settimeout(None)
        with conn:
            request = json.loads(conn.makefile("r").readline())
            reply = _launch(request, listener, conn)
            conn.sendall((json.dumps(reply) + "\n").encode())


def _launch(request: dict[str, Any], listener: socket.socket, conn: socket.socket) -> dict:
    nproc = request["nproc"]
    run_id = uuid.uuid4().hex[:12]
    pids, ports = [], []
    for rank in range(nproc):
        read_port, write_port = os.pipe()
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.close()
            os.close(write_port)
            _rank(request, _torchrun_env(rank, nproc, run_id), read_port)
        os.close(read_port)
        pids.append(pid)
        ports.append(write_port)
    # The rendezvous store is ours, as torchrun's agent hosts it: bound to a port the kernel
    # picks (no window between choosing a free port and binding it, in which another process
    # can take it), created after the forks (no store thread in a forked rank), its port sent
    # to every rank through its pipe.
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    for write_port in ports:
        os.write(write_port, f"{store.port}\n".encode())
        os.close(write_port)
    codes: dict[int, int] = {}
    deadline = time.monotonic() + request["timeout"]
    stopping_since = None
    while len(codes) < nproc:
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = os.waitstatus_to_exitcode(status)
        failed = any(code != 0 for code in codes.values())
        now = time.monotonic()
        if now > deadline:
            _signal_all(pids, codes, signal.SIGKILL)
            _reap(pids, codes)
            return {"timed_out": True, "codes": [codes.get(p) for p in pids]}
        if failed and stopping_since is None:
            stopping_since = now
            _signal_all(pids, codes, signal.SIGTERM)
        elif stopping_since is not None and now - stopping_since > GRACE_S:
            _signal_all(pids, codes, signal.SIGKILL)
        time.sleep(0.005)
    for pid in pids:  # helpers a rank left behind (e.g. a checkpoint writer)
        _kill_group(pid, signal.SIGKILL)
    del store
    return {"timed_out": False, "codes": [codes[p] for p in pids]}


def _signal_all(pids: list[int], codes: dict[int, int], sig: int) -> None:
    for pid in pids:
        if pid not in codes:
            _kill_group(pid, sig)


def _kill_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _reap(pids: list[int], codes: dict[int, int]) -> None:
    for pid in pids:
        if pid not in codes:
            codes[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def _torchrun_env(rank: int, nproc: int, run_id: str) -> dict[str, str]:
    """The variables torchrun sets for worker ``rank`` of one node's ``nproc`` (MASTER_PORT:
    the zygote's store, sent once it exists)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "ROLE_WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "localhost",  # as torchrun --standalone sets it
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank a client of the zygote's store
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


def _rank(request: dict[str, Any], rank_env: dict[str, str], read_port: int) -> None:
    """The forked rank: set up as a fresh ``python SCRIPT ARGS`` would be, run, end.
    ``read_port``: the pipe that brings the rendezvous store's port."""
    code = 1
    try:
        with os.fdopen(read_port) as pipe:
            rank_env = {**rank_env, "MASTER_PORT": pipe.readline().strip()}
        os.setpgid(0, 0)  # the rank and what it starts can be stopped together
        for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update({**request["env"], **rank_env})
        _redirect(request["stdout"], request["stderr"])
        random.seed()
        import torch

        torch.seed()  # a fresh process's generator starts from a seed of its own
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
        code = _run_main(request["argv"], request["cwd"], os.environ.get("PYTHONPATH", ""))
    except BaseException:  # the harness itself failed: say so where the test reads
        traceback.print_exc()
    end_rank(code)


def _redirect(stdout: str, stderr: str) -> None:
    for path, fd in ((stdout, 1), (stderr, 2)):
        target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(target, fd)
        os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False),
            encoding="utf-8",
            errors="backslashreplace",
            line_buffering=True,  # one write per line: ranks share the files
        )
        for fd in (1, 2)
    )


def _run_main(argv: list[str], cwd: str, pythonpath: str) -> int:
    """Run ``python ARGV`` (``SCRIPT ...`` or ``-m MODULE ...``) here; its exit code."""
    front = [p for p in pythonpath.split(os.pathsep) if p]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[:0] = [cwd, *front]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[:0] = [str(Path(argv[0]).resolve().parent), *front]
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            return stop.code or 0
        print(stop.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def end_rank(code: int) -> None:
    """End this process as Python's own exit would, less the interpreter's teardown: the way
    every rank ends (:func:`megatron_ext.run.ending.end_process`)."""
    from megatron_ext.run.ending import end_process

    end_process(code)


# ---------------------------------------------------------------------------------------------
# the client (the pytest process)


class Zygote:
    """The session's warm-start server: started on first use, ended with the session.

    One per process (:meth:`session`): pytest imports ``conftest`` both as ``conftest`` and as
    ``tests.conftest``, so the one server is kept here, in a module imported once."""

    _session: Zygote | None = None

    @classmethod
    def session(cls, env: dict[str, str], cwd: Path) -> Zygote:
        if cls._session is None:
            cls._session = cls(env, cwd)
            atexit.register(cls.close_session)
        return cls._session

    @classmethod
    def close_session(cls) -> None:
        if cls._session is not None:
            cls._session.close()
            cls._session = None

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        self.env = env
        self.folder = tempfile.mkdtemp(prefix="warm-ranks-")
        self.socket_path = os.path.join(self.folder, "zygote.sock")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm", self.socket_path],
            cwd=cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(self.folder, "zygote.log"), "w"),  # noqa: SIM115
            text=True,
        )
        line = self.process.stdout.readline()
        if line.strip() != "ready":
            log = Path(self.folder, "zygote.log").read_text()
            raise RuntimeError(f"the warm-rank zygote did not start:\n{log[-4000:]}")

    def launch(
        self, argv: list[str], nproc: int, env: dict[str, str], cwd: Path, timeout: float
    ) -> tuple[int, str, str]:
        """Run ``python ARGV`` on ``nproc`` forked ranks; (exit code as torchrun's, stdout,
        stderr). ``subprocess.TimeoutExpired`` past ``timeout``."""
        with tempfile.TemporaryDirectory(dir=self.folder) as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {
                "argv": argv,
                "nproc": nproc,
                "env": env,
                "cwd": str(cwd),
                "stdout": out,
                "stderr": err,
                "timeout": timeout,
            }
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.connect(self.socket_path)
                conn.sendall((json.dumps(request) + "\n").encode())
                reply = json.loads(conn.makefile("r").readline())
            texts = [
                Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in (out, err)
            ]
        if reply["timed_out"]:
            raise subprocess.TimeoutExpired(["warm", *argv], timeout, texts[0], texts[1])
        codes = reply["codes"]
        if any(codes):  # what torchrun's failure summary tells
            texts[1] += "".join(
                f"warm ranks: rank {rank} exited {code}\n" for rank, code in enumerate(codes)
            )
        return (1 if any(codes) else 0), texts[0], texts[1]

    def close(self) -> None:
        self.process.kill()
        self.process.wait()


if __name__ == "__main__":
    serve(sys.argv[1])
