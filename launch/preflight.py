"""What the launcher checks on this node before any process starts (after the recipe itself).

Each check that fails raises ``ConfigError`` (one line, exit 2): the dataset prefix exists or a
source to build it from is given, the run directory is writable, the rendezvous port is free on
the node that hosts it. Free disk for the next checkpoint is only a warning: the estimate
(:func:`checkpoint_bytes`, from the model section and the optimizer's state bytes) is rough.

Torch-free.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import sys
from pathlib import Path

from megatron_ext.config.schema import Recipe
from megatron_ext.errors import ConfigError
from megatron_ext.optimizers.spec import optimizer_spec

__all__ = ["check_before_launch", "checkpoint_bytes"]


def check_before_launch(recipe: Recipe, rdzv_endpoint: str | None, node_rank: int) -> None:
    """Every check of this module, in order (see the module docstring)."""
    check_data(recipe)
    check_run_dir(Path(recipe.run_dir))
    if rdzv_endpoint is not None and node_rank == 0:
        host, _, port = rdzv_endpoint.rpartition(":")
        check_port_free(host.strip("[]"), int(port))
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


def check_port_free(host: str, port: int) -> None:
    """The rendezvous port is free on this node when this node hosts it (a host name that is
    not this node's is not checked)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigError(
                    f"the rendezvous port {host}:{port} is in use on this node (another job?): "
                    "set launch.master_port or --rdzv-endpoint to a free port"
                ) from None
            # EADDRNOTAVAIL / unresolvable: the endpoint is another machine's


def checkpoint_bytes(recipe: Recipe) -> int:
    """Rough bytes of one checkpoint: the model's parameters (from ``model:``) times the weight,
    fp32 master and optimizer-state bytes per element."""
    m = recipe.model
    h, layers = m.hidden_size, m.num_layers
    groups = m.num_query_groups or m.num_attention_heads
    kv = m.kv_channels or h // m.num_attention_heads
    ffn = m.ffn_hidden_size or 4 * h
    mats = 3 if m.activation == "swiglu" else 2
    attention = h * (m.num_attention_heads * kv + 2 * groups * kv) + m.num_attention_heads * kv * h
    if m.num_moe_experts:
        mlp = m.num_moe_experts * mats * h * (m.moe_ffn_hidden_size or ffn)
    else:
        mlp = mats * h * ffn
    hidden = layers * (attention + mlp)
    vocab = m.vocab_size or (32000 if recipe.data.tokenizer == "sentencepiece" else 384)
    embeddings = vocab * h * (2 if m.untie_embeddings_and_output_weights else 1)
    fp32 = recipe.training.precision == "fp32"
    weights = 4 if fp32 else 2 + 4  # bf16 weights carry an fp32 master
    matrix_state = optimizer_spec(recipe.optimizer.name).state_bytes(1024, 1024) / 1024**2
    adamw_state = optimizer_spec("adamw").state_bytes(1024, 1024) / 1024**2
    return int(hidden * (weights + matrix_state) + embeddings * (weights + adamw_state))


def warn_if_disk_short(recipe: Recipe) -> None:
    """A warning (stderr) when ``run_dir``'s file system has less room than a checkpoint
    (of a GPT model: a recipe with ``model`` and ``optimizer`` sections)."""
    if not {"model", "optimizer"} <= set(recipe.sections):
        return
    need = checkpoint_bytes(recipe)
    free = shutil.disk_usage(recipe.run_dir).free
    if free < need:
        print(
            f"megatron-ext: warning: {recipe.run_dir} has {free / 1e9:.1f} GB free; the next "
            f"checkpoint needs about {need / 1e9:.1f} GB (model and optimizer state): saving "
            f"may fail",
            file=sys.stderr,
            flush=True,
        )
