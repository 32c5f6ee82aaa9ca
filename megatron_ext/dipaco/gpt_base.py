"""A base model from an ordinary GPT-trainer run: the model weights of one of its
``dist_checkpointing`` checkpoints (:mod:`megatron_ext.gpt.checkpoint` writes them as
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

__all__ = ["gpt_checkpoint_folder", "load_gpt_checkpoint"]

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


def _cause(exc: BaseException) -> str:
    """The last line of ``exc``'s text (torch.distributed.checkpoint wraps the loader's own
    exception, with its traceback, in one ``CheckpointException``), at most 300 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return (lines[-1] if lines else type(exc).__name__)[:300]
