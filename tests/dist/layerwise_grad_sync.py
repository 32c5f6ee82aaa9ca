"""Run under torchrun (gloo): the layer-wise optimizer's gradient path under megatron-core's DDP.

A tiny megatron-core GPTModel in this project's DDP with the layer-wise optimizer (Muon, small
buckets), and beside it the same model in megatron-core's own DDP (its all-reduce). Each of
STEPS iterations: forward, backward, ``finish_grad_sync``, ``optimizer.step()``. Each rank
writes ``OUT.<rank>.json`` with what the test checks:

* ``events``: the optimizer's event log with ``("backward_end", -1)`` appended by a hook on the
  last gradient backward completes (the word embedding's) — the sync must start before it;
* ``pointers``: per step, the data pointers of every communication buffer, ``main_grad`` and
  parameter; ``params_in_buckets``: whether each bucketed parameter lives in its bucket's
  all-gather buffer;
* ``inside_ddp``: whether every ``main_grad`` is a view of DDP's own grad buffer;
* ``calls``: per step, the collectives the gradient sync issued (``torch.distributed``'s
  functions wrapped and counted while the sync's code runs);
* ``ops``: the aten ops the gradient sync ran on the last step and how many of them allocated
  a new storage (a torch dispatch mode around the hooks and ``finish_grad_sync``);
* ``equal_to_mcore``: the owned and replicated gradients after the sync, bit for bit equal to
  megatron-core's all-reduced ones (first step, same weights and data: the sum of two is
  commutative).
* ``sharded``: the same figures for a third model trained as the GPT trainer builds it --
  the matrices in the layer-wise optimizer, the AdamW-routed rest in the element-sharded AdamW
  (:class:`~megatron_ext.distributed.sharded_adam.ShardedAdamW`, small buckets) sharing one
  DDP grad buffer -- with the AdamW part's events, buffers, collectives and allocations, and
  its ranges' gradients against megatron-core's.

Usage: layerwise_grad_sync.py OUT
"""

import json
import os
import sys
from collections import Counter

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel as McDDP
from megatron.core.distributed import DistributedDataParallelConfig
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_ext.config.optimizer import OptimizerConfig
from megatron_ext.distributed.allgather_v import make_allgather_v
from megatron_ext.distributed.domains import LayerwiseDomains
from megatron_ext.distributed.layerwise import LayerwiseOptimizer
from megatron_ext.distributed.sharded_adam import ShardedAdamW
from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
from megatron_ext.megatron.ddp import DistributedDataParallel
from megatron_ext.megatron.model import build_gpt_model
from megatron_ext.megatron.optimizer import MegatronExtOptimizer
from megatron_ext.megatron.optimizer_factories import hyperparameters, megatron_optimizer_config
from megatron_ext.megatron.parallel import init_distributed, set_seeds
from megatron_ext.optimizers.registry import build_optimizer
from megatron_ext.optimizers.routing import route_parameter
from tests.dist.ending import leave

STEPS, BATCH, SEQ, VOCAB = 3, 4, 16, 64
COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "batch_isend_irecv", "all_to_all_single")


