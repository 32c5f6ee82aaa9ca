"""Run under torchrun (gloo, all ranks one TP group): matrix optimizers on tensor-parallel shards.

Every rank cuts the same full matrices and gradients into its shards (as megatron-core would hold
them), marks them with megatron's ``tensor_model_parallel``, ``partition_dim`` and
``partition_stride`` attributes, and steps each configuration of :data:`CONFIGS` for
:data:`STEPS` steps. Rank r writes its shards to ``OUT_DIR/rank{r}.pt`` as
``{config: {name: shard}}``, and the number of collectives each
configuration issued under ``{"collectives": {config: {"all_gather": n, "all_reduce": n}}}``;
the test compares them with single-process runs (TP=1 on the full matrices; per-shard runs for
``blockwise``).

Usage: tp_modes.py OUT_DIR
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_ext.optimizers import MOP, KLSoap, Muon, QKVLayout
from tests.dist.ending import leave

STEPS = 3


@dataclass(frozen=True)
class Matrix:
    """A TP-split weight: full shape and megatron's ``partition_dim``/``partition_stride``.

    Shard r is block r along partition_dim; with stride s, the parts r of the s blocks of the
    weight (SwiGLU fc1, s = 2: TP=1 rows are ``[gate; up]``, shard r is ``[gate_r; up_r]``).
    The fused QKV (groups outermost) is a plain row split: each rank holds whole query groups.
    """

    name: str
    shape: tuple[int, ...]
    partition_dim: int
    stride: int = 1


# Full layout: 4 query groups of 2 heads, 4 channels per head -> 64 rows; each of 2 ranks holds 2.
QKV_FULL = QKVLayout(num_query_groups=4, heads_per_group=2, kv_channels=4)


def qkv_layout(world: int) -> QKVLayout:
    """The per-rank fused-QKV layout at TP size ``world``."""
    return QKVLayout(
        QKV_FULL.num_query_groups // world, QKV_FULL.heads_per_group, QKV_FULL.kv_channels
    )


MATRICES = [
    # column-parallel SwiGLU fc1, tall: split along its long side (rows), [gate_r; up_r] per rank
    Matrix("mlp.linear_fc1.weight", (64, 24), 0, stride=2),
    # row-parallel fc2, wide: split along its long side (columns)
    Matrix("mlp.linear_fc2.weight", (24, 64), 1),
    # row-parallel, shard 40×24 is tall while the full 40×48 is wide
    Matrix("self_attention.linear_proj.weight", (40, 48), 1),
    # split along the short side (the N×N Gram in distributed mode); both land in one batch
    Matrix("kv_like.weight", (16, 48), 0),
    Matrix("narrow.weight", (48, 16), 1),
    # expert stacks (E, m, n): fc1 split along rows, fc2 along columns
    Matrix("experts.linear_fc1.weight", (3, 32, 24), 1),
    Matrix("experts.linear_fc2.weight", (3, 24, 32), 2),
    # fused QKV (Muon/MOP: Q, K and V separately via qkv_layout; KL-SOAP: one matrix)
    Matrix("self_attention.linear_qkv.weight", (QKV_FULL.rows, 32), 0),
]

#: name -> (optimizer class, hyperparameters, tp_mode)
CONFIGS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any], str]] = {}
for _coeffs in ("quintic", "polar_express"):
    for _mode in ("blockwise", "duplicated", "distributed"):
        CONFIGS[f"muon_{_coeffs}_{_mode}"] = (
            Muon,
            {"lr": 0.02, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1,
             "coefficients": _coeffs},
            _mode,
        )  # fmt: skip
# KL-SOAP with damping (as in test_optim_kl_soap): at the default Adam ε = 1e-8 its first steps
# are sign(G') with G' = Q_Lᵀ G Q_R diagonal up to rounding, so the update is set by rounding
# noise and even TP=1 differs by O(1) under a 1e-7 perturbation of the gradient or a row
# permutation (measured 1.1 to 16 relative); a test could then not tell equivalence from chance.
KL_SOAP = {"lr": 3e-3, "weight_decay": 0.1, "shampoo_beta": 0.7, "eps": 1e-3, "factor_eps": 1e-2}
for _mode in ("blockwise", "duplicated"):
    CONFIGS[f"kl_soap_{_mode}"] = (KLSoap, KL_SOAP, _mode)
    CONFIGS[f"mop_{_mode}"] = (MOP, {"lr": 0.02, "momentum": 0.9, "weight_decay": 0.1}, _mode)


def full_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {m.name: torch.randn(m.shape, generator=gen) * 0.1 for m in MATRICES}


def full_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {m.name: torch.randn(m.shape, generator=gen) for m in MATRICES}


def shard(matrix: Matrix, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` as megatron-core holds it at TP size ``world``."""
    dim = matrix.partition_dim
    blocks = full.chunk(matrix.stride, dim=dim)
    return torch.cat([block.chunk(world, dim=dim)[rank] for block in blocks], dim=dim)


