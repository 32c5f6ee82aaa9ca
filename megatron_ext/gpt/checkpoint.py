"""GPT checkpoints with megatron-core ``dist_checkpointing``, written atomically, and the policy
of when to write them (:class:`Checkpointer`).

Layout under ``<run_dir>/checkpoints``::

    step_000100/        a complete checkpoint (dist_checkpointing files + metadata)
    latest              text file naming the newest complete checkpoint

A save goes to ``.step_000100.tmp`` first; after every rank has finished writing, the ranks hash
their files into ``manifest.json`` (:mod:`megatron_ext.ckpt`), then rank 0 renames the folder to
``step_000100`` and replaces ``latest`` (``os.replace``, atomic on POSIX).  A crash at any point
leaves the previous checkpoint and ``latest`` untouched; a leftover ``.tmp`` folder is removed by
the next save.

Before loading, the manifest is verified (``checkpoint.verify``: sizes and checksums, or sizes).
``load: auto`` skips a damaged checkpoint for the previous intact one and says so; a damaged
checkpoint named in ``checkpoint.load`` stops the run (``ConfigError``, exit 2) with the same
report. A checkpoint without a manifest (written before manifests) loads with a note. A
checkpoint in an older layout (:mod:`megatron_ext.ckpt.legacy`, recognised from its metadata)
stops the run (``ConfigError``) naming the ``megatron-ext ckpt upgrade`` command that converts
it; loading reads today's layout only. Pruning keeps the newest ``keep_last`` intact
checkpoints, so it never deletes the only intact one.

Contents: the model and optimizer as ShardedTensors (resharding-ready), and as per-rank
``ShardedObject``s the RNG states and the loop state (step, consumed samples).  The LR schedule
is a pure function of the step, so the step restores it.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject

from megatron_ext.ckpt.collective import verify_collectively, write_manifest_collectively
from megatron_ext.ckpt.legacy import refuse_older_layouts
from megatron_ext.ckpt.select import (
    LATEST,
    Verdict,
    checkpoint_dirs,
    inspect,
    prune_plan,
    resume_order,
)
from megatron_ext.config.schema import CheckpointConfig
from megatron_ext.distributed.allgather_v import raw_bits
from megatron_ext.errors import ConfigError
from megatron_ext.megatron.optimizer_factories import chunk_named_parameters
from megatron_ext.megatron.save_queue import fork_results_queue


@dataclass(frozen=True)
class Checkpointer:
    """The ``checkpoint:`` section at work: where checkpoints go, when one is written, which
    one a run resumes from. The loop asks :meth:`should_save` after every step."""

    ckpt_dir: Path
    config: CheckpointConfig
    recipe_hash: str = ""  # written into each manifest (megatron_ext.ckpt.manifest.recipe_hash)

    def should_save(self, step: int, last_step: int) -> bool:
        """Every ``save_interval`` completed steps (0: never), and at ``last_step`` when
        ``save_at_end``; step 0 (before the first step) when ``save_initial``."""
        if step == 0:
            return self.config.save_initial
        every = self.config.save_interval
        return bool(every and step % every == 0) or (step == last_step and self.config.save_at_end)

    def save(self, step: int, model: Model, optimizer: Any, loop_state: dict[str, Any]) -> Path:
        """Checkpoint ``step`` (collective: every rank calls it); keeps the newest ``keep_last``
        intact ones."""
        return save_checkpoint(
            self.ckpt_dir,
            step,
            model,
            optimizer,
            loop_state,
            self.config.keep_last,
            self.recipe_hash,
        )

    def resume(self, model: Model, optimizer: Any) -> dict[str, Any] | None:
        """Load ``checkpoint.load`` ('auto': the newest intact checkpoint in ``ckpt_dir``, if
        any; 'none'; or a directory) into model and optimizer; returns its loop state, or None
        when there is nothing to resume. Raises ``ConfigError`` for a damaged named checkpoint,
        or when every checkpoint of ``ckpt_dir`` is damaged."""
        choice = self.config.load
        if choice == "none":
            return None
        if choice != "auto":
            path = Path(choice)
            if not path.is_dir():
                raise ConfigError(f"checkpoint.load={choice!r}: no such checkpoint directory")
            return self._load_verified(path, model, optimizer, fallback=False)
        damaged = []
        for path in resume_order(self.ckpt_dir):
            loop = self._load_verified(path, model, optimizer, fallback=True)
            if loop is not None:
                return loop
            damaged.append(path.name)
        if damaged:
            raise ConfigError(
                f"every checkpoint in {self.ckpt_dir} is damaged ({', '.join(damaged)}; "
                f"reports above): move them away to start over, or name one with checkpoint.load"
            )
        return None

    def _load_verified(
        self, path: Path, model: Model, optimizer: Any, fallback: bool
    ) -> dict[str, Any] | None:
        """Verify ``path`` and load it; a damaged one is reported and gives None
        (``fallback``) or a ``ConfigError``. A checkpoint without a manifest that fails to
        load counts as damaged; one in an older layout stops the run (``ConfigError``, with
        the upgrade command) whether or not there is an older checkpoint to fall back to."""
        verdict = verify_collectively(path, self.config.verify)
        if verdict.intact and not verdict.manifest:
            _say(f"note: {path} has no manifest (written before manifests): loading it unverified")
        if verdict.intact:
            try:
                return load_checkpoint(path, model, optimizer)
            except ConfigError:
                raise
            except Exception as exc:
                if verdict.manifest:
                    raise
                cause = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                verdict = Verdict(path, [], manifest=False)
                report = f"{path} could not be read ({cause})"
        else:
            report = verdict.report()
        if not fallback:
            raise ConfigError(
                f"checkpoint.load={path}: {report}; name another checkpoint, or use "
                f"checkpoint.load=auto to resume from the newest intact one"
            )
        _say(f"warning: {report}; trying the previous checkpoint")
        return None


def _say(message: str) -> None:
    """One ``megatron-ext:`` line on rank 0's stderr (what the launcher shows as it comes)."""
    if dist.get_rank() == 0:
        print(f"megatron-ext: {message}", file=sys.stderr, flush=True)


