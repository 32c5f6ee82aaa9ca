"""Run under torchrun (gloo): what the GPT trainer builds, saves and moves, measured, for
``tests/test_planner_measure.py`` to hold against ``megatron-ext plan``.

Every run is the trainer's own: :func:`megatron_ext.gpt.setup.setup` (process groups, model,
megatron-core DDP, the optimizer adapter over the layer-wise or the replicated optimizer) with
synthetic token data in place of the indexed dataset (:class:`Tokens`), then
:func:`megatron_ext.gpt.step.train_step`. Tasks, run in the order given:

- ``bytes``: every case of :data:`CASES` at this world size, each optimizer of
  :data:`OPTIMIZERS` in each precision of :data:`PRECISIONS`: after one step, this rank's
  parameter, ``main_grad`` buffer, fp32 master and optimizer-state bytes (per route, and the
  owned part per layer-wise domain) and the layer-wise wire counters (gradient reduce-scatter-v,
  parameter all-gather-v); ``OUT/bytes.rank{r}.json``.
- ``peak:OPTIMIZER`` (one rank, first task of its process): the resident set after imports and
  the process groups (the baseline), then setup and :data:`PEAK_STEPS` steps of the ~125M GPT
  :data:`BIG`, and the peak resident set since the baseline (``VmHWM``, reset at the baseline
  through ``/proc/self/clear_refs``); ``OUT/peak.json``. Two threads from here on.
- ``activations:NAME`` (one rank): for :data:`ACTIVATION_CASES` ``NAME``, the bytes autograd
  saves for one micro-batch (:func:`saved_bytes`) under each recompute granularity;
  ``OUT/activations.NAME.json``.

Usage: planner_measure.py OUT TASK [TASK ...]
"""

from __future__ import annotations

import gc
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: every run: no validation, no checkpoints, a small batch of short sequences
BASE = [
    "training.eval_iters=0",
    "checkpoint.save_interval=0",
    "training.seq_length=32",
    "training.micro_batch_size=2",
]
#: case -> (world size, recipe, overrides); the global batch is one micro-batch per DP rank
CASES: dict[str, tuple[int, str, list[str]]] = {
    "dp1": (1, "tiny_cpu_gpt", []),
    "dp2": (2, "tiny_cpu_gpt", []),
    "ep2": (2, "moe_tiny_cpu", []),  # DP 2, EP 2: expert data parallel 1
    "dp4": (4, "tiny_cpu_gpt", []),
    "tp2_dp2": (4, "tiny_cpu_gpt", ["parallel.tensor_model_parallel_size=2"]),
    "ep2_edp2": (4, "moe_tiny_cpu", []),  # DP 4, EP 2: expert data parallel 2
}
OPTIMIZERS = ("adamw", "muon", "mop", "kl_soap", "lion")
PRECISIONS = ("fp32", "bf16")

#: the ~125M GPT of the peak-memory run (GPT-2 small's sizes, Llama-style layers, local spec)
BIG = [
    "training.eval_iters=0",
    "checkpoint.save_interval=0",
    "model.num_layers=12",
    "model.hidden_size=768",
    "model.num_attention_heads=12",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=2048",
    "model.vocab_size=32000",
    "model.transformer_impl=local",
    "training.seq_length=256",
    "training.micro_batch_size=1",
    "training.global_batch_size=1",
    "training.precision=fp32",
]
PEAK_STEPS = 2  # the first step creates the optimizer state, the second builds on top of it
#: per optimizer, overrides of its peak run that change its time, not its memory: Muon's peak
#: runs one Newton–Schulz iteration instead of 5 (each iteration's products are freed before
#: the next, so the largest temporary is the same; the 5 iterations were ~3/4 of the run's time)
PEAK_FASTER = {"muon": ["optimizer.muon_num_ns_steps=1"]}
#: per optimizer, glibc's mmap threshold fixed for its peak run (bytes; ``mallopt``, which also
#: turns off the dynamic threshold): Muon's all-gather buffers are allocated while freed
#: activations are still held by glibc's heap, whose dynamic threshold grows with every large
#: free, so the resident set keeps memory no tensor holds (0.85 of the plan at step 3 without
#: this). Fixed, each large tensor is mapped on its own and unmapped when freed: the resident set
#: follows the live bytes. Set in the rank (not MALLOC_MMAP_THRESHOLD_), so the launch is warm.
PEAK_MMAP_THRESHOLD = {"muon": 65536}
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
#: name -> (recipe, overrides, whether backward is measured too): the runs whose saved
#: activations are measured, each under every recompute granularity of RECOMPUTE (the ~125M
#: GPT's forward only: its backward is most of a test's time, and the tiny ones check the
#: rebuilt segments)
ACTIVATION_CASES: dict[str, tuple[str, list[str], bool]] = {
    "tiny_fp32": ("tiny_cpu_gpt", ["training.eval_iters=0", "model.transformer_impl=local"], True),
    "tiny_bf16": (
        "tiny_cpu_gpt",
        ["training.eval_iters=0", "model.transformer_impl=local", "training.precision=bf16"],
        True,
    ),
    "moe_tiny": (
        "moe_tiny_cpu",
        ["training.eval_iters=0", "parallel.expert_model_parallel_size=1"],
        True,
    ),
    "big": ("tiny_cpu_gpt", BIG, False),
}
RECOMPUTE = ("none", "selective", "full")
#: the other forms of full recomputation, measured on ACTIVATION_CASES' first (4-layer) case:
#: form -> (its overrides, the layers (0-based) whose forward starts a recomputed segment)
FULL_FORMS: dict[str, tuple[list[str], tuple[int, ...]]] = {
    "full_uniform_2": (
        ["parallel.recompute_granularity=full", "parallel.recompute_num_layers=2"],
        (0, 2),
    ),
    "full_block_1": (
        ["parallel.recompute_granularity=full", "parallel.recompute_method=block"],
        (0,),
    ),
}