class StorageCounter(TorchDispatchMode):
    """Every aten op run inside it, and how many returned a tensor on a new storage."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()
        self.allocations = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        inputs = {
            t.untyped_storage().data_ptr()
            for t in torch.utils._pytree.tree_leaves((args, kwargs or {}))
            if isinstance(t, torch.Tensor)
        }
        out = func(*args, **(kwargs or {}))
        self.ops[str(func)] += 1
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.allocations += 1
        return out


def build(ddp_class, cfg: ModelConfig, parallel: ParallelConfig):
    set_seeds(7)  # the same weights in both models
    module = build_gpt_model(cfg, parallel, "fp32", vocab_size=VOCAB, seq_length=SEQ)
    ddp = ddp_class(
        module.config,
        DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False),
        module,
    )
    return module, ddp


class Watched:
    """The collectives a gradient sync issues and the allocations its code makes: its
    ``grad_ready`` and ``finish`` run under a :class:`StorageCounter`, and the wrapped
    ``torch.distributed`` functions count only while they run."""

    active: "Watched | None" = None

    def __init__(self, sync) -> None:
        self.counter = StorageCounter()
        self.calls: Counter = Counter()
        for method in ("grad_ready", "finish"):
            setattr(sync, method, self._watched(getattr(sync, method)))

    def _watched(self, inner):
        def watched(*a, **k):
            Watched.active = self
            try:
                with self.counter:
                    return inner(*a, **k)
            finally:
                Watched.active = None

        return watched

    def clear(self) -> None:
        self.calls.clear()
        self.counter.ops.clear()
        self.counter.allocations = 0

    @staticmethod
    def install() -> None:
        def counting(name, fn):
            def counted(*a, **k):
                if Watched.active is not None:
                    Watched.active.calls[name] += 1
                return fn(*a, **k)

            return counted

        for name in COLLECTIVES:
            setattr(dist, name, counting(name, getattr(dist, name)))


def sharded_factory(group, recipe_opt: OptimizerConfig):
    """As :func:`~megatron_ext.megatron.optimizer_factories.layerwise_factory` builds it, with
    small buckets: Muon on the matrices, the AdamW-routed rest element-sharded beside them."""

    def factory(named):
        hp = hyperparameters(recipe_opt)
        adamw = [(n, p) for n, p in named if route_parameter(n, tuple(p.shape)) == "adamw"]
        matrices = [(n, p) for n, p in named if route_parameter(n, tuple(p.shape)) != "adamw"]
        return LayerwiseDomains(
            [
                LayerwiseOptimizer(matrices, "muon", make_allgather_v(group), hp),
                ShardedAdamW(
                    adamw,
                    lambda groups: build_optimizer("adamw", groups, hp["adamw"]),
                    make_allgather_v(group),
                    bucket_numel=1500,
                ),
            ]
        )

    return factory


def main(out: str) -> None:
    torch.set_num_threads(1)
    parallel = ParallelConfig()
    init_distributed(parallel, seed=7, master_port=int(os.environ.get("MASTER_PORT", 29501)))
    cfg = ModelConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        vocab_size=VOCAB,
        make_vocab_size_divisible_by=1,
    )
    module, model = build(DistributedDataParallel, cfg, parallel)
    sh_module, sh_model = build(DistributedDataParallel, cfg, parallel)
    ref_module, ref_model = build(McDDP, cfg, parallel)
    events: list = []
    recipe_opt = OptimizerConfig(name="muon", lr=1e-2)
    group = parallel_state.get_data_parallel_group()

    def factory(named):
        gather = make_allgather_v(group)
        hp = hyperparameters(recipe_opt)
        return LayerwiseOptimizer(named, "muon", gather, hp, bucket_numel=1500, events=events)

    mc_config = megatron_optimizer_config(recipe_opt, False)
    opt = MegatronExtOptimizer(list(module.named_parameters()), factory, mc_config)
    assert opt.take_over_grad_sync(model)
    lw = opt.optimizer
    sync = lw.grad_sync
    sh_opt = MegatronExtOptimizer(
        list(sh_module.named_parameters()), sharded_factory(group, recipe_opt), mc_config
    )
    assert sh_opt.take_over_grad_sync(sh_model)
    adam = next(p for p in sh_opt.optimizer.parts if isinstance(p, ShardedAdamW))
    sh_sync = adam.grad_sync
    sh_events: list = []
    sh_sync.events = sh_events
    for m, log in ((module, events), (sh_module, sh_events)):
        embedding = m.embedding.word_embeddings.weight
        embedding.register_post_accumulate_grad_hook(
            lambda _p, log=log: log.append(("backward_end", -1))
        )

    # The syncs' own code (the hooks' grad_ready, finish) runs under the dispatch counter, and
    # the collectives it calls are counted (not the model's own, e.g. the loss's TP all-reduce).
    Watched.install()
    watch, sh_watch = Watched(sync), Watched(sh_sync)

    gen = torch.Generator().manual_seed(0)
    world, rank = dist.get_world_size(), dist.get_rank()
    pointers, sh_pointers, equal_to_mcore, sh_equal = [], [], None, None
    calls, sh_calls = [], []
    ddp_buffer = model.buffers[0].grad_data
    for step in range(STEPS):
        tokens = torch.randint(0, VOCAB, (BATCH * world, SEQ + 1), generator=gen)
        mine = tokens[rank * BATCH : (rank + 1) * BATCH]
        position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
        for m, o, w, log in ((model, opt, watch, events), (sh_model, sh_opt, sh_watch, sh_events)):
            m.zero_grad_buffer()
            o.zero_grad()
            w.clear()
            log.append(("step", step))
            m(mine[:, :-1], position_ids, None, labels=mine[:, 1:]).mean().backward()
            m.finish_grad_sync()
        calls.append(dict(watch.calls))
        sh_calls.append(dict(sh_watch.calls))
        if step == 0:
            ref_model.zero_grad_buffer()
            ref_model(mine[:, :-1], position_ids, None, labels=mine[:, 1:]).mean().backward()
            ref_model.finish_grad_sync()
            ref = dict(ref_module.named_parameters())
            equal_to_mcore = {
                n: torch.equal(p.main_grad, ref[n].main_grad)
                for n, p in module.named_parameters()
                if lw.holds(n)
            }
            sh_equal = {}
            for n, p in sh_module.named_parameters():
                lo, hi = adam.flat_range(n) if n in adam.masters else (0, p.numel())
                if sh_opt.optimizer.holds(n):
                    want = ref[n].main_grad.reshape(-1)[lo:hi]
                    sh_equal[n] = torch.equal(p.main_grad.reshape(-1)[lo:hi], want)
        for o in (opt, sh_opt):
            o.step()
            o.finish_param_sync()
        pointers.append(
            {
                "storage": sync.storage.data_ptr(),
                "recv": [b.recv.data_ptr() for b in sync.buckets if b.recv is not None],
                "replicated_recv": (
                    sync._replicated_recv.data_ptr() if sync._replicated_recv is not None else 0
                ),
                "gather": [b.buffer.data_ptr() for b in lw.buckets if b.buffer is not None],
                "main_grad": [p.main_grad.data_ptr() for p in module.parameters()],
                "params": [p.data_ptr() for p in module.parameters()],
            }
        )
        sh_pointers.append(
            {
                "recv": [b.recv.data_ptr() for b in sh_sync.buckets if b.recv is not None],
                "gather": [b.buffer.data_ptr() for b in adam.buckets if b.buffer is not None],
                "main_grad": [p.main_grad.data_ptr() for p in sh_module.parameters()],
                "params": [p.data_ptr() for p in sh_module.parameters()],
            }
        )
    start, end = ddp_buffer.data_ptr(), ddp_buffer.data_ptr() + 4 * ddp_buffer.numel()
    in_bucket = [
        b.buffer is not None
        and b.buffer.data_ptr() <= p.data_ptr() < b.buffer.data_ptr() + 4 * b.buffer.numel()
        for b in lw.buckets
        for _, p in b.order
    ]
    sh_in_bucket = [
        b.buffer is not None
        and b.buffer.data_ptr() <= p.data_ptr() < b.buffer.data_ptr() + 4 * b.buffer.numel()
        for b in adam.buckets
        for _, p in b.params
    ]
    sh_buffer = sh_model.buffers[0].grad_data
    sh_start, sh_end = sh_buffer.data_ptr(), sh_buffer.data_ptr() + 4 * sh_buffer.numel()
    result = {
        "world": world,
        "buckets": len(sync.buckets),
        "replicated": len(sync.replicated),
        "events": events,
        "pointers": pointers,
        "inside_ddp": sync.storage.data_ptr() == start
        and all(start <= p.main_grad.data_ptr() < end for p in module.parameters()),
        "calls": calls,
        "ops": dict(watch.counter.ops),
        "allocations": watch.counter.allocations,
        "equal_to_mcore": equal_to_mcore,
        "recv_buffers": sum(b.recv is not None for b in sync.buckets),
        "params_in_buckets": in_bucket,
        "sharded": {
            "buckets": len(sh_sync.buckets),
            "names": len(adam.masters),
            "events": sh_events,
            "pointers": sh_pointers,
            "inside_ddp": all(
                sh_start <= p.main_grad.data_ptr() < sh_end for p in sh_module.parameters()
            ),
            "calls": sh_calls,
            "ops": dict(sh_watch.counter.ops),
            "allocations": sh_watch.counter.allocations,
            "equal_to_mcore": sh_equal,
            "recv_buffers": sum(b.recv is not None for b in sh_sync.buckets),
            "params_in_buckets": sh_in_bucket,
        },
    }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(result, f)
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
