"""What the launcher checks on this node before any process starts (after the recipe itself).

Each check that fails raises ``ConfigError`` (one line, exit 2): the dataset prefix exists or a
source to build it from is given, the tokenizer file is one, the dataset's token ids fit the
model's vocabulary (:mod:`.preflight_data`), the run directory is writable, the rendezvous host
resolves, the rendezvous port is free on the node that hosts it and, on the other nodes, answers
within ``launch.rdzv_timeout_s``. ``launch --dry-run`` makes the same checks and writes nothing
(the run directory is not created: the folder it would be created in must be writable; the
endpoint's host is not resolved and the other nodes do not wait for a rendezvous). Free disk for
the next checkpoint is only a warning: the planner's
:func:`~megatron_ext.planner.plan.checkpoint_bytes` (the whole model's parameters and their
optimizer state) leaves out file metadata and the data loader's state.

Torch-free.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from megatron_ext.config.schema import Recipe
from megatron_ext.errors import ConfigError
from megatron_ext.launch.preflight_data import check_tokenizer_and_vocabulary
from megatron_ext.planner.plan import checkpoint_bytes

__all__ = [
    "check_before_launch",
    "check_endpoint_resolves",
    "check_port_free",
    "wait_for_rendezvous",
    "warn_if_disk_short",
]


def check_before_launch(
    recipe: Recipe, rdzv_endpoint: str | None, node_rank: int, *, dry_run: bool = False
) -> None:
    """Every check of this module, in order (see the module docstring); ``dry_run``: the same
    checks, writing nothing."""
    check_data(recipe)
    check_tokenizer_and_vocabulary(recipe)
    if dry_run:
        check_run_dir_could_be_written(Path(recipe.run_dir))
    else:
        check_run_dir(Path(recipe.run_dir))
    if rdzv_endpoint is not None:
        host, _, port = rdzv_endpoint.rpartition(":")
        if not dry_run:  # a dry run may check a cluster's command on another machine
            check_endpoint_resolves(host.strip("[]"), int(port))
        if node_rank == 0:
            check_port_free(host.strip("[]"), int(port))
        elif not dry_run:
            wait_for_rendezvous(host.strip("[]"), int(port), recipe.launch.rdzv_timeout_s)
    if not dry_run:
        warn_if_disk_short(recipe)


def check_data(recipe: Recipe) -> None:
    """``data.path`` names an indexed dataset (``.bin`` and ``.idx``) or ``data.source`` says
    what to build it from."""
    data = recipe.sections.get("data")
    if data is None:
        return
    path, source = data.path, data.source
    if not path or source:
        return
    missing = [s for s in (".bin", ".idx") if not Path(path + s).is_file()]
    if missing:
        raise ConfigError(
            f"data.path={path!r}: {' and '.join(path + s for s in missing)} not found, and no "
            f"data.source to build it from: build it (megatron-ext data build FILES --output "
            f"{path}) or set data.source"
        )


def check_run_dir(run_dir: Path) -> None:
    """``run_dir`` exists (created if missing) and a file can be written in it."""
    probe = run_dir / f".write_test.{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(
            f"run_dir={str(run_dir)!r} is not writable ({exc.strerror or exc}): choose another "
            "run_dir or fix its permissions"
        ) from None


def check_run_dir_could_be_written(run_dir: Path) -> None:
    """What :func:`check_run_dir` checks, without creating or writing anything: ``run_dir`` is a
    writable folder, or the nearest existing folder above it is writable."""
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    problem = ""
    if not existing.is_dir():
        problem = f"{existing} is not a folder"
    elif not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not writable"
    if problem:
        raise ConfigError(
            f"run_dir={str(run_dir)!r} is not writable ({problem}): choose another run_dir or "
            "fix its permissions"
        )


def check_endpoint_resolves(host: str, port: int) -> None:
    """The rendezvous host is a name this node can resolve (a typo would otherwise surface as
    torchrun's connection timeout, minutes later)."""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(
            f"--rdzv-endpoint {host}:{port}: this node cannot resolve {host!r} "
            f"({exc.strerror}): give the first node's name or address as the other nodes "
            "know it"
        ) from None


def wait_for_rendezvous(host: str, port: int, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for the first node's rendezvous store to accept a connection
    (a node may start before the first one).

    torchrun would fail the same way, but only after its store client's retries (seen: 30-50 s
    for a 15 s timeout) and with a C++ stack trace; a wrong or unreachable endpoint is this
    one line, within the rendezvous timeout."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ConfigError(
                f"--rdzv-endpoint {host}:{port}: the first node's rendezvous did not answer "
                f"within {timeout_s:g} s (launch.rdzv_timeout_s; last attempt: {last}): start "
                "node 0's launcher with the same endpoint, or check the host and port"
            )
        try:
            socket.create_connection((host, port), timeout=min(left, 5.0)).close()
            return
        except OSError as exc:
            last = exc.strerror or str(exc) or type(exc).__name__
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def check_port_free(host: str, port: int) -> None:
    """The rendezvous port is free on this node when this node hosts it (a host name that is
    not this node's is not checked).

    The probe binds as torchrun's store does, with SO_REUSEADDR: a port that only holds
    TIME_WAIT connections of the previous job (its store closed first) is free for the next
    one; a port something listens on is not."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"the rendezvous port {host}:{port} is in use on this node (another job?): "
                    "set launch.master_port or --rdzv-endpoint to a free port"
                ) from None
            # EADDRNOTAVAIL / unresolvable: the endpoint is another machine's


def warn_if_disk_short(recipe: Recipe) -> None:
    """A warning (stderr) when ``run_dir``'s file system has less room than a checkpoint
    (of a GPT model: a recipe with ``model`` and ``optimizer`` sections). No estimate when the
    planner cannot list the model (a tokenizer it cannot read: the data check and the launch's
    plan say so; this warning has nothing to add)."""
    if not {"model", "optimizer"} <= set(recipe.sections):
        return
    try:
        need = checkpoint_bytes(recipe)
    except ConfigError:
        return
    free = shutil.disk_usage(recipe.run_dir).free
    if free < need:
        print(
            f"megatron-ext: warning: {recipe.run_dir} has {free / 1e9:.1f} GB free; the next "
            f"checkpoint needs about {need / 1e9:.1f} GB (model and optimizer state): saving "
            f"may fail",
            file=sys.stderr,
            flush=True,
        )