def case_overrides(case: str, optimizer: str, precision: str) -> list[str]:
    """The overrides of one ``bytes`` run."""
    world, _, extra = CASES[case]
    tp = 2 if "parallel.tensor_model_parallel_size=2" in extra else 1
    batch = 2 * world // tp  # one micro-batch of 2 per data-parallel rank
    return [
        *BASE,
        f"training.global_batch_size={batch}",
        f"optimizer.name={optimizer}",
        f"training.precision={precision}",
        *extra,
    ]


class Tokens:
    """Random token sequences in place of the indexed dataset, sample ``i`` seeded by ``i``:
    the dict of (seq,) arrays megatron-core's GPT dataset gives."""

    def __init__(self, seq: int, vocab: int) -> None:
        self.seq, self.vocab = seq, vocab

    def __getitem__(self, i: int) -> dict[str, Any]:
        import numpy as np

        tokens = np.random.default_rng(i).integers(0, self.vocab, self.seq + 1)
        return {
            "tokens": tokens[:-1],
            "labels": tokens[1:],
            "loss_mask": np.ones(self.seq, dtype=np.float32),
            "position_ids": np.arange(self.seq),
        }


def _world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def trainer_run(source: str, overrides: list[str]) -> Any:
    """The trainer's :class:`~megatron_ext.gpt.setup.GPTRun` of ``source`` at this world size
    (synthetic tokens). The model-parallel groups stay up (:func:`model_parallel_groups`):
    runs of one layout share them."""
    from unittest import mock

    import megatron_ext.gpt.setup as gpt_setup
    from megatron_ext.config.load import load_recipe

    recipe = load_recipe(source, overrides, world_size=_world())

    def data(recipe: Any, tokenizer: Any, schedule: Any) -> tuple[Tokens, None]:
        return Tokens(recipe.training.seq_length, tokenizer.vocab_size), None

    with (
        mock.patch.object(gpt_setup, "ensure_dataset", lambda *args: None),
        mock.patch.object(gpt_setup, "build_data", data),
    ):
        return gpt_setup.setup(recipe)


@contextmanager
def model_parallel_groups() -> Iterator[None]:
    """Runs of one parallel layout inside; megatron-core's groups are left on exit (the first
    ``setup`` inside joins them: creating them is most of a gloo run's time at 4 ranks)."""
    from megatron.core import parallel_state

    try:
        yield
    finally:
        parallel_state.destroy_model_parallel()


# --------------------------------------------------------------------------- bytes


def _inner_parts(run: Any) -> list[Any]:
    """The wrapped optimizer's parts: layer-wise domains and element-sharded AdamW parts."""
    inner = run.optimizer.optimizer
    return list(getattr(inner, "parts", [inner]))


def _layerwise(part: Any) -> bool:
    """A layer-wise part (whole matrices owned), not an element-sharded AdamW one."""
    return hasattr(part, "plan")


