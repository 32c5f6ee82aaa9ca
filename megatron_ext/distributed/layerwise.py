"""The layer-wise distributed optimizer: each data-parallel rank updates the whole matrices it
owns, then the updated parameters are all-gathered (variable size, no padding).

What is computed (the optimizers, per parameter) is separate from where (the ownership plan) and
how results travel (:mod:`.allgather_v`).  With identical gradients on every rank, a step gives
every rank the parameters a single process would compute: each parameter is updated by exactly
one rank with exactly the single-process arithmetic, and the all-gather copies bits.

Parameters are grouped into buckets in the order given (pass them in forward execution order);
each bucket is one flat buffer laid out rank by rank, so rank r's updated matrices are one
contiguous segment.  :meth:`LayerwiseOptimizer.step` launches a bucket's all-gather as soon as
this rank's updates in it are done, so communication overlaps the updates of later buckets;
:meth:`LayerwiseOptimizer.wait_bucket` (called by a forward pre-hook, or by ``finish``) waits
for one bucket and copies it back into the parameters.

Low-precision parameters (bf16) get an fp32 master copy only where this rank updates them (the
parameters it owns, and the small replicated ones): the optimizers step the masters, the owner
rounds each updated master into its model parameter and into the bucket, and the all-gather
carries the model dtype. A rank therefore keeps fp32 masters (and optimizer state) for about
1/dp of the model, and the wire carries half the bytes of an fp32 gather.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_ext.distributed.allgather_v import AllGatherV, Pending, WireStats
from megatron_ext.distributed.plan import OwnershipPlan, ParamSpec, bucket_layout, plan_ownership
from megatron_ext.distributed.reduce_scatter_v import reduce_scatter_v
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
MASTER_KEY = "fp32_param"  # the master's entry in the name-keyed state


def fp32_master(p: torch.nn.Parameter) -> torch.nn.Parameter:
    """``p`` itself when it is fp32, else an fp32 copy carrying its megatron-core attributes."""
    if p.dtype == torch.float32:
        return p
    master = torch.nn.Parameter(p.detach().clone().float())
    for attr in PARAM_ATTRIBUTES:
        if hasattr(p, attr):
            setattr(master, attr, getattr(p, attr))
    return master


@dataclass
class Bucket:
    """Parameters synchronised by one all-gather; ``order`` is rank-major (owner, then name)."""

    index: int
    order: list[tuple[str, torch.nn.Parameter]]
    counts: list[int]  # elements per owner rank
    optimizers: dict[str, torch.optim.Optimizer]  # over this rank's parameters in the bucket
    first: str = ""  # the bucket's first parameter in forward order
    buffer: torch.Tensor | None = None
    pending: Pending | None = None


@dataclass
class LayerwiseOptimizer:
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
    events: list[tuple[str, int]] | None = None  # when a list: ("update"|"launch"|"wait", bucket)
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
            n: self.tp_shards[p] for n, p in self.named_params if p in (self.tp_shards or {})
        }
        replicated = OwnershipPlan.REPLICATED
        self.replicated = [n for n, _ in self.named_params if self.plan.owner[n] == replicated]
        self.replicated_optimizers = self._optimizers_for(self.replicated)
        self.buckets = self._build_buckets()
        self.grad_wire = WireStats()  # reduce_grads payload, cumulative

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
        return buckets

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
        """Round this rank's updated masters into their model parameters and the bucket (in the
        model dtype), then start the bucket's all-gather."""
        first = bucket.order[0][1]
        buffer = torch.empty(sum(bucket.counts), dtype=first.dtype, device=first.device)
        offset = 0
        for name, p in bucket.order:
            if self.plan.owner[name] == self.rank:
                master = self.masters[name]
                if master is not p:
                    p.copy_(master)
                buffer[offset : offset + p.numel()].copy_(p.reshape(-1))
            offset += p.numel()
        bucket.buffer = buffer
        bucket.pending = self.gather.start(buffer, bucket.counts)

    @torch.no_grad()
    def wait_bucket(self, bucket: Bucket) -> None:
        """Wait for ``bucket``'s all-gather and write the other ranks' parameters back."""
        if bucket.pending is None:
            return
        buffer = bucket.pending.wait()
        offset = 0
        for name, p in bucket.order:
            if self.plan.owner[name] != self.rank:
                p.copy_(buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        bucket.pending = None
        bucket.buffer = None
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
        """Wait for each bucket in a forward pre-hook of the module holding its first parameter
        (in forward order), so the all-gathers overlap the next forward pass up to the first
        use of each bucket. ``model``'s parameter names must be the ones this optimizer has."""
        holder = {}
        for module_name, module in model.named_modules():
            for param_name, _ in module.named_parameters(recurse=False):
                holder[f"{module_name}.{param_name}" if module_name else param_name] = module
        handles = []
        for bucket in self.buckets:
            if bucket.first not in holder:
                raise ValueError(f"{bucket.first} is not a parameter of the given model")

            def wait(_module: torch.nn.Module, _args: Any, bucket: Bucket = bucket) -> None:
                self.wait_bucket(bucket)

            handles.append(holder[bucket.first].register_forward_pre_hook(wait))
        return handles

    # -- gradient sync: reduce-scatter-v to the owners ----------------------------------------
    @torch.no_grad()
    def reduce_grads(self, grads: Mapping[str, torch.Tensor]) -> None:
        """Sum each gradient over the data-parallel ranks into its owner's copy, in place.

        ``grads[name]``: this rank's contribution (already scaled, e.g. by 1/dp). Per bucket one
        variable-size reduce-scatter (:mod:`.reduce_scatter_v`); replicated parameters are
        all-reduced. Afterwards only the owner's (and replicated) gradients hold sums; the
        others keep local partial values, which nothing reads (norms and updates use owned
        gradients only). Payload bytes are counted in :attr:`grad_wire`."""
        group = self.gather.group
        for name in self.replicated:
            torch.distributed.all_reduce(grads[name], group=group)
        for bucket in self.buckets:
            names = [n for n, _ in bucket.order]
            owned = [self.plan.owner[n] == self.rank for n in names]
            reduce_scatter_v(grads, names, owned, bucket.counts, self.rank, group, self.grad_wire)

    # -- bookkeeping --------------------------------------------------------------------------
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

    # -- name-keyed state (independent of the data-parallel size and the plan) -----------------
    def _master_names(self) -> dict[int, str]:
        return {id(m): n for n, m in self.masters.items()}

    def saves(self, name: str) -> bool:
        """Whether this rank writes ``name``'s state: its owner, or rank 0 if replicated."""
        return self.counts_toward_norm(name)

    def holds(self, name: str) -> bool:
        """Whether this rank keeps state for ``name``: owned or replicated parameters."""
        return self.plan.owner[name] in (self.rank, OwnershipPlan.REPLICATED)

    def named_state(self) -> dict[str, dict[str, Any]]:
        """``{parameter name: {state key: value}}`` for every parameter this rank holds, with the
        fp32 master of a low-precision parameter under ``"fp32_param"``.

        Tensors are copies: the optimizers keep some state as views of stacked tensors (KL-SOAP
        packs same-shape matrices), and a view would drag its whole stack into a file."""
        names = self._master_names()
        out: dict[str, dict[str, Any]] = {}
        for opt in self.all_optimizers():
            for p, st in opt.state.items():
                out[names[id(p)]] = {
                    k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()
                }
        for name, master in self.masters.items():
            if master is not self._params[name]:
                out.setdefault(name, {})[MASTER_KEY] = master.detach().clone()
        return out

    def load_named_state(self, named: Mapping[str, Mapping[str, Any]]) -> None:
        """Install name-keyed state (from :meth:`named_state` of any data-parallel size) for every
        parameter this rank holds; a held parameter missing from ``named`` is an error. A saved
        fp32 master is copied into this rank's master (for an fp32 parameter: the parameter)."""
        missing = [n for n in self._params if self.holds(n) and n not in named]
        if missing:
            raise ValueError(
                f"optimizer state is missing for {len(missing)} parameters (e.g. {missing[0]}): "
                f"the checkpoint was written for a different model or optimizer"
            )
        names = self._master_names()
        for opt in self.all_optimizers():
            by_id = {id(p): p for g in opt.param_groups for p in g["params"]}
            opt.state.clear()
            for pid, p in by_id.items():
                st = {
                    k: v.detach().clone().to(p.device) if torch.is_tensor(v) else v
                    for k, v in named[names[pid]].items()
                    if k != MASTER_KEY
                }
                if st:  # a parameter never stepped has a master but no optimizer state yet
                    opt.state[p] = st
        with torch.no_grad():
            for name, master in self.masters.items():
                if MASTER_KEY in named[name]:
                    master.copy_(named[name][MASTER_KEY])

    def state_dict(self) -> dict[str, Any]:
        """Name-keyed state of the parameters this rank holds (see :meth:`named_state`)."""
        return {"state": self.named_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; ``state["state"]`` may be the union of every saving
        rank's dicts, written at any data-parallel size."""
        self.load_named_state(state["state"])
