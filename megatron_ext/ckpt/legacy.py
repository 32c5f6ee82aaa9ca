"""Checkpoint layouts older than today's, in one place: how to recognise each from a checkpoint's
metadata (key names and dtypes, no tensor read) and how to turn its contents into today's.

Today's form: the model's weights under megatron-core's keys, the optimizer's state keyed by
parameter, ``optimizer.layerwise.<state key>.<model shard tag>`` (tensors whole, scalars as
objects; :meth:`~megatron_ext.megatron.optimizer.MegatronExtOptimizer.named_sharded_state`),
and in a bf16 model an fp32 master (``fp32_param``) for every parameter. Three older layouts:

* **model-laid-out AdamW** (``optimizer.name=adamw`` up to commit 02f9e04): torch AdamW's state
  as megatron-core's ``optim_state_to_sharding_state`` lays it out, ``optimizer.state.<exp_avg |
  exp_avg_sq | fp32_param>.<model key>`` shaped like the model key (layer axes included), and
  one step for every parameter in the common state (``optimizer.optimizer.state.common_step``);
* **KL-SOAP's explicit factors** (before commit 7b2e38b): the factors themselves, ``factor_l`` /
  ``factor_r`` (L, R), instead of their products with the bases, ``factor_basis_l = L·Q_L`` /
  ``factor_basis_r = R·Q_R``;
* **fp32-era norms** (bf16 runs before bf16 models ran in megatron-core's ``Float16Module``,
  commit c2d5f1b): the norms' weights saved in fp32 and no fp32 master for them (an fp32
  parameter was its own master).

:func:`older_layouts` recognises them: the GPT loader refuses such a checkpoint with the fix
(:func:`refuse_older_layouts`), and ``megatron-ext ckpt upgrade`` (:mod:`.upgrade`) applies each
found layout's ``upgrade``, in :data:`LAYOUTS` order, to the checkpoint's whole contents
(:class:`~.contents.Contents`). The values are those the loaders of these layouts produced
(same tensors bit for bit; KL-SOAP's products as its first step after such a load computed
them). Tested on checkpoints written by the old code (``tests/fixtures``,
``tests/test_checkpoint_legacy.py``, ``tests/test_precision_ab.py``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from megatron_ext.ckpt.contents import Chunk, Contents, object_key
from megatron_ext.distributed.layerwise import MASTER_KEY
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.optimizer import STATE_PREFIX, shard_tag_of

__all__ = [
    "LAYOUTS",
    "OlderLayout",
    "TensorInfo",
    "UpgradeError",
    "factor_product",
    "older_layouts",
    "refuse_older_layouts",
    "saved_tensors",
]

NAMED = f"{STATE_PREFIX}."  # today's optimizer state keys
MODEL_LAID_OUT = "optimizer.state."  # model-laid-out AdamW's
#: KL-SOAP's old state key -> (today's key, the basis it is multiplied by)
FACTORS = {"factor_l": ("factor_basis_l", "basis_l"), "factor_r": ("factor_basis_r", "basis_r")}


class UpgradeError(ConfigError):
    """A checkpoint an older layout's upgrade cannot convert (what it holds is not what that
    layout's writer wrote)."""


class TensorInfo(NamedTuple):
    """What a checkpoint's metadata says of one tensor: its global shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class OlderLayout:
    """One older layout: ``what`` it is (for messages), how to ``detect`` it from the saved
    tensors' metadata, and how to ``upgrade`` a checkpoint's contents to today's, in place."""

    name: str
    what: str
    detect: Callable[[Mapping[str, TensorInfo]], bool]
    upgrade: Callable[[Contents], None]