def _routed_optimizers(part: Any) -> Iterator[tuple[str, bool, Any]]:
    """(route, whether its parameters are owned rather than replicated, torch optimizer); the
    element-sharded AdamW's ranges count as neither owned nor replicated (owned: the
    layer-wise plan's whole matrices)."""
    if not _layerwise(part):  # ShardedAdamW: AdamW over this rank's ranges
        yield "adamw", False, part.optimizer
        return
    for route, opt in part.replicated_optimizers.items():
        yield route, False, opt
    for bucket in part.buckets:
        for route, opt in bucket.optimizers.items():
            yield route, True, opt


def _state_bytes(opt: Any, seen: set[int]) -> int:
    """Bytes of the optimizer's state tensors (storages counted once; 0-d step counters, which
    the specs' ``state_bytes`` leave out, skipped)."""
    import torch

    total = 0
    for state in opt.state.values():
        for value in state.values():
            if not torch.is_tensor(value) or value.dim() == 0:
                continue
            storage = value.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def _master_bytes(part: Any, owned_only: bool) -> int:
    if not _layerwise(part):  # the fp32 ranges of bf16 parameters (none owned whole)
        return 0 if owned_only else part.master_bytes()
    params = dict(part.named_params) if hasattr(part, "named_params") else part._params
    total = 0
    for name, master in part.masters.items():
        if master is params[name]:
            continue  # an fp32 parameter is its own master
        if owned_only and part.plan.owner[name] != part.rank:
            continue
        total += master.numel() * master.element_size()
    return total


def measure_bytes(run: Any) -> dict[str, Any]:
    """This rank's bytes after a step (see the module docstring)."""
    from megatron.core import parallel_state

    from megatron_ext.megatron.optimizer_factories import is_expert_param

    model = run.chunks[0]
    state: dict[str, int] = {}
    owned_state = {"dense": 0, "expert": 0}
    owned_masters = {"dense": 0, "expert": 0}
    seen: set[int] = set()
    parts = _inner_parts(run)
    for part in parts:
        domain = "expert" if is_expert_param(part.named_params[0][1]) else "dense"
        for route, owned, opt in _routed_optimizers(part):
            nbytes = _state_bytes(opt, seen)
            state[route] = state.get(route, 0) + nbytes
            if owned:
                owned_state[domain] += nbytes
        owned_masters[domain] += _master_bytes(part, owned_only=True)
    gathers = [p.gather.stats for p in parts if p.gather is not None]
    wire = {
        "grad_reduce_scatter": [
            sum(p.grad_wire.sent for p in parts),
            sum(p.grad_wire.received for p in parts),
        ],
        "param_all_gather": [sum(g.sent for g in gathers), sum(g.received for g in gathers)],
    }
    buffers = [*model.buffers, *model.expert_parallel_buffers]
    return {
        "dense_rank": parallel_state.get_data_parallel_rank(),
        "expert_rank": parallel_state.get_expert_data_parallel_rank(),
        "parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
        "gradients": sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers),
        "masters": sum(_master_bytes(part, owned_only=False) for part in _inner_parts(run)),
        "optimizer_state": state,
        "owned_state": owned_state,
        "owned_masters": owned_masters,
        "wire": wire,
    }


def run_bytes(out: Path) -> None:
    import torch.distributed as dist

    from megatron_ext.gpt.step import train_step

    world = _world()
    got: dict[str, Any] = {}
    for case, (size, source, _) in CASES.items():
        if size != world:
            continue
        with model_parallel_groups():
            for optimizer in OPTIMIZERS:
                for precision in PRECISIONS:
                    run = trainer_run(source, case_overrides(case, optimizer, precision))
                    assert train_step(run, 0).success, (case, optimizer, precision)
                    run.optimizer.finish_param_sync()
                    got[f"{case}/{optimizer}/{precision}"] = measure_bytes(run)
                    del run
    Path(out, f"bytes.rank{dist.get_rank()}.json").write_text(json.dumps(got))


# --------------------------------------------------------------------------- activations


