"""The layer-wise distributed optimizer: each data-parallel rank updates the whole matrices it
owns, then the updated parameters are all-gathered (variable size, no padding).

What is computed (the optimizers, per parameter) is separate from where (the ownership plan) and
how results travel (:mod:`.allgather_v`).  With identical gradients on every rank, a step gives
every rank the parameters a single process would compute: each parameter is updated by exactly
one rank with exactly the single-process arithmetic, and the all-gather copies bits.

Parameters are grouped into buckets in the order given (pass them in forward execution order);
each bucket is one flat buffer laid out rank by rank, so rank r's updated matrices are one
contiguous segment. With more than one rank the parameters *live* in these buffers (their
``.data`` is re-pointed at construction, as megatron-core's DDP does for its distributed
optimizer): the optimizers update the owned segment in place and the all-gather writes the
others' segments straight into the parameters, so nothing is copied or allocated per step.
:meth:`LayerwiseOptimizer.step` launches a bucket's all-gather as soon as this rank's updates in
it are done, so communication overlaps the updates of later buckets;
:meth:`LayerwiseOptimizer.wait_bucket` (called by a forward pre-hook, or by ``finish``) waits
for one bucket. At one rank there is nothing to gather and the parameters stay where they are.

Gradients travel in the same buckets the other way (:mod:`.grad_sync`).

Low-precision parameters (bf16) get an fp32 master copy only where this rank updates them (the
parameters it owns, and the small replicated ones): the optimizers step the masters, the owner
rounds each updated master into its model parameter (in the bucket), and the all-gather
carries the model dtype. A rank therefore keeps fp32 masters (and optimizer state) for about
1/dp of the model, and the wire carries half the bytes of an fp32 gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_ext.distributed.allgather_v import AllGatherV, Pending, WireStats
from megatron_ext.distributed.grad_sync import GradSync
from megatron_ext.distributed.layerwise_state import MASTER_KEY as MASTER_KEY  # re-exported
from megatron_ext.distributed.layerwise_state import NamedState
from megatron_ext.distributed.plan import OwnershipPlan, ParamSpec, bucket_layout, plan_ownership
from megatron_ext.optimizers.options import MatrixRouting
from megatron_ext.optimizers.qkv import QKVLayout, qkv_weight_decay_groups
from megatron_ext.optimizers.registry import build_optimizer
from megatron_ext.optimizers.routing import route_parameter, weight_decay_groups
from megatron_ext.optimizers.spec import optimizer_spec

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]
# Attributes megatron-core reads from a parameter (tensor parallelism, tied weights, experts):
# they travel with its fp32 master.
PARAM_ATTRIBUTES = (
    "tensor_model_parallel",
    "partition_dim",
    "partition_stride",
    "shared",
    "allreduce",
)


def fp32_master(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """``p`` itself when it is fp32, else an fp32 copy carrying its megatron-core attributes."""
    if p.dtype == torch.float32:
        return p
    master = torch.nn.Parameter(p.detach().clone().float())
    for attr in PARAM_ATTRIBUTES:
        if hasattr(p, attr):
            setattr(master, attr, getattr(p, attr))
    return master


def forward_wait_hooks(
    model: torch.nn.Module, buckets: Sequence[tuple[Any, Sequence[str]]], wait: Any
) -> list[Any]:
    """Forward pre-hooks calling ``wait(bucket)`` on each module holding a member of a bucket
    (``buckets``: ``(bucket, member names)``); ``wait`` must return at once for a bucket
    already waited for."""
    holder = {}
    for module_name, module in model.named_modules():
        for param_name, _ in module.named_parameters(recurse=False):
            holder[f"{module_name}.{param_name}" if module_name else param_name] = module
    handles = []
    for bucket, members in buckets:
        modules = {}
        for name in members:
            if name not in holder:
                raise ValueError(f"{name} is not a parameter of the given model")
            modules[id(holder[name])] = holder[name]
        for module in modules.values():

            def hook(_module: torch.nn.Module, _args: Any, bucket: Any = bucket) -> None:
                wait(bucket)

            handles.append(module.register_forward_pre_hook(hook))
    return handles


@dataclass
class Bucket:
    """Parameters synchronised by one all-gather; ``order`` is rank-major (owner, then name)."""

    index: int
    order: list[tuple[str, torch.nn.Parameter]]
    counts: list[int]  # elements per owner rank
    optimizers: dict[str, torch.optim.Optimizer]  # over this rank's parameters in the bucket
    first: str = ""  # the bucket's first parameter in forward order
    buffer: torch.Tensor | None = None  # holds the parameters (world > 1), rank-major
    pending: Pending | None = None


@dataclass
class LayerwiseOptimizer(NamedState):
    """Step only the parameters this rank owns; all-gather the rest.

    Args:
        named_params: model parameters in forward order (replicated on every data-parallel rank).
        matrix_optimizer: registered optimizer for hidden matrices (``muon``, ``mop``,
            ``kl_soap``, ``lion``) or ``adamw`` for everything.
        hyperparameters: per optimizer name, its keyword hyperparameters.
        gather: the all-gather-v backend over this data-parallel group.
        bucket_numel: parameters per bucket, in elements (a bucket closes when it would exceed).
        tp_shards: tensor-parallel shards and their layout; the matrix optimizers update them in
            their ``tp_mode`` (:mod:`megatron_ext.optimizers.tensor_parallel`).
        routing: which parameters the matrix optimizer takes (``rules`` of
            :func:`~megatron_ext.optimizers.routing.route_parameter`).
        qkv_layout: the model's fused-QKV layout when the matrix optimizer (Muon, MOP) is to
            orthogonalise Q, K and V of each ``linear_qkv.weight`` separately; None keeps the
            fused weight whole.
    """

    named_params: NamedParams
    matrix_optimizer: str
    gather: AllGatherV
    hyperparameters: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    overrides: Sequence[tuple[str, str]] = ()
    bucket_numel: int = 4_000_000
    tp_shards: Mapping[torch.Tensor, Any] | None = None  # TPShardInfo of tensor-parallel shards
    # when a list: ("update"|"launch"|"wait", bucket) of the parameter all-gathers, and
    # ("grad_launch"|"grad_wait", bucket) of the gradient reduce-scatters (:mod:`.grad_sync`)
    events: list[tuple[str, int]] | None = None
    routing: MatrixRouting = "megatron_ext"
    qkv_layout: QKVLayout | None = None

    def __post_init__(self) -> None:
        self.rank, self.world = self.gather.rank, self.gather.world
        self.routes = {
            n: route_parameter(
                n,
                tuple(p.shape),
                matrix_optimizer=self.matrix_optimizer,
                overrides=self.overrides,
                rules=self.routing,
            )
            for n, p in self.named_params
        }
        # bf16 parameters get an fp32 master where they are updated: 4 bytes per element more
        specs = [
            ParamSpec(
                n,
                tuple(p.shape),
                self.routes[n],
                master_bytes_per_element=0 if p.dtype == torch.float32 else 4,
            )
            for n, p in self.named_params
        ]
        self.plan: OwnershipPlan = plan_ownership(specs, self.world, self.hyperparameters)
        self._params = dict(self.named_params)
        # fp32 masters only for the parameters this rank updates (owned or replicated).
        self.masters = {n: fp32_master(p) for n, p in self.named_params if self.holds(n)}
        self._tp = {
            n: shards[p] for n, p in self.named_params if p in (shards := self.tp_shards or {})
        }
        replicated = OwnershipPlan.REPLICATED
        self.replicated = [n for n, _ in self.named_params if self.plan.owner[n] == replicated]
        self.replicated_optimizers = self._optimizers_for(self.replicated)
        self.buckets = self._build_buckets()
        # Gradients travel in the same buckets, rank-major, the replicated ones after them.
        self.grad_sync = GradSync(
            [([(n, p.numel()) for n, p in b.order], b.counts) for b in self.buckets],
            [(n, self._params[n].numel()) for n in self.replicated],
            self.rank,
            self.world,
            self.gather.group,
            self.events,
        )

    # -- construction ---------------------------------------------------------------------
    def _optimizers_for(self, members: Iterable[str]) -> dict[str, torch.optim.Optimizer]:
        """One optimizer per routed name over the masters of ``members``; biases and 1-D tensors
        get no weight decay (megatron-core's convention)."""
        by_route: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        for name in members:
            by_route.setdefault(self.routes[name], []).append((name, self.masters[name]))
        optimizers = {}
        for route, named in by_route.items():
            groups = (
                weight_decay_groups(named)
                if self.qkv_layout is None or route == "adamw"
                else qkv_weight_decay_groups(named, self.qkv_layout)
            )
            hp = dict(self.hyperparameters.get(route) or {})
            shards = {p: self._tp[n] for n, p in named if n in self._tp}
            # element-wise optimizers (AdamW, Lion) update shards as they are
            if shards and optimizer_spec(route).couples_matrix_entries:
                hp["tp_shards"] = shards
            optimizers[route] = build_optimizer(route, groups, hp)
        return optimizers

    def _build_buckets(self) -> list[Bucket]:
        """The plan's bucket layout (:func:`~.plan.bucket_layout`), each bucket with optimizers
        over this rank's share."""
        layouts = bucket_layout(
            [(n, p.numel(), str(p.dtype)) for n, p in self.named_params],
            self.plan,
            self.bucket_numel,
        )
        buckets = []
        for i, layout in enumerate(layouts):
            members = [(n, self._params[n]) for n in layout.members]
            order = sorted(members, key=lambda m: self.plan.owner[m[0]])  # stable: keeps fwd order
            mine = [n for n in layout.members if self.plan.owner[n] == self.rank]
            buckets.append(
                Bucket(
                    index=i,
                    order=order,
                    counts=list(layout.counts),
                    optimizers=self._optimizers_for(mine),
                    first=layout.members[0],
                )
            )
            if self.world > 1:
                self._move_into_buffer(buckets[-1])
        return buckets

    @torch.no_grad()
    def _move_into_buffer(self, bucket: Bucket) -> None:
        """Give ``bucket`` one flat buffer in its parameters' dtype, rank-major, and make each
        parameter a view of its segment (values unchanged; the ``Parameter`` objects, and so
        the model's and the optimizers' references, stay the same)."""
        first = bucket.order[0][1]
        bucket.buffer = first.new_empty(sum(bucket.counts))
        offset = 0
        for _, p in bucket.order:
            segment = bucket.buffer[offset : offset + p.numel()].view_as(p)
            segment.copy_(p)
            p.data = segment
            offset += p.numel()

    # -- step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> None:
        """Update replicated parameters, then bucket by bucket this rank's parameters, launching
        each bucket's all-gather as soon as its updates are done (it then overlaps the updates
        of the following buckets and, until waited on, the next forward pass)."""
        self.finish()  # a bucket nobody waited for (no forward since the last step)
        for opt in self.replicated_optimizers.values():
            opt.step()
        for name in self.replicated:
            if self.masters[name] is not self._params[name]:
                self._params[name].copy_(self.masters[name])
        for bucket in self.buckets:
            self._record("update", bucket.index)
            for opt in bucket.optimizers.values():
                opt.step()
            self._launch(bucket)
            self._record("launch", bucket.index)

    def _record(self, what: str, index: int) -> None:
        if self.events is not None:
            self.events.append((what, index))

    def _launch(self, bucket: Bucket) -> None:
        """Round this rank's updated masters into their model parameters (in the model dtype,
        inside the bucket), then start the bucket's all-gather (none at one rank)."""
        for name, p in bucket.order:
            if self.plan.owner[name] == self.rank:
                master = self.masters[name]
                if master is not p:
                    p.copy_(master)
        if bucket.buffer is not None:
            bucket.pending = self.gather.start(bucket.buffer, bucket.counts)

    @torch.no_grad()
    def wait_bucket(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s all-gather: the other ranks' parameters have then arrived in
        place."""
        if bucket.pending is None:
            return
        bucket.pending.wait()
        bucket.pending = None
        self._record("wait", bucket.index)

    def finish(self) -> None:
        """Wait for every bucket still in flight."""
        for bucket in self.buckets:
            self.wait_bucket(bucket)

    # -- masters and their gradients ----------------------------------------------------------
    def master(self, name: str) -> torch.nn.Parameter:
        """The tensor the optimizers update for ``name``: its fp32 master where this rank holds
        one, else the model parameter itself (fp32 parameters are their own masters)."""
        return self.masters.get(name, self._params[name])

    def set_grads(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        """Give each held parameter's master its gradient (as fp32; an fp32 gradient is used
        in place, not copied); the others' masters are not updated here and get none."""
        for name, g in grads.items():
            if name in self.masters:
                self.masters[name].grad = None if g is None else g.float()

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy the model parameters into the fp32 masters (after the model was loaded)."""
        for name, p in self.named_params:
            master = self.masters.get(name)
            if master is not None and master is not p:
                master.copy_(p)

    def attach_forward_hooks(self, model: torch.nn.Module) -> list[Any]:
        """Wait for each bucket in a forward pre-hook of every module holding one of its
        parameters (the first to run waits; the rest find nothing pending), so the all-gathers
        overlap the next forward pass up to the first use of each bucket. Every member's
        module, not only the first parameter's: registration order is not forward order
        (megatron-core registers ``linear_proj`` before ``linear_qkv``). ``model``'s parameter
        names must be the ones this optimizer has."""
        return forward_wait_hooks(
            model, [(b, [n for n, _ in b.order]) for b in self.buckets], self.wait_bucket
        )

    # -- gradient sync: reduce-scatter-v to the owners (:mod:`.grad_sync`) ------------------
    @property
    def grad_wire(self) -> WireStats:
        """Payload bytes of the gradient reduce-scatters, cumulative (assignable, to reset)."""
        return self.grad_sync.wire

    @grad_wire.setter
    def grad_wire(self, wire: WireStats) -> None:
        self.grad_sync.wire = wire

    @property
    def grad_numel(self) -> int:
        """Elements of gradient storage :meth:`bind_grad_storage` lays out."""
        return self.grad_sync.numel

    def bind_grad_storage(self, storage: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
        """Lay the gradients out in ``storage`` (1-D; e.g. DDP's grad buffer), scaled by
        ``scale`` before they are summed; returns each parameter's 1-D gradient view, which
        the caller makes the gradient its backward accumulates into."""
        return self.grad_sync.bind(storage, scale)

    def grad_ready(self, name: str) -> None:
        """Backward has completed ``name``'s gradient: a bucket whose gradients are all
        complete starts its reduce-scatter-v (:meth:`.GradSync.grad_ready`)."""
        self.grad_sync.grad_ready(name)

    def finish_grad_sync(self) -> None:
        """Wait for every gradient bucket (starting any backward did not); afterwards the owned
        and replicated gradients in the bound storage hold their sums over the ranks."""
        self.grad_sync.finish()

    @torch.no_grad()
    def reduce_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Sum each gradient over the data-parallel ranks into its owner's copy, in place, for
        gradients that live outside a bound storage.

        ``grads[name]``: this rank's contribution (already scaled, e.g. by 1/dp). They are
        copied into the sync's own storage (allocated once), reduced bucket by bucket (a
        variable-size reduce-scatter each, :mod:`.reduce_scatter_v`; the replicated ones in one
        all-gather), and the owned and replicated sums copied back; the others keep local
        partial values, which nothing reads (norms and updates use owned gradients only). At one
        rank nothing is done. Payload bytes are counted in :attr:`grad_wire`."""
        if self.world == 1:
            return
        sync = self.grad_sync
        sync.reduce_copies(grads)
        for name, view in sync.views.items():
            g = grads[name]
            if self.holds(name) and g.data_ptr() != view.data_ptr():
                g.copy_(view.view_as(g))

    # -- ownership and bookkeeping ----------------------------------------------------------
    def counts_toward_norm(self, name: str) -> bool:
        """Whether this rank counts ``name`` in global gradient statistics: the owner does, and
        rank 0 for replicated parameters, so each gradient is counted exactly once."""
        owner = self.plan.owner[name]
        return owner == self.rank or (owner == OwnershipPlan.REPLICATED and self.rank == 0)

    def master_bytes(self) -> int:
        """Bytes of the separate fp32 masters this rank keeps (0 for fp32 parameters)."""
        return sum(4 * m.numel() for n, m in self.masters.items() if m is not self._params[n])

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        return [
            *self.replicated_optimizers.values(),
            *(o for b in self.buckets for o in b.optimizers.values()),
        ]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for opt in self.all_optimizers() for g in opt.param_groups]

    @property
    def state(self) -> dict[Any, Any]:
        return {k: v for opt in self.all_optimizers() for k, v in opt.state.items()}

    def saves(self, name: str) -> bool:
        """Whether this rank writes ``name``'s state: its owner, or rank 0 if replicated."""
        return self.counts_toward_norm(name)

    def holds(self, name: str) -> bool:
        """Whether this rank keeps state for ``name``: owned or replicated parameters."""
        return self.plan.owner[name] in (self.rank, OwnershipPlan.REPLICATED)