def saved_tensors(folder: Path) -> dict[str, TensorInfo]:
    """The tensors of the checkpoint ``folder`` by key, from its metadata (no tensor is read)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.core import CheckpointingException

    try:
        metadata = dist_checkpointing.load_tensors_metadata(str(folder))
    except (CheckpointingException, TypeError, ValueError, KeyError) as exc:
        # megatron-core's own error on a metadata.json it cannot use (a TypeError when fields
        # are missing): the folder is not a checkpoint it wrote, or it was damaged
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ConfigError(
            f"{folder}: not a readable dist_checkpointing checkpoint ({first}): give a "
            "checkpoint folder as a run wrote it"
        ) from None
    return {k: TensorInfo(tuple(sh.global_shape), sh.dtype) for k, sh in metadata.items()}


def older_layouts(saved: Mapping[str, TensorInfo]) -> list[OlderLayout]:
    """The older layouts a checkpoint holding the tensors ``saved`` is in ([]: today's)."""
    return [layout for layout in LAYOUTS if layout.detect(saved)]


def refuse_older_layouts(folder: Path) -> None:
    """Raise ``ConfigError`` (one line: which layout, and the upgrade command) when the
    checkpoint ``folder`` is in an older layout; the loaders read today's only."""
    found = older_layouts(saved_tensors(folder))
    if found:
        dst = folder.with_name(f"{folder.name}.upgraded")
        raise ConfigError(
            f"{folder} is a checkpoint in an older layout ({'; '.join(f.what for f in found)}), "
            f"which this version does not load: upgrade it once with "
            f"`megatron-ext ckpt upgrade {folder} {dst}`, then resume with checkpoint.load={dst}"
        )


def _optimizer_entries(keys: Iterator[str] | Mapping[str, object]) -> Iterator[tuple[str, str]]:
    """``(state key, model key)`` of each optimizer tensor key, today's form or model-laid-out."""
    for key in keys:
        if key.startswith(NAMED):
            state_key, tag = key[len(NAMED) :].split(".", 1)
            yield state_key, tag.rpartition("@")[0]
        elif key.startswith(MODEL_LAID_OUT):
            state_key, model_key = key[len(MODEL_LAID_OUT) :].split(".", 1)
            yield state_key, model_key


def _is_model_key(key: str) -> bool:
    return not key.startswith("optimizer.")


def _layer_axes(shape: tuple[int, ...], chunks: list[Chunk] | None) -> int:
    """How many leading axes of a global tensor are megatron-core's stacking axes (layers,
    experts) rather than the parameter's: those along which every written chunk has size 1
    (each rank writes one layer's shard; without chunks, the tensor is one). A parameter keeps
    at least one axis of its own."""
    sizes = [s for _, s in chunks] if chunks else [shape]
    axes = 0
    while axes < len(shape) - 1 and all(s[axes] == 1 for s in sizes):
        axes += 1
    return axes


# -- model-laid-out AdamW --------------------------------------------------------------------
def _model_laid_out_adamw(saved: Mapping[str, TensorInfo]) -> bool:
    return any(k.startswith(MODEL_LAID_OUT) for k in saved)


def _upgrade_model_laid_out_adamw(contents: Contents) -> None:
    """Each ``optimizer.state.<state key>.<model key>`` split into one tensor per parameter
    (per layer / expert of a stacked key), keyed by its shard tag (the layer offsets, then
    zeros: the layout of tensor-parallel size 1); every parameter's ``step`` is the common one
    (a 0-dim tensor, as torch's AdamW keeps it)."""
    try:
        step = contents.common["optimizer"]["optimizer"]["state"]["common_step"]
    except (KeyError, TypeError):
        raise UpgradeError(
            "AdamW state laid out like the model, but no common step "
            "(optimizer.optimizer.state.common_step) in the common state"
        ) from None
    tags = set()
    for key in [k for k in contents.tensors if k.startswith(MODEL_LAID_OUT)]:
        state_key, model_key = key[len(MODEL_LAID_OUT) :].split(".", 1)
        full = contents.tensors.pop(key)
        axes = _layer_axes(tuple(full.shape), contents.chunks.pop(key, None))
        for index in itertools.product(*map(range, full.shape[:axes])):
            tag = shard_tag_of(model_key, index + (0,) * (full.dim() - axes))
            contents.tensors[f"{NAMED}{state_key}.{tag}"] = full[index].clone()
            tags.add(tag)
    for tag in sorted(tags):
        contents.objects[object_key(f"{NAMED}step.{tag}")] = step.clone()
    del contents.common["optimizer"]  # its param groups: the recipe's, read from the recipe


# -- KL-SOAP's explicit factors --------------------------------------------------------------
def _explicit_kl_soap_factors(saved: Mapping[str, TensorInfo]) -> bool:
    return any(k.startswith(f"{NAMED}{old}.") for old in FACTORS for k in saved)


def factor_product(factor: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``factor · basis``: KL-SOAP's state of today (``L·Q_L``) from an old one's factor ``L``
    and basis ``Q_L``, ``(…, k, k)`` each (batched over expert stacks), in the factor's dtype;
    the product KL-SOAP's first step after loading an old state computed."""
    return torch.matmul(factor, basis.to(factor.dtype))


def _upgrade_explicit_kl_soap_factors(contents: Contents) -> None:
    tensors = contents.tensors
    for key in [k for k in tensors if k.startswith(tuple(f"{NAMED}{o}." for o in FACTORS))]:
        old, tag = key[len(NAMED) :].split(".", 1)
        new, basis = FACTORS[old]
        new_key, basis_key = f"{NAMED}{new}.{tag}", f"{NAMED}{basis}.{tag}"
        if new_key in tensors:
            raise UpgradeError(f"{tag}: holds both {old} and {new} (no writer wrote both)")
        if basis_key not in tensors:
            raise UpgradeError(f"{tag}: holds {old} but not the basis {basis} it multiplies")
        tensors[new_key] = factor_product(tensors.pop(key), tensors[basis_key])


# -- fp32-era norms --------------------------------------------------------------------------
def _norms_without_masters(saved: Mapping[str, TensorInfo]) -> set[str]:
    """Model keys of trained parameters saved in fp32 without a master, in a checkpoint that
    holds masters (a low-precision run's): the norms of the fp32 era."""
    entries = list(_optimizer_entries(iter(saved)))
    trained = {model_key for _, model_key in entries}
    mastered = {model_key for state_key, model_key in entries if state_key == MASTER_KEY}
    if not mastered:
        return set()
    return {k for k in trained - mastered if k in saved and saved[k].dtype == torch.float32}


def _fp32_era_norms(saved: Mapping[str, TensorInfo]) -> bool:
    return bool(_norms_without_masters(saved))


def _upgrade_fp32_era_norms(contents: Contents) -> None:
    """Each such weight becomes its parameter's master, bit for bit (one per shard tag), and is
    saved in the run's low precision (its rounding, the value the old loader gave the bf16
    parameter)."""
    tensors = contents.tensors
    saved = {k: TensorInfo(tuple(t.shape), t.dtype) for k, t in tensors.items()}
    norms = _norms_without_masters(saved)
    mastered = {m for k, m in _optimizer_entries(iter(saved)) if k == MASTER_KEY}
    low = {saved[m].dtype for m in mastered if m in saved}
    if len(low) != 1:
        raise UpgradeError(f"weights with masters in {len(low)} dtypes ({sorted(map(str, low))})")
    (low_dtype,) = low
    tags: dict[str, set[str]] = {}
    for key in tensors:
        if key.startswith(NAMED):
            tag = key[len(NAMED) :].split(".", 1)[1]
            tags.setdefault(tag.rpartition("@")[0], set()).add(tag)
    for model_key in sorted(norms):
        weight = tensors[model_key]
        axes = _layer_axes(tuple(weight.shape), contents.chunks.get(model_key))
        for tag in sorted(tags[model_key]):
            offsets = tuple(int(o) for o in tag.rpartition("@")[2].split("_"))
            if len(offsets) != weight.dim() or any(offsets[axes:]):
                raise UpgradeError(f"{tag}: not a whole parameter of {model_key} {weight.shape}")
            master = weight[offsets[:axes]].clone()
            moment = tensors.get(f"{NAMED}exp_avg.{tag}")
            if moment is not None and moment.shape != master.shape:
                raise UpgradeError(f"{tag}: exp_avg {moment.shape} vs. weight {master.shape}")
            tensors[f"{NAMED}{MASTER_KEY}.{tag}"] = master
        tensors[model_key] = weight.to(low_dtype)


#: The older layouts, in the order an upgrade applies them (a bf16 AdamW checkpoint of the fp32
#: era is both model-laid-out and without norm masters: its state is name-keyed first).
LAYOUTS = (
    OlderLayout(
        "model-laid-out AdamW",
        "AdamW state laid out like the model, optimizer.state.*, written up to 02f9e04",
        _model_laid_out_adamw,
        _upgrade_model_laid_out_adamw,
    ),
    OlderLayout(
        "explicit KL-SOAP factors",
        "KL-SOAP's explicit factors factor_l/factor_r, written before 7b2e38b",
        _explicit_kl_soap_factors,
        _upgrade_explicit_kl_soap_factors,
    ),
    OlderLayout(
        "fp32-era norms",
        "fp32 norm weights without fp32 masters, bf16 runs before c2d5f1b",
        _fp32_era_norms,
        _upgrade_fp32_era_norms,
    ),
)