def saved_bytes(
    run: Any, recompute: str, backward: bool, starts: tuple[int, ...] | None = None
) -> dict[str, int | None]:
    """Bytes autograd saves for one training micro-batch of ``run`` through the trainer's
    ``forward_step``: ``kept``, the storages saved in forward (each counted once, by its
    ``nbytes``; the parameters' own storages, which linears save for backward, are not
    activations); with ``backward``, ``rebuild``: the most one recomputed segment saves in
    backward beyond them (a layer under ``full``, a core attention under ``selective``; there
    are ``segments`` of them, 0 without recomputation; ``starts``: the layers whose forward
    starts a segment, where that is not every layer). Every saved tensor is held until the
    end, so that no storage is freed and its address reused by another while counting."""
    import torch
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron_ext.gpt.step import forward_step, microbatches
    from megatron_ext.megatron.attention import SdpaAttention

    weights = {p.untyped_storage().data_ptr() for p in run.chunks[0].parameters()}
    kept: dict[int, int] = {}
    segments: list[dict[int, int]] = []
    held: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        held.append(tensor)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in weights and ptr not in kept:
            (segments[-1] if segments else kept).setdefault(ptr, storage.nbytes())
        return tensor

    batch = next(microbatches(run, 0))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        losses, loss_func = forward_step(iter([batch]), run.chunks[0])
        loss, _ = loss_func(losses)
    forward = sum(kept.values())
    if not backward:
        return {"kept": forward, "rebuild": None, "segments": None}
    boundary = {"full": TransformerLayer, "selective": SdpaAttention}.get(recompute)
    handles = [
        module.register_forward_pre_hook(lambda *_: segments.append({}))
        for module in run.chunks[0].modules()
        if boundary is not None
        and isinstance(module, boundary)
        and (starts is None or module.layer_number - 1 in starts)
    ]
    segments.append({})  # what backward saves before the first recomputed segment (nothing)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        loss.backward()
    for handle in handles:
        handle.remove()
    held.clear()
    run.chunks[0].zero_grad_buffer()
    return {
        "kept": forward,
        "rebuild": max(sum(s.values()) for s in segments),
        "segments": len(segments) - 1,
    }


def run_activations(out: Path, name: str) -> None:
    source, overrides, backward = ACTIVATION_CASES[name]
    got = {}
    with model_parallel_groups():
        for recompute in RECOMPUTE:
            run = trainer_run(source, [*overrides, f"parallel.recompute_granularity={recompute}"])
            got[recompute] = saved_bytes(run, recompute, backward)
            del run
            gc.collect()
        if name == next(iter(ACTIVATION_CASES)):
            for form, (form_overrides, starts) in FULL_FORMS.items():
                run = trainer_run(source, [*overrides, *form_overrides])
                got[form] = saved_bytes(run, "full", backward, starts)
                del run
                gc.collect()
    Path(out, f"activations.{name}.json").write_text(json.dumps(got))


# --------------------------------------------------------------------------- peak


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def run_peak(out: Path, optimizer: str) -> None:
    """Peak resident bytes of setup + :data:`PEAK_STEPS` steps above the baseline."""
    import torch

    import megatron_ext.gpt.setup  # noqa: F401  (what the run imports: before the baseline)
    from megatron_ext.config.load import load_recipe
    from megatron_ext.gpt.step import train_step
    from megatron_ext.megatron.parallel import init_distributed

    torch.set_num_threads(2)  # this process's later tasks too
    if optimizer in PEAK_MMAP_THRESHOLD:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        assert libc.mallopt(_M_MMAP_THRESHOLD, PEAK_MMAP_THRESHOLD[optimizer]) == 1
    overrides = [*BIG, f"optimizer.name={optimizer}", *PEAK_FASTER.get(optimizer, [])]
    recipe = load_recipe("tiny_cpu_gpt", overrides, world_size=1)
    init_distributed(recipe.parallel, recipe.seed, recipe.launch.master_port)
    gc.collect()
    baseline = _status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux >= 4.0)
    reset = _status_kib("VmHWM")
    with model_parallel_groups():
        run = trainer_run("tiny_cpu_gpt", overrides)
        for step in range(PEAK_STEPS):
            assert train_step(run, step).success
        run.optimizer.finish_param_sync()
        peak = _status_kib("VmHWM")
        params = sum(p.numel() for p in run.chunks[0].parameters())
        del run
        gc.collect()
    result = {
        "baseline_bytes": baseline * 1024,
        "hwm_after_reset_bytes": reset * 1024,
        "peak_bytes": peak * 1024,
        "params": params,
        "optimizer": optimizer,
    }
    Path(out, "peak.json").write_text(json.dumps(result))


def main(out: str, tasks: list[str]) -> None:
    import torch
    import torch.distributed as dist

    from tests.dist.ending import leave

    torch.set_num_threads(1)
    Path(out).mkdir(parents=True, exist_ok=True)
    for task in tasks:
        what, _, arg = task.partition(":")
        if what == "peak":
            run_peak(Path(out), arg)
        elif what == "activations":
            run_activations(Path(out), arg)
        elif what == "bytes":
            run_bytes(Path(out))
        else:
            raise SystemExit(f"unknown task {task!r}")
    assert dist.is_initialized()
    leave()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