def _name(step: int) -> str:
    return f"step_{step:06d}"


def rng_state() -> dict[str, Any]:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def _per_rank(key: str, obj: Any) -> ShardedObject:
    rank, world = dist.get_rank(), dist.get_world_size()
    return ShardedObject(key, obj, (world,), (rank,), replica_id=0)


#: a model as the checkpoint functions take it: one module, or this rank's model chunks
#: (virtual pipeline stages), each possibly inside megatron-core's DDP
Model = torch.nn.Module | Sequence[torch.nn.Module]


def _unwrap(model: torch.nn.Module) -> Any:
    """The GPTModel inside megatron-core's DDP wrapper (its keys carry no ``module.`` prefix)."""
    return getattr(model, "module", model)


def _chunks(model: Model) -> list[Any]:
    """``model``'s chunks, unwrapped (one for a single module)."""
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    return [_unwrap(c) for c in chunks]


def _model_state(model: Model) -> dict[str, Any]:
    """The model's sharded state dict: the chunk's own, or ``{"chunk<v>": ...}`` over several
    (their ShardedTensor keys carry global layer numbers, so a checkpoint written with virtual
    pipeline stages loads without them and the other way round)."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        return chunks[0].sharded_state_dict()
    return {f"chunk{v}": c.sharded_state_dict() for v, c in enumerate(chunks)}


def _load_model_state(model: Model, state: dict[str, Any]) -> None:
    """Load what dist_checkpointing returned for :func:`_model_state` into the chunks."""
    chunks = _chunks(model)
    if len(chunks) == 1:
        chunks[0].load_state_dict(state)
        return
    for v, c in enumerate(chunks):
        c.load_state_dict(state[f"chunk{v}"])


def _named_parameters(model: Model) -> list[tuple[str, torch.nn.Parameter]]:
    """Every chunk's parameters, named as the optimizer names them (``chunk<v>.`` first when
    there are several)."""
    return chunk_named_parameters(_chunks(model))


def _sharded_state(
    model: Model,
    optimizer: Any,
    loop_state: dict[str, Any],
    is_loading: bool,
    with_rng: bool = True,
) -> dict[str, Any]:
    """The checkpoint's layout. ``loop`` (step, consumed samples) and ``world`` are the same on
    every rank: plain values, saved once. The RNG streams are per rank."""
    model_sd = _model_state(model)
    state = {
        "model": model_sd,
        "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading),
        "loop": loop_state,
        "world": dist.get_world_size(),
    }
    if with_rng:
        state["rng"] = _per_rank("rng", rng_state())
    return state


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    model: Model,
    optimizer: Any,
    loop_state: dict[str, Any],
    keep_last: int,
    recipe_hash: str = "",
) -> Path:
    """Write checkpoint ``step`` atomically on every rank, with its manifest; returns its final
    path."""
    optimizer.finish_param_sync()  # parameters still arriving from other ranks
    final = ckpt_dir / _name(step)
    tmp = ckpt_dir / f".{_name(step)}.tmp"
    if dist.get_rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(".step_*.tmp"):
            shutil.rmtree(stale)
        tmp.mkdir()
    dist.barrier()
    fork_results_queue()  # the writer's Manager forked, not a new interpreter (see its module)
    dist_checkpointing.save(
        _sharded_state(model, optimizer, loop_state, is_loading=False), str(tmp)
    )
    dist.barrier()
    write_manifest_collectively(tmp, step=step, recipe_hash=recipe_hash, layout=_layout())
    if dist.get_rank() == 0:
        if final.exists():  # re-saving a step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = ckpt_dir / f".{LATEST}.tmp"
        pointer_tmp.write_text(final.name + "\n", encoding="utf-8")
        os.replace(pointer_tmp, ckpt_dir / LATEST)
        _prune(ckpt_dir, keep_last, written=final)
    dist.barrier()
    return final


def _prune(ckpt_dir: Path, keep_last: int, written: Path) -> None:
    """Keep the newest ``keep_last`` intact checkpoints (sizes checked against each manifest;
    ``written``, just saved, is intact) and whatever damaged ones are newer."""
    dirs = checkpoint_dirs(ckpt_dir)
    for old in prune_plan(dirs, keep_last, lambda d: d == written or inspect(d, "sizes").intact):
        shutil.rmtree(old)


def _layout() -> dict[str, int]:
    """The parallel layout a checkpoint was written with (for its manifest)."""
    ps = parallel_state
    return {
        "world_size": dist.get_world_size(),
        "tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
        "context_parallel_size": ps.get_context_parallel_world_size(),
        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
        "data_parallel_size": ps.get_data_parallel_world_size(),
    }


def parameter_checksums(model: Model, expert: bool) -> torch.Tensor:
    """Per parameter, the int64 sum of its raw bits: equal values give equal sums on every rank.
    ``expert`` selects MoE expert parameters (``allreduce=False``) or the dense rest."""
    params = [p for _, p in _named_parameters(model)]
    sums = [
        raw_bits(p.detach().contiguous()).to(torch.int64).sum()
        for p in params
        if (not getattr(p, "allreduce", True)) == expert
    ]
    device = params[0].device
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)


def verify_replicas(model: Model) -> None:
    """Data-parallel replicas must hold bit-identical parameters (dense over the data-parallel
    group, experts over the expert-data-parallel group); a mismatch stops the run."""
    groups = (
        (False, parallel_state.get_data_parallel_group()),
        (True, parallel_state.get_expert_data_parallel_group()),
    )
    for expert, group in groups:
        local = parameter_checksums(model, expert)
        if local.numel() == 0:
            continue
        low, high = local.clone(), local.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        if not torch.equal(low, high):
            names = [
                n
                for n, p in _named_parameters(model)
                if (not getattr(p, "allreduce", True)) == expert
            ]
            bad = [names[i] for i in torch.nonzero(low != high).flatten().tolist()]
            raise RuntimeError(
                f"data-parallel replicas disagree on {len(bad)} parameter(s) after loading "
                f"(first: {bad[0]}): the checkpoint or the ranks' state is inconsistent; "
                "refusing to continue with diverged replicas"
            )


def load_checkpoint(path: Path, model: Model, optimizer: Any) -> dict[str, Any]:
    """Load model, optimizer and RNG state in place, check that data-parallel replicas agree;
    returns the saved loop state.

    Model and optimizer state are keyed by parameter, so a checkpoint written at another world
    size loads too (e.g. DP=2 -> DP=1 with the layer-wise optimizer); the per-rank RNG streams
    then cannot be matched to ranks and keep their fresh seeding (said on rank 0). A checkpoint
    in an older layout is a ``ConfigError`` naming its upgrade (nothing is loaded)."""
    refuse_older_layouts(path)
    saved_world = dist_checkpointing.load_common_state_dict(str(path)).get("world")
    same_world = saved_world == dist.get_world_size()
    if dist_checkpointing.load_common_state_dict(str(path))["loop"]["step"] == 0:
        return load_initial_weights(path, model, optimizer, same_world)
    state = dist_checkpointing.load(
        _sharded_state(model, optimizer, {}, is_loading=True, with_rng=same_world), str(path)
    )
    _load_model_state(model, state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if same_world:
        set_rng_state(state["rng"])
    elif dist.get_rank() == 0:
        print(
            f"megatron-ext: {path.name} was saved by {saved_world} ranks, this run has "
            f"{dist.get_world_size()}: model and optimizer state resharded; RNG streams keep "
            f"this run's seeding",
            flush=True,
        )
    verify_replicas(model)
    return state["loop"]


def load_model_weights(path: Path, model: Model) -> dict[str, Any]:
    """Only the model weights of the checkpoint at ``path`` (a GPT-trainer checkpoint, or the
    ``step_000000`` that ``convert hf-to-mcore`` writes), loaded into ``model`` in place; no
    optimizer state, RNG streams or loop state is read. The request is ``model``'s own
    ``sharded_state_dict()``, so megatron-core checks every key and shape against the model
    (a mismatch raises torch's ``CheckpointException``, a ``BaseException``). Returns the
    loaded model state dict."""
    state = dist_checkpointing.load({"model": _model_state(model)}, str(path))
    _load_model_state(model, state["model"])
    return state["model"]


def load_initial_weights(
    path: Path, model: Model, optimizer: Any, same_world: bool
) -> dict[str, Any]:
    """Start from a step-0 checkpoint (``checkpoint.save_initial``): it holds no optimizer
    state, so only the weights are loaded (converted to this run's dtype: a bf16 run starts
    from an fp32 run's step 0 and vice versa), the RNG streams when the world size matches,
    and the optimizer's fp32 masters are taken from the loaded weights. This is how a precision
    A/B gives every run the same initial weights."""
    request = {"model": _model_state(model)}
    if same_world:
        request["rng"] = _per_rank("rng", rng_state())
    state = dist_checkpointing.load(request, str(path))
    _load_model_state(model, state["model"])
    optimizer.reload_model_params()
    if same_world:
        set_rng_state(state["rng"])
    if dist.get_rank() == 0:
        print(f"megatron-ext: initial weights from {path} (step 0)", flush=True)
    verify_replicas(model)
    return {"step": 0, "consumed_samples": 0}
