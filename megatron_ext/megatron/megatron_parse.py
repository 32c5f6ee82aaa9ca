"""Megatron-LM's own reading of a flag list: ``parse_args`` + ``validate_args`` on a CPU host.

:func:`parse_megatron` hands the flags of a launch script (read by :mod:`.megatron_args`) to
Megatron-LM 0.19's parser and validation (``megatron.training.arguments``, shipped in the
megatron-core wheel) with ``pretrain_gpt.py``'s ``args_defaults`` (GPT-2 BPE tokenizer), at the
script's world size. What Megatron-LM derives -- sequence parallelism off at TP=1, the data
parallel size, the tokenizer default -- is then its own, not a copy of its rules; an unknown
flag, a typo or a refused combination is Megatron-LM's message, raised as a ConfigError.

``validate_args`` asks the GPU for its compute capability and architecture (grouped GEMM needs
>= 8.0, CUDA_DEVICE_MAX_CONNECTIONS matters before Blackwell) and Transformer Engine for its
version; a CPU host has neither, so the answers are the target's: the GPU's
(:data:`GPU_CAPABILITY`, default H100) and a Transformer Engine new enough (NGC's container),
and the conversion says so. Nothing else is replaced.

:func:`transformer_fields` is megatron-core's ``TransformerConfig`` as Megatron-LM builds it
(``core_transformer_config_from_args``): every field whose value differs from the dataclass's
default, as YAML values (functions and dtypes by name). The GPT trainer builds its
``TransformerConfig`` from them (:mod:`megatron_ext.megatron.model`).

Imports torch and megatron (inside the functions): the CLI converts, the launcher never does.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
from argparse import Namespace
from collections.abc import Iterator, Sequence
from typing import Any
from unittest import mock

from megatron_ext.errors import ConfigError

__all__ = [
    "GPU_CAPABILITY",
    "PGT_ARGS_DEFAULTS",
    "megatron_flag_dests",
    "megatron_transformer_config",
    "parse_megatron",
    "transformer_fields",
]

#: compute capability (major, minor) of the GPUs a script may target (NVIDIA's table)
GPU_CAPABILITY: dict[str, tuple[int, int]] = {
    "V100": (7, 0),
    "A100": (8, 0),
    "H100": (9, 0),
    "H200": (9, 0),
    "B200": (10, 0),
    "GB200": (10, 0),
}
#: ``pretrain_gpt.py``'s ``args_defaults`` (Megatron-LM core_r0.19.0)
PGT_ARGS_DEFAULTS: dict[str, Any] = {"tokenizer_type": "GPT2BPETokenizer"}


#: the environment variables ``validate_args`` reads (taken from the script's assignments)
ENVIRONMENT = ("CUDA_DEVICE_MAX_CONNECTIONS", "NCCL_PROTO", "CUDA_GRAPHS_USE_NODE_PRIORITY")


@contextlib.contextmanager
def _target_gpu(gpu: str, world_size: int, environment: dict[str, str]) -> Iterator[None]:
    """The process as Megatron-LM's rank 0 of ``world_size`` sees it, on ``gpu``: RANK,
    WORLD_SIZE and the script's ``environment`` (what it reads of :data:`ENVIRONMENT`), the
    GPU's compute capability and architecture (what ``validate_args`` asks); all restored
    afterwards."""
    from megatron.training import arguments

    if gpu not in GPU_CAPABILITY:
        raise ConfigError(f"--gpu {gpu}: not a known GPU; use one of {', '.join(GPU_CAPABILITY)}")
    env = {k: v for k, v in environment.items() if k in ENVIRONMENT}
    env |= {"RANK": "0", "WORLD_SIZE": str(world_size)}
    cleared = {k: "" for k in ENVIRONMENT if k not in env}  # this host's own values: not read
    capability = GPU_CAPABILITY[gpu]
    with (
        mock.patch.dict(os.environ, env | cleared),
        mock.patch("torch.cuda.get_device_capability", return_value=capability),
        mock.patch.object(arguments, "get_device_arch_version", return_value=capability[0]),
        # the target runs Megatron-LM in a container with Transformer Engine (NGC's): its
        # version checks (FP4, FP8 parameter gather) pass as they do there
        mock.patch.object(arguments, "is_te_min_version", return_value=True),
    ):
        for key in cleared:
            del os.environ[key]
        yield


#: {dataclass: its fields' docstrings}, as Megatron-LM's argument factory reads them
_DOCSTRINGS: dict[type, dict[str, str]] = {}


@contextlib.contextmanager
def _docstrings_once() -> Iterator[None]:
    """Megatron-LM's parser reads the help text of its dataclass-built flags from the classes'
    source (``inspect.getsource`` + ``ast``) each time it is built: about a second per parse,
    the same text each time. Read once per class here; the parser built is the same."""
    from megatron.training.argument_utils import ArgumentGroupFactory

    read = ArgumentGroupFactory._get_field_docstrings

    def once(self: Any, cls: type) -> dict[str, str]:
        if cls not in _DOCSTRINGS:
            _DOCSTRINGS[cls] = read(self, cls)
        return dict(_DOCSTRINGS[cls])

    with mock.patch.object(ArgumentGroupFactory, "_get_field_docstrings", once):
        yield


@functools.cache
def megatron_flag_dests() -> dict[str, tuple[str, bool]]:
    """Megatron-LM's own flags, from the parser ``parse_args`` builds: flag (without its
    dashes) -> (the namespace attribute it sets, whether it is a switch setting True). Flags
    that set another value (``store_false``, constants, appends) are not listed."""
    import argparse
    import logging
    import warnings

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings(), _docstrings_once():
        warnings.simplefilter("ignore")
        from megatron.training import arguments

        parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    out: dict[str, tuple[str, bool]] = {}
    for action in parser._actions:
        switch = type(action) is argparse._StoreTrueAction
        if not switch and type(action) is not argparse._StoreAction:
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                out[option[2:]] = (action.dest, switch)
    return out


def parse_megatron(
    words: Sequence[str],
    world_size: int,
    gpu: str = "H100",
    environment: dict[str, str] | None = None,
) -> Namespace:
    """Megatron-LM's namespace for ``words`` (flags as written, e.g. ``["--num-layers", "2"]``)
    after ``parse_args`` and ``validate_args`` at ``world_size`` ranks on ``gpu``, with the
    script's ``environment`` variables (``export CUDA_DEVICE_MAX_CONNECTIONS=1``).

    Raises ConfigError with Megatron-LM's message for an unknown flag, a bad value or a
    combination its validation refuses."""
    import logging
    import warnings

    # its import warns of every missing fused kernel, and torch of the missing CUDA runtime:
    # the converter's stderr is its own one line
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.training import arguments

    argv = ["pretrain_gpt.py", *words]
    stderr = io.StringIO()
    with (
        _docstrings_once(),
        _target_gpu(gpu, world_size, environment or {}),
        mock.patch.object(sys, "argv", argv),
        warnings.catch_warnings(),
        contextlib.redirect_stdout(io.StringIO()),  # its rank-0 prints
    ):
        warnings.simplefilter("ignore")
        try:
            with contextlib.redirect_stderr(stderr):
                args = arguments.parse_args()
        except SystemExit:  # argparse: usage + "error: ..." on stderr
            message = stderr.getvalue().strip().splitlines()[-1:] or ["refused"]
            raise ConfigError(
                f"Megatron-LM's parser refuses the flags: {message[0].split('error: ', 1)[-1]} "
                "(fix or remove them in the script)"
            ) from None
        try:
            arguments.validate_args(args, dict(PGT_ARGS_DEFAULTS))
        except (AssertionError, ValueError, TypeError, RuntimeError, NotImplementedError) as err:
            raise ConfigError(
                f"Megatron-LM's validate_args refuses the flags at world size {world_size} on "
                f"{gpu}: {_reason(err)} (fix the script's flags, or give the world size with "
                "--world-size)"
            ) from None
    return args


def _reason(err: BaseException) -> str:
    """Megatron-LM's message, or for a bare ``assert`` its failing line."""
    import traceback

    text = str(err).strip()
    if text:
        return text
    frames = traceback.extract_tb(err.__traceback__)
    return f"{(frames[-1].line or '').strip()} failed" if frames else type(err).__name__


