"""The base model from ``dipaco.base_checkpoint`` (:func:`load_base_checkpoint`): a file of
parameters, or an ordinary GPT-trainer run's model weights from one of its ``dist_checkpointing``
checkpoints (:mod:`megatron_ext.gpt.checkpoint` writes them as
``<run_dir>/checkpoints/step_NNNNNN``, and names the newest in ``checkpoints/latest``).

Only the model is read (:func:`megatron_ext.gpt.checkpoint.load_model_weights`: the optimizer
state, RNG streams and loop state of the GPT run are not; the paths' inner optimizers start
fresh). The request is the path model's own ``sharded_state_dict()``, so megatron-core checks
every key and shape against the model, and any disagreement (another width, depth, vocabulary
or layer spec) is one ``ConfigError``. Needs ``torch.distributed`` initialised (a worker has
joined its gloo group).
"""

from __future__ import annotations

from pathlib import Path

import torch

from megatron_ext.ckpt.select import inspect
from megatron_ext.errors import ConfigError

__all__ = ["gpt_checkpoint_folder", "load_base_checkpoint", "load_gpt_checkpoint"]

_FIX = "point dipaco.base_checkpoint at a base model of this model config, or set it to ''"


def gpt_checkpoint_folder(path: Path) -> Path:
    """The checkpoint folder ``path`` names: itself (``step_NNNNNN``), or the one its
    ``latest`` file names when ``path`` is a ``checkpoints`` folder; it must be intact (its
    files match its manifest: :func:`megatron_ext.ckpt.select.inspect`)."""
    latest = path / "latest"
    if latest.is_file():
        path = path / latest.read_text(encoding="utf-8").strip()
    if not (path / "metadata.json").is_file():
        raise ConfigError(
            f"dipaco.base_checkpoint={str(path)!r} is a folder but not a GPT checkpoint "
            f"(no metadata.json; give run_dir/checkpoints/step_NNNNNN of a GPT run); {_FIX}"
        )
    verdict = inspect(path)  # sizes and checksums against its manifest, when it has one
    if not verdict.intact:
        raise ConfigError(f"dipaco.base_checkpoint: {verdict.report()}; {_FIX}")
    return path


def load_gpt_checkpoint(
    path: Path, model: torch.nn.Module, reference: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The parameters named in ``reference`` (the model's own, by GPTModel name) from the GPT
    checkpoint at ``path`` (see :func:`gpt_checkpoint_folder`), as float tensors of the
    reference's shapes and dtypes. ``model`` (a GPTModel of the recipe) gives the request; its
    parameters are overwritten by the load."""
    from megatron_ext.gpt.checkpoint import load_model_weights

    folder = gpt_checkpoint_folder(path)
    try:
        loaded = load_model_weights(folder, model)
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # a mismatch: torch's CheckpointException is a BaseException
        raise ConfigError(
            f"dipaco.base_checkpoint={str(folder)!r} does not match the model "
            f"({_cause(exc)}); {_FIX}"
        ) from None
    params = {}
    for name, ref in reference.items():
        got = loaded.get(name)
        if not torch.is_tensor(got) or got.shape != ref.shape or got.dtype != ref.dtype:
            what = "lacks it" if not torch.is_tensor(got) else f"has {tuple(got.shape)} {got.dtype}"
            raise ConfigError(
                f"dipaco.base_checkpoint={str(folder)!r} does not match the model: {name} "
                f"({tuple(ref.shape)} {ref.dtype}): the checkpoint {what}; {_FIX}"
            )
        params[name] = got.detach().clone()
    return params


def load_base_checkpoint(
    path: str | Path,
    reference: dict[str, torch.Tensor],
    model: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """The base model's parameters from ``path``, checked against ``reference`` (the model's
    own parameters): same names, shapes and dtypes. ``path`` is a GPT-trainer checkpoint folder
    (``run_dir/checkpoints/step_NNNNNN``, or ``run_dir/checkpoints`` for its latest; read with
    ``model``, a GPTModel of the recipe: :func:`load_gpt_checkpoint`), or a file: a ``model.pt``
    of a DiPaCo base task, or any ``torch.save``'d GPTModel state dict, optionally under a
    ``model`` key."""
    path = Path(path)
    if path.is_dir():
        if model is None:
            raise ValueError("a GPT checkpoint folder is read through the model: pass model")
        return load_gpt_checkpoint(path, model, reference)
    if not path.is_file():
        raise ConfigError(f"dipaco.base_checkpoint={str(path)!r} does not exist; {_FIX}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign file can raise almost anything
        raise ConfigError(
            f"dipaco.base_checkpoint={str(path)!r} is unreadable ({exc}); {_FIX}"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ConfigError(f"dipaco.base_checkpoint={str(path)!r} holds no state dict; {_FIX}")
    params = {k: v for k, v in state.items() if k in reference}
    missing = sorted(set(reference) - set(params))
    if missing:
        raise ConfigError(
            f"dipaco.base_checkpoint={str(path)!r} does not match the model: it lacks "
            f"{len(missing)} parameters (e.g. {missing[0]}); {_FIX}"
        )
    for name, ref in reference.items():
        got = params[name]
        if got.shape != ref.shape or got.dtype != ref.dtype:
            raise ConfigError(
                f"dipaco.base_checkpoint={str(path)!r} does not match the model: {name} is "
                f"{tuple(got.shape)} {got.dtype}, the model's is {tuple(ref.shape)} {ref.dtype}; "
                f"{_FIX}"
            )
    return params


def _cause(exc: BaseException) -> str:
    """The last line of ``exc``'s text (torch.distributed.checkpoint wraps the loader's own
    exception, with its traceback, in one ``CheckpointException``), at most 300 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]
