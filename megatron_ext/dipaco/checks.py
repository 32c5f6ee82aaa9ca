"""Checks a worker makes before it writes anything: the base checkpoint against the model, and
the run's identity in the queue (:func:`run_fingerprint`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

from megatron_ext.config.schema import Recipe
from megatron_ext.dipaco.recipe import DipacoConfig
from megatron_ext.errors import ConfigError

__all__ = ["check_base_checkpoint", "load_base_checkpoint", "run_fingerprint"]

# fields that do not change what a run computes: workers may differ in them
_OPERATIONAL = (
    "queue",
    "lease_seconds",
    "heartbeat_seconds",
    "max_attempts",
    "poll_seconds",
    "ranks_per_worker",  # a multi-rank worker computes the same bits (megatron_ext.dipaco.group)
)


def run_fingerprint(recipe: Recipe) -> str:
    """A hash of everything that decides the run's results (not logging, launching or queue
    timing), so workers started with the same recipe agree and another recipe is refused."""
    raw = dataclasses.asdict(recipe)
    for key in ("logging", "launch", "checkpoint"):
        raw.pop(key, None)
    for key in _OPERATIONAL:
        raw["sections"]["dipaco"].pop(key, None)
    return hashlib.sha256(json.dumps(raw, sort_keys=True).encode()).hexdigest()[:16]


def load_base_checkpoint(
    path: str | Path,
    reference: dict[str, torch.Tensor],
    model: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """The base model's parameters from ``path``, checked against ``reference`` (the model's
    own parameters): same names, shapes and dtypes. ``path`` is a GPT-trainer checkpoint folder
    (``run_dir/checkpoints/step_NNNNNN``, or ``run_dir/checkpoints`` for its latest; read with
    ``model``, a GPTModel of the recipe: :mod:`.gpt_base`), or a file: a ``model.pt`` of a
    DiPaCo base task, or any ``torch.save``'d GPTModel state dict, optionally under a
    ``model`` key."""
    path = Path(path)
    fix = "point dipaco.base_checkpoint at a base model of this model config, or set it to ''"
    if path.is_dir():
        if model is None:
            raise ValueError("a GPT checkpoint folder is read through the model: pass model")
        from megatron_ext.dipaco.gpt_base import load_gpt_checkpoint

        return load_gpt_checkpoint(path, model, reference)
    if not path.is_file():
        raise ConfigError(f"dipaco.base_checkpoint={str(path)!r} does not exist; {fix}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign file can raise almost anything
        raise ConfigError(
            f"dipaco.base_checkpoint={str(path)!r} is unreadable ({exc}); {fix}"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ConfigError(f"dipaco.base_checkpoint={str(path)!r} holds no state dict; {fix}")
    params = {k: v for k, v in state.items() if k in reference}
    missing = sorted(set(reference) - set(params))
    if missing:
        raise ConfigError(
            f"dipaco.base_checkpoint={str(path)!r} does not match the model: it lacks "
            f"{len(missing)} parameters (e.g. {missing[0]}); {fix}"
        )
    for name, ref in reference.items():
        got = params[name]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            raise ConfigError(
                f"dipaco.base_checkpoint={str(path)!r} does not match the model: {name} is "
                f"{tuple(got.shape)} {got.dtype}, the model's is {tuple(ref.shape)} {ref.dtype}; "
                f"{fix}"
            )
    return params


def check_base_checkpoint(
    recipe: Recipe, reference: dict[str, torch.Tensor], model: torch.nn.Module
) -> None:
    """Stop before anything is written when the recipe's base checkpoint cannot be used."""
    d = recipe.section(DipacoConfig)
    if d.base_checkpoint:
        load_base_checkpoint(d.base_checkpoint, reference, model)