def megatron_transformer_config(args: Namespace, post_init: bool = False) -> Any:
    """``core_transformer_config_from_args(args)``: Megatron-LM's own ``TransformerConfig`` (or
    ``MLATransformerConfig``). ``post_init=False`` keeps the values Megatron-LM passes, before
    megatron-core's ``__post_init__`` derives fields and checks the host (a CPU host has no
    fused RoPE, which Megatron-LM turns on by default)."""
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig
    from megatron.training.arguments import core_transformer_config_from_args

    if post_init:
        return core_transformer_config_from_args(args)
    with (
        mock.patch.object(TransformerConfig, "__post_init__", lambda self: None),
        mock.patch.object(MLATransformerConfig, "__post_init__", lambda self: None),
    ):
        return core_transformer_config_from_args(args)


def transformer_fields(args: Namespace, every: bool = False) -> dict[str, Any]:
    """Every field of Megatron-LM's ``TransformerConfig`` for ``args`` whose value differs from
    megatron-core's default (``every``: all fields), as YAML values (:func:`yaml_value`)."""
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    config = megatron_transformer_config(args)
    # a subclass's own defaults (MLATransformerConfig: multi_latent_attention=True) are not
    # megatron-core's TransformerConfig defaults: the recipe builds from the latter
    base = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    out: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        if not f.init:
            continue
        f = base.get(f.name, f)
        value = getattr(config, f.name)
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = dataclasses.MISSING
        if not every and _same(value, default):
            continue
        out[f.name] = yaml_value(f.name, value)
    return out


def _same(a: Any, b: Any) -> bool:
    try:
        return (bool(a == b) and type(a) is type(b)) or (a is None and b is None)
    except (RuntimeError, ValueError):  # tensors
        return False


def yaml_value(name: str, value: Any) -> Any:
    """``value`` of field ``name`` as YAML: a function by its megatron-core/torch name (see
    :func:`megatron_ext.megatron.model.activation_function`), a dtype by name, an enum by its
    value; ConfigError for anything else that YAML cannot hold."""
    import enum

    import torch

    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if isinstance(value, enum.Enum):  # by name: megatron-core's fields read enums by name
        return value.name
    if isinstance(value, list | tuple):
        return [yaml_value(name, v) for v in value]
    if callable(value) and getattr(value, "__name__", "") != "<lambda>":
        return value.__name__
    raise ConfigError(
        f"TransformerConfig.{name}={value!r} cannot be written into a recipe (not a plain value)"
    )
