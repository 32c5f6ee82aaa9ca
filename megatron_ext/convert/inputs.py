"""The conversion commands' inputs, read with the user's mistakes turned into one line.

A folder handed to ``convert`` or ``tools`` can be wrong in many ways that are not bugs here: a
``config.json`` that is not JSON or lacks a field, truncated ``.safetensors``, no weights at
all, a hf-to-mcore folder whose ``model.json`` was edited, a checkpoint of another model than
the one it is compared with. Each becomes a :class:`~megatron_ext.errors.ConfigError` naming
the file and what to do (exit 2). Anything else keeps its traceback.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from megatron_ext.errors import ConfigError

__all__ = ["read_json", "reading_model"]


def read_json(path: Path, fix: str) -> dict[str, Any]:
    """The JSON object in ``path``; missing, not JSON or not an object: ConfigError + ``fix``."""
    if not path.is_file():
        raise ConfigError(f"{path}: no such file: {fix}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON ({exc}): {fix}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} holds a JSON {type(data).__name__}, not an object: {fix}")
    return data


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@contextmanager
def reading_model(where: Path, what: str, fix: str) -> Iterator[None]:
    """Turn the errors of loading a model's files at ``where`` (the libraries': transformers'
    ``OSError`` for missing weights, safetensors' header errors, megatron-core's
    ``CheckpointingException`` for a checkpoint of another shape, torch's size mismatches,
    a missing config field) into one line: ``where: cannot load WHAT (first line): FIX``."""
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from safetensors import SafetensorError

    try:
        yield
    except ConfigError:
        raise
    except KeyError as exc:
        raise ConfigError(
            f"{where}: cannot load {what} (no field {exc.args[0]!r}): {fix}"
        ) from None
    except (
        OSError,
        ValueError,
        TypeError,  # a field of the wrong kind (or none) where a size belongs
        RuntimeError,
        SafetensorError,
        CheckpointingException,
    ) as exc:
        raise ConfigError(f"{where}: cannot load {what} ({_first_line(exc)}): {fix}") from None
