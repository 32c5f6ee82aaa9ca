"""megatron-ext's optimizer adapter: megatron-core's ``MegatronOptimizer`` interface around any
``torch.optim.Optimizer``, identical on CPU and GPU.

megatron-core's own wrappers (``FP32Optimizer``, ``Float16OptimizerWithFloat16Params``) allocate
``device='cuda'`` tensors and check CUDA tensor types, so they cannot run on a CPU host.  This
adapter keeps the same contract (``step() -> (success, grad_norm, num_zeros)``, ``zero_grad``,
``get_grad_norm``, ``state_dict``, ``sharded_state_dict`` for dist_checkpointing) and:

* reads each parameter's gradient from DDP's ``param.main_grad`` (fp32 grad buffer);
* updates fp32 masters of bf16 parameters (fp32 parameters are their own master), which the
  wrapped optimizer keeps: AdamW on every rank for all of them
  (:mod:`megatron_ext.megatron.replicated`), the layer-wise distributed optimizer only for the
  parameters this rank updates (:mod:`megatron_ext.distributed.layerwise`);
* computes the global gradient norm and zero count once, counting tensor-parallel duplicates and
  shared (tied) parameters once, reduced over the model-parallel group (dense) and the
  expert-model-parallel group (MoE experts);
* skips the step (``success=False``) when the gradient norm is not finite.

The wrapped optimizer is built by a factory over named parameters (:mod:`.optimizer_factories`),
so the matrix optimizers and the layer-wise distributed optimizer slot in without touching the
training loop.

One checkpoint form for every optimizer: state keyed by parameter,
``optimizer.layerwise.<state key>.<model shard tag>`` (whole tensors as ShardedTensors, scalars
as ShardedObjects), written by one replica, loadable at any data-parallel size. Checkpoints in
older layouts are upgraded once, offline (``megatron-ext ckpt upgrade``,
:mod:`megatron_ext.ckpt.legacy`); loading reads this form only.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map
from megatron.core.optimizer import OptimizerConfig as McOptimizerConfig
from megatron.core.optimizer.optimizer import MegatronOptimizer
from megatron.core.transformer.module import param_is_not_shared

from megatron_ext.megatron.grad_takeover import hand_grad_sync_over
from megatron_ext.megatron.loss_scale import LossScale
from megatron_ext.megatron.optimizer_factories import InnerFactory, NamedParams, is_expert_param
from megatron_ext.megatron.range_state import join_blocks, range_entries

#: Key prefix of the name-keyed optimizer state (named after the optimizer that introduced it;
#: kept so that checkpoints written since then load as they are).
STATE_PREFIX = "optimizer.layerwise"


def shard_tag_of(key: str, global_offset: Sequence[int]) -> str:
    """``key@offsets``: the name of a model shard (the model key and the global offset of the
    shard's first element, layer axes included) in :data:`STATE_PREFIX` keys."""
    return f"{key}@{'_'.join(str(o) for o in global_offset)}"


class MegatronExtOptimizer(MegatronOptimizer):
    """``MegatronOptimizer`` over fp32 master parameters; see the module docstring.

    Args:
        named_params: the model's ``(name, parameter)`` pairs, forward order.
        inner_factory: builds the wrapped optimizer over the trained named parameters; it keeps
            the fp32 masters and writes the model parameters (:data:`.InnerFactory`).
        config: megatron-core ``OptimizerConfig`` (``clip_grad``, ``log_num_zeros_in_grad``...).
    """

    def __init__(
        self, named_params: NamedParams, inner_factory: InnerFactory, config: McOptimizerConfig
    ) -> None:
        trained = [(n, p) for n, p in named_params if p.requires_grad]
        self.master_names = [n for n, _ in trained]
        self.model_params = [p for _, p in trained]
        inner = inner_factory(trained)
        self.master_params = [inner.master(n) for n in self.master_names]
        super().__init__(inner, config)
        self.is_stub_optimizer = False  # read by the base class's param_groups property
        self._param_sync_in_forward = False
        device = self.master_params[0].device if self.master_params else torch.device("cpu")
        self._scale = torch.ones(1, dtype=torch.float32, device=device)
        #: computes the global gradient norm instead of :meth:`get_grad_norm`'s own sum when
        #: set (the drop-in: megatron-core's arithmetic, :mod:`.mcore_grad_norm`); it reads
        #: whole gradients on every rank, so the layer-wise gradient sync drops it
        self.grad_norm_fn: Callable[[], float] | None = None
        #: fp16's loss scale (:mod:`.loss_scale`), built from ``config`` when ``config.fp16``
        #: as megatron-core's ``get_megatron_optimizer`` builds its grad scaler: the loss is
        #: multiplied by it before backward (the model config's ``grad_scale_func`` is
        #: :meth:`scale_loss`) and the gradients by its inverse before the step, which is
        #: skipped when one is not finite; None: no scaling (fp32, bf16)
        self.loss_scale: LossScale | None = (
            LossScale.from_megatron(
                config.loss_scale,
                config.initial_loss_scale,
                config.min_loss_scale,
                config.loss_scale_window,
                config.hysteresis,
                device,
            )
            if config.fp16
            else None
        )

    # -- gradients ------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_grads(self) -> bool:
        """Point master grads at DDP's fp32 ``main_grad`` buffers; False = no inf/nan check
        failed (the finite check happens on the global norm in :meth:`step`)."""
        grads = {}
        for name, p in zip(self.master_names, self.model_params, strict=True):
            grad = getattr(p, "main_grad", None)
            grads[name] = p.grad if grad is None else grad
        self.optimizer.set_grads(grads)  # layer-wise: only the masters this rank updates
        return False

    def _norm_groups(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Grads counted once: (dense, expert), without TP duplicates and shared copies, and
        with the layer-wise optimizer only the ones this rank owns (replicated: on rank 0)."""
        distributed = parallel_state.model_parallel_is_initialized()
        layerwise = self._layerwise()
        dense, expert = [], []
        for name, p in zip(self.master_names, self.master_params, strict=True):
            if p.grad is None or not param_is_not_shared(p):
                continue
            if layerwise and not self.optimizer.counts_toward_norm(name):
                continue  # counted by the rank that owns it
            if distributed and not tensor_parallel.param_is_not_tensor_parallel_duplicate(p):
                continue
            (expert if is_expert_param(p) else dense).append(p.grad)
        return dense, expert

    @staticmethod
    def _sum_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        return torch.stack(
            [torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in grads]
        ).sum()

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        """Global L2 norm of the gradients (all ranks of the model and expert groups)."""
        if self.grad_norm_fn is not None:
            return self.grad_norm_fn()
        dense, expert = self._norm_groups()
        dev = self._scale.device
        dense_sq, expert_sq = self._sum_sq(dense, dev), self._sum_sq(expert, dev)
        self._reduce_over_ranks(dense_sq, expert_sq)
        return math.sqrt(float(dense_sq + expert_sq))

    def _reduce_over_ranks(self, dense: torch.Tensor, expert: torch.Tensor) -> None:
        """Sum per-rank statistics over the ranks holding other parts of the gradients: the
        model-parallel groups, and with the layer-wise optimizer the data-parallel ones too."""
        if not parallel_state.model_parallel_is_initialized():
            return
        dist.all_reduce(dense, group=parallel_state.get_model_parallel_group())
        dist.all_reduce(
            expert, group=parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        )
        if self._layerwise():
            dist.all_reduce(dense, group=parallel_state.get_data_parallel_group())
            dist.all_reduce(expert, group=parallel_state.get_expert_data_parallel_group())

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        norm = self.get_grad_norm()
        if clip_grad > 0 and math.isfinite(norm):
            coeff = clip_grad / (norm + 1e-6)
            if coeff < 1.0:
                torch._foreach_mul_(
                    [p.grad for p in self.master_params if p.grad is not None], coeff
                )
        return norm

    @torch.no_grad()
    def count_zeros(self) -> float:
        dense, expert = self._norm_groups()
        dev = self._scale.device
        counts = [
            torch.tensor(float(sum(int((g == 0).sum()) for g in gs)), device=dev)
            for gs in (dense, expert)
        ]
        self._reduce_over_ranks(counts[0], counts[1])
        return float(counts[0] + counts[1])

    # -- step -----------------------------------------------------------------------------
    @torch.no_grad()
    def step_with_ready_grads(self) -> bool:
        self._step_inner()  # the wrapped optimizer rounds its masters into the model
        return True

    @torch.no_grad()
    def unscale_and_check(self) -> bool:
        """fp16: the held gradients times 1/scale; whether any gradient of any rank is not
        finite (max over the ranks holding other parts, as megatron-core's
        ``_unscale_main_grads_and_check_for_nan``); the scale updated by the outcome."""
        assert self.loss_scale is not None
        grads = [p.grad for p in self.master_params if p.grad is not None]
        found = self.loss_scale.unscale_and_check(grads)
        if parallel_state.model_parallel_is_initialized():
            dist.all_reduce(
                found, op=dist.ReduceOp.MAX, group=parallel_state.get_model_parallel_group()
            )
            if self._layerwise():  # each rank checked the gradients it owns
                dist.all_reduce(
                    found, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group()
                )
        found_inf = bool(found.item() > 0)
        self.loss_scale.update(found_inf)
        return found_inf

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        """Unscale (fp16), clip, count zeros, update. Returns (success, grad_norm,
        num_zeros_in_grad); a step skipped for a non-finite fp16 gradient returns
        (False, None, None), as megatron-core's."""
        self.prepare_grads()
        if self.loss_scale is not None and self.unscale_and_check():
            return False, None, None
        grad_norm = self.clip_grad_norm(self.config.clip_grad)
        if not math.isfinite(grad_norm):
            return False, grad_norm, None
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        return self.step_with_ready_grads(), grad_norm, num_zeros

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in (*self.model_params, *self.master_params):
            p.grad = None

    def get_loss_scale(self) -> torch.Tensor:
        return self._scale if self.loss_scale is None else self.loss_scale.scale

    def reload_model_params(self, state_dict: dict | None = None) -> None:
        """Refresh fp32 masters from the model parameters (after the model was loaded)."""
        self.optimizer.reload_masters()

    def _layerwise(self) -> bool:
        """Whether the wrapped optimizer shards over the data-parallel group (layer-wise
        ownership and/or element-sharded AdamW): it then takes over the gradient sync, its
        gradient statistics are summed over the group and its all-gathers are waited for."""
        from megatron_ext.distributed.domains import LayerwiseDomains
        from megatron_ext.distributed.layerwise import LayerwiseOptimizer
        from megatron_ext.distributed.sharded_adam import ShardedAdamW

        return isinstance(self.optimizer, (LayerwiseOptimizer, LayerwiseDomains, ShardedAdamW))

    def _step_inner(self) -> None:
        self.optimizer.step()
        if self._layerwise() and not self._param_sync_in_forward:
            # Every bucket's all-gather is in flight; the bf16 model copies need the masters
            # complete before step() returns.
            self.optimizer.finish()

    def overlap_param_sync_with_forward(self, model: torch.nn.Module) -> bool:
        """Let the next forward pass wait for each all-gather bucket just before its first
        use (forward pre-hooks) instead of waiting at the end of ``step``.

        Only for the layer-wise optimizer, which all-gathers into the model parameters (bf16
        ones as the rounding of their owner's fp32 master). Returns whether overlap is on.
        """
        if not self._layerwise():
            return False
        self.optimizer.attach_forward_hooks(model)
        self._param_sync_in_forward = True
        return True

    def take_over_grad_sync(self, model: Any) -> bool:
        """With the layer-wise optimizer, replace DDP's gradient all-reduce by bucketed
        reduce-scatter-v to the owners started from backward (:mod:`~megatron_ext.distributed.
        grad_sync`): each rank receives only the gradients it updates, about half an
        all-reduce's bytes, and nothing is copied or allocated per step.

        ``model``: :class:`~megatron_ext.megatron.ddp.DistributedDataParallel`, or a list of
        them (virtual pipeline stages' chunks, one per part: :func:`~.optimizer_factories.
        chunked_factory`). Each part's gradients are laid out anew in its DDP grad buffer
        (bucket by bucket, rank-major), ``main_grad`` re-pointed at the new views (values
        moved along), DDP's scaling (1/dp) applied per bucket before the sum. Returns whether
        it did."""
        if not self._layerwise():
            return False
        self.grad_norm_fn = None  # each rank now receives only the gradients it updates
        models = list(model) if isinstance(model, (list, tuple)) else [model]
        parts = getattr(self.optimizer, "parts", [self.optimizer])
        param_of = dict(zip(self.master_names, self.model_params, strict=True))
        hand_grad_sync_over(parts, param_of, models)
        return True

    def grad_sync_bytes(self) -> dict[str, int] | None:
        """Bytes this rank sent and received in gradient reduce-scatters since it was built
        (None unless the layer-wise optimizer took the gradient sync over)."""
        return dataclasses.asdict(self.optimizer.grad_wire) if self._layerwise() else None

    def finish_param_sync(self) -> None:
        """Wait for any parameter all-gather still in flight (before reading parameters)."""
        if self._layerwise():
            self.optimizer.finish()

    # -- state: keyed by parameter, independent of the data-parallel size -------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"layerwise": {parameter name: {state key: value}}}``, fp32 masters included."""
        return {"layerwise": self.optimizer.named_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (the union of the saving ranks' entries is enough), or
        what dist_checkpointing loaded for :meth:`sharded_state_dict` (an element-sharded
        range's blocks joined back into the range)."""
        named = {
            name: {k: join_blocks(v) for k, v in st.items()}
            for name, st in state_dict["layerwise"].items()
        }
        self.optimizer.load_named_state(named)

    def _init_state(self) -> None:
        """Create the wrapped optimizer's state before loading into it: one step with zero
        gradients, lr 0 and weight decay 0, which changes no parameter."""
        if self.optimizer.state:
            return
        saved = [(g["lr"], g.get("weight_decay", 0.0)) for g in self.optimizer.param_groups]
        for g in self.optimizer.param_groups:
            g["lr"], g["weight_decay"] = 0.0, 0.0
        for p in self.master_params:
            p.grad = torch.zeros_like(p)
        self._step_inner()
        self.finish_param_sync()
        for g, (lr, wd) in zip(self.optimizer.param_groups, saved, strict=True):
            g["lr"], g["weight_decay"] = lr, wd
        self.zero_grad()

    def sharded_state_dict(
        self, model_sharded_state_dict: dict, is_loading: bool = False, metadata: dict | None = None
    ) -> dict[str, Any]:
        """The name-keyed state for dist_checkpointing (:meth:`named_sharded_state`); when
        loading, the wrapped optimizer's state is created first (:meth:`_init_state`)."""
        self.finish_param_sync()
        if is_loading:
            self._init_state()
        return self.named_sharded_state(model_sharded_state_dict)

    def model_shards(self, model_sharded_state_dict: dict) -> dict[str, Any]:
        """Each trained parameter's ShardedTensor (or factory) in the model checkpoint (key +
        global offset name it independently of data-parallel size, ownership and stage)."""
        id_map = get_param_id_to_sharded_param_map(model_sharded_state_dict, self.model_params)
        return {n: id_map[i] for i, n in enumerate(self.master_names)}

    @staticmethod
    def shard_tag(sh: Any) -> str:
        """``key@offsets`` of a model shard; for a ShardedTensorFactory (e.g. SwiGLU's fc1, saved
        as its gate and up halves) the first tensor it builds, which carries the layer offset."""
        while not hasattr(sh, "global_offset"):
            sh = sh.build() if hasattr(sh, "build") else next(iter(sh.values()))
            if isinstance(sh, (list, tuple)):
                sh = sh[0]
        return shard_tag_of(sh.key, sh.global_offset)

    def named_sharded_state(self, model_sharded_state_dict: dict) -> dict[str, Any]:
        """The state of every parameter this rank holds, one entry per (parameter, state key),
        ``optimizer.layerwise.<state key>.<model shard tag>``: tensors as whole ShardedTensors,
        scalars as ShardedObjects, so a checkpoint loads at any data-parallel size. One replica
        writes each (replica 0): the wrapped optimizer's ``saves`` (the layer-wise owner, or
        data-parallel rank 0 when every rank steps everything), tensor-parallel duplicates by
        TP rank 0. A bf16 parameter's fp32 master is one more entry (``fp32_param``)."""
        opt = self.optimizer
        shards = self.model_shards(model_sharded_state_dict)
        params = dict(zip(self.master_names, self.master_params, strict=True))
        tp_main = {  # a tensor-parallel duplicate (e.g. a norm) is written by TP rank 0 only
            n: not parallel_state.model_parallel_is_initialized()
            or tensor_parallel.param_is_not_tensor_parallel_duplicate(p)
            for n, p in params.items()
        }
        state: dict[str, dict[str, Any]] = {}
        for name, st in opt.named_state().items():
            # the tied output layer's copy of the word embeddings (last pipeline stage) is
            # written by the first stage, as megatron-core's model state (replica_id (1, ...))
            first = tp_main[name] and not _pipeline_copy(shards[name])
            replica = 0 if opt.saves(name) and first else 1 + dist.get_rank()
            tag = self.shard_tag(shards[name])
            flat = _flat_range(opt, name)
            if flat is not None:  # element-sharded (ZeRO-1): this rank's range, in blocks
                writes = first and flat[0] == 0  # of the step counter: one rank
                counter = 0 if writes else 1 + dist.get_rank()
                shape = tuple(self.model_params[self.master_names.index(name)].shape)  # TP shard
                state[name] = range_entries(
                    st, f"{STATE_PREFIX}.{{}}.{tag}", shape, flat, replica, counter
                )
                continue
            entry = {}
            for k, v in st.items():
                key = f"{STATE_PREFIX}.{k}.{tag}"
                if torch.is_tensor(v) and v.dim() > 0:
                    entry[k] = ShardedTensor.from_rank_offsets(key, v, replica_id=replica)
                else:
                    entry[k] = ShardedObject(key, v, (1,), (0,), replica_id=replica)
            state[name] = entry
        return {"layerwise": state}


def _pipeline_copy(sh: Any) -> bool:
    """Whether a model shard is a copy another pipeline stage writes (megatron-core marks the
    tied output layer's weight on the last stage with ``replica_id`` ``(1, ...)``)."""
    replica = getattr(sh, "replica_id", 0)
    return isinstance(replica, tuple) and bool(replica[0])


def _flat_range(opt: Any, name: str) -> tuple[int, int] | None:
    """This rank's element range of ``name`` when the wrapped optimizer element-shards it."""
    flat_range = getattr(opt, "flat_range", None)
    return None if flat_range is None else flat_range(name)