def build(
    config: str,
    params: dict[str, torch.nn.Parameter],
    layout: QKVLayout,
    tp_shards: dict[torch.Tensor, Any] | None = None,
    tp_mode: str | None = None,
) -> torch.optim.Optimizer:
    """The optimizer of ``config`` over ``params`` (fused QKV in its own group for Muon/MOP)."""
    cls, hyper, mode = CONFIGS[config]
    hyper = dict(hyper)
    if tp_shards is not None:
        hyper.update(tp_shards=tp_shards, tp_mode=tp_mode or mode)
    qkv = "self_attention.linear_qkv.weight"
    if cls is KLSoap:
        return cls(list(params.values()), **hyper)
    groups = [
        {"params": [p for n, p in params.items() if n != qkv]},
        {"params": [params[qkv]], "qkv_layout": layout},
    ]
    return cls(groups, **hyper)


def run(
    config: str,
    params: dict[str, torch.nn.Parameter],
    grads_of_step: Any,
    layout: QKVLayout,
    **tp: Any,
) -> dict[str, torch.Tensor]:
    opt = build(config, params, layout, **tp)
    for step in range(STEPS):
        for name, g in grads_of_step(step).items():
            params[name].grad = g
        opt.step()
    return {n: p.detach().clone() for n, p in params.items()}


def count_collectives(counts: dict[str, int]) -> None:
    """Count calls of ``torch.distributed.all_gather``/``all_reduce`` into ``counts``."""
    for name in ("all_gather", "all_reduce"):
        original = getattr(torch.distributed, name)

        def counted(*args: Any, _name: str = name, _original: Any = original, **kw: Any) -> Any:
            counts[_name] += 1
            return _original(*args, **kw)

        setattr(torch.distributed, name, counted)


def main(out_dir: str) -> None:
    torch.distributed.init_process_group("gloo")
    torch.set_num_threads(1)
    from megatron_ext.distributed.tensor_parallel import shard_infos_from_attributes

    counts = {"all_gather": 0, "all_reduce": 0}
    count_collectives(counts)
    collectives = {}

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    by_name = {m.name: m for m in MATRICES}

    def local(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: shard(by_name[n], t, rank, world) for n, t in full.items()}

    results = {}
    for config in CONFIGS:
        params = {n: torch.nn.Parameter(t) for n, t in local(full_weights()).items()}
        for name, p in params.items():  # what megatron-core sets on sharded weights
            p.tensor_model_parallel = True
            p.partition_dim = by_name[name].partition_dim
            p.partition_stride = by_name[name].stride
        tp_shards = shard_infos_from_attributes(params.values())
        assert len(tp_shards) == len(params)
        assert all(i.rank == rank and i.world_size == world for i in tp_shards.values())
        before = dict(counts)
        results[config] = run(
            config, params, lambda s: local(full_grads(s)), qkv_layout(world), tp_shards=tp_shards
        )
        collectives[config] = {k: counts[k] - before[k] for k in counts}
    torch.save({**results, "collectives": collectives}, Path(out_dir) / f"rank{rank}.pt")
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
