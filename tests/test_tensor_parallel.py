"""Tensor-parallel modes of Muon, MOP and KL-SOAP: TP=2 on gloo against single-process runs.

* ``duplicated``: each TP=2 shard is, bit for bit, the matching block of a TP=1 run on the full
  matrices (the same arithmetic on the same numbers), SwiGLU fc1 (``partition_stride=2``) and
  the fused QKV included.
* ``distributed`` (Muon): the shards match the TP=1 run to fp32 rounding (:data:`TP1_TOL`).
* ``blockwise``: equal, bit for bit, to the single-process optimizer run on each shard alone,
  and measurably different from TP=1 (it is a different algorithm).
* In one process, float64: the distributed Newton–Schulz algebra (the all-reduce simulated by
  summing the shards' products) against the reference NS of the full matrix; and why SwiGLU's
  rank-order concatenation (a row permutation of the TP=1 weight) must be put back into the
  TP=1 layout: NS is row-permutation-equivariant, KL-SOAP on a rectangular matrix is not.
"""

from __future__ import annotations

import pytest
import torch

from megatron_ext.optimizers import (
    MOP,
    KLSoap,
    KLSoapConfig,
    KLSoapMatrices,
    Muon,
    QKVLayout,
    kl_soap_direction,
    resolve_coefficients,
)
from megatron_ext.optimizers.ns_iteration import newton_schulz_iterate
from megatron_ext.optimizers.tensor_parallel import TPShardInfo, orthogonalize_distributed
from tests.conftest import DIST, run_torchrun
from tests.dist.tp_modes import (
    CONFIGS,
    MATRICES,
    QKV_FULL,
    STEPS,
    Matrix,
    full_grads,
    full_weights,
    qkv_layout,
    run,
    shard,
)

from .optim_reference import ns_reference

WORLD = 2
#: Largest relative Frobenius error of a shard's total update (``distributed``) against TP=1.
#: The Grams are summed in another order; measured worst case 2.3e-6 (polar_express); 1e-5
#: leaves room for other BLAS builds.
TP1_TOL = 1e-5
#: blockwise must be at least this far from TP=1.
BLOCKWISE_MIN_DIFF = 0.05


def rel_err(got: torch.Tensor, want: torch.Tensor, start: torch.Tensor) -> float:
    """Relative Frobenius error of the update ``got − start`` against ``want − start``."""
    du_got, du_want = got.double() - start.double(), want.double() - start.double()
    return (torch.linalg.norm(du_got - du_want) / torch.linalg.norm(du_want)).item()


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory) -> list[dict[str, dict[str, torch.Tensor]]]:
    out = tmp_path_factory.mktemp("tp_modes")
    run_torchrun(DIST / "tp_modes.py", WORLD, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _params(weights: dict[str, torch.Tensor]) -> dict[str, torch.nn.Parameter]:
    return {n: torch.nn.Parameter(t.clone()) for n, t in weights.items()}


def tp1_run(config: str) -> dict[str, torch.Tensor]:
    """The single-process optimizer on the full matrices (one thread, like each rank)."""
    torch.set_num_threads(1)
    return run(config, _params(full_weights()), full_grads, QKV_FULL)


def local(weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    by_name = {m.name: m for m in MATRICES}
    return {n: shard(by_name[n], t, rank, WORLD) for n, t in weights.items()}


def per_shard_run(config: str, rank: int) -> dict[str, torch.Tensor]:
    """The single-process optimizer (no TP information) on rank ``rank``'s shards."""
    torch.set_num_threads(1)
    params = _params(local(full_weights(), rank))
    return run(config, params, lambda s: local(full_grads(s), rank), qkv_layout(WORLD))


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.endswith("duplicated")])
def test_duplicated_is_tp1_bit_for_bit(tp2_results, config):
    want = tp1_run(config)
    for m in MATRICES:
        for rank in range(WORLD):
            got = tp2_results[rank][config][m.name]
            assert torch.equal(got, shard(m, want[m.name], rank, WORLD)), (m.name, rank)


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.endswith("distributed")])
def test_distributed_equals_tp1(tp2_results, config):
    want_full, start_full = tp1_run(config), full_weights()
    worst = 0.0
    for m in MATRICES:
        for rank in range(WORLD):
            want = shard(m, want_full[m.name], rank, WORLD)
            start = shard(m, start_full[m.name], rank, WORLD)
            err = rel_err(tp2_results[rank][config][m.name], want, start)
            worst = max(worst, err)
            assert err < TP1_TOL, (m.name, rank, err)
    print(f"{config}: worst relative error against TP=1: {worst:.1e}")


@pytest.mark.parametrize("config", [c for c in CONFIGS if c.endswith("blockwise")])
def test_blockwise_is_per_shard_and_not_tp1(tp2_results, config):
    want_full, start_full = tp1_run(config), full_weights()
    for rank in range(WORLD):
        alone = per_shard_run(config, rank)
        for m in MATRICES:
            got = tp2_results[rank][config][m.name]
            assert torch.equal(got, alone[m.name]), (m.name, rank)
            start = shard(m, start_full[m.name], rank, WORLD)
            diff = rel_err(got, shard(m, want_full[m.name], rank, WORLD), start)
            assert diff > BLOCKWISE_MIN_DIFF, (m.name, rank, diff)


# Stacked batches of one optimizer step, from MATRICES (shard shapes at TP=2, each turned to
# rows ≤ columns, and where its split then runs). Muon/MOP: fc1 (24×32, columns, stride 2);
# fc2 (24×32, columns); proj (24×40, rows); kv_like and narrow (8×48, rows); the six experts
# (16×24, rows); Q (16×32, rows); K and V (8×32, rows): 7 batches for 14 matrices. Muon, whose
# hook takes tall matrices as they are, gathers shards of tall parameters (narrow, experts fc2)
# apart from wide ones in duplicated mode: 9 batches. KL-SOAP batches by full shape and stride:
# 8 parameters, 8 batches.
# distributed: per batch one norm all-reduce plus one per Gram: Gram NS (chosen from the full
# shape as at TP=1: fc1 24×64, fc2 24×64) reduces R once (fp32 Gram NS does not restart by
# default); plain NS reduces 5 (proj 40×48, experts 24×32, Q 32×32, and the short-side splits
# kv_like/narrow and K/V).
DISTRIBUTED_ALL_REDUCES = 7 + 2 * 1 + 5 * 5


@pytest.mark.parametrize("config", list(CONFIGS))
def test_one_collective_per_stacked_batch(tp2_results, config):
    cls, _, mode = CONFIGS[config]
    batches = {Muon: 9 if mode == "duplicated" else 7, MOP: 7, KLSoap: 8}[cls]
    want = {
        "blockwise": {"all_gather": 0, "all_reduce": 0},
        "duplicated": {"all_gather": batches * STEPS, "all_reduce": 0},
        "distributed": {"all_gather": 0, "all_reduce": DISTRIBUTED_ALL_REDUCES * STEPS},
    }[mode]
    assert tp2_results[0]["collectives"][config] == want


# ----------------------------------------------------------------------------- row permutations
def swiglu_rank_order(rows: int) -> torch.Tensor:
    """Row indices of the TP=1 fc1 weight in the order its TP=2 shards hold them."""
    fc1 = Matrix("fc1", (rows, 1), 0, stride=2)
    full = torch.arange(rows, dtype=torch.float64)[:, None]
    return torch.cat([shard(fc1, full, r, WORLD) for r in range(WORLD)])[:, 0].long()


def test_newton_schulz_is_row_permutation_equivariant():
    """``NS(PX) = P·NS(X)``: gathering SwiGLU shards in rank order would be harmless for Muon."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(64, 24, generator=gen, dtype=torch.float64)
    perm = swiglu_rank_order(64)
    steps = resolve_coefficients("polar_express", 5)
    got, want = ns_reference(x[perm], steps), ns_reference(x, steps)[perm]
    assert (torch.linalg.norm(got - want) / torch.linalg.norm(want)).item() < 1e-12


def _kl_soap_permutation_error(m: int, n: int, steps: int) -> float:
    """Worst relative difference between KL-SOAP's direction for P·G and P· its direction for
    G over ``steps`` steps from a fresh float64 state (damped as in test_optim_kl_soap)."""
    perm = swiglu_rank_order(m)
    cfg = KLSoapConfig(shampoo_beta=0.7, eps=1e-3, factor_eps=1e-2)

    def fresh() -> KLSoapMatrices:
        s = KLSoapMatrices.zeros(1, m, n)
        return KLSoapMatrices(*(t.double() for t in vars(s).values()))

    plain, permuted = fresh(), fresh()
    gen = torch.Generator().manual_seed(5)
    worst = 0.0
    for step in range(1, steps + 1):
        g = torch.randn(1, m, n, generator=gen, dtype=torch.float64)
        want = kl_soap_direction(g.clone(), plain, cfg, step)[:, perm]
        got = kl_soap_direction(g[:, perm].clone(), permuted, cfg, step)
        worst = max(worst, (torch.linalg.norm(got - want) / torch.linalg.norm(want)).item())
    return worst


def test_kl_soap_needs_the_tp1_layout():
    """Square: both factors are full rank from step 1, and KL-SOAP is permutation-equivariant
    to float64 rounding. Tall (SwiGLU fc1's shape): the left factor starts rank-deficient, the
    basis of its null space is the solver's arbitrary choice, the QR refresh carries it on, and
    the permuted run differs by O(1) — hence duplicated gathers into the TP=1 layout using
    megatron's partition_stride instead of relying on equivariance."""
    assert _kl_soap_permutation_error(32, 32, steps=4) < 1e-8
    assert _kl_soap_permutation_error(64, 24, steps=4) > 1e-2


# ----------------------------------------------------------------------------- float64 algebra
def simulated_distributed_ns(
    full: torch.Tensor, axis: int, world: int, steps: list, gram: bool
) -> torch.Tensor:
    """:func:`orthogonalize_distributed` on the ``world`` shards of ``full`` (``(m, n)``) at once.

    The shards are stacked as one batch, rank-major; the "all-reduce" sums each matrix's
    ``world`` copies and writes the sum back to all of them, exactly what every rank would see.
    """
    shards = torch.stack(full.chunk(world, dim=axis))  # (world, m', n')

    def all_reduce(t: torch.Tensor) -> None:
        t.copy_(t.sum(dim=0, keepdim=True).expand_as(t))

    def iterate(work, reduce, full_shape):
        return newton_schulz_iterate(work, steps, gram=gram, gram_restart=(2,), gram_reduce=reduce)

    out = orthogonalize_distributed(shards, axis, world, all_reduce, iterate)
    return torch.cat(list(out), dim=axis)


@pytest.mark.parametrize("shape", [(24, 64), (64, 24), (32, 32)])
@pytest.mark.parametrize("axis", [-2, -1])
@pytest.mark.parametrize("coefficients", ["quintic", "polar_express"])
def test_distributed_newton_schulz_algebra_float64(shape, axis, coefficients):
    """Split along the long or the short side, rows or columns: every shard follows the
    iteration of the full matrix (plain NS; Gram NS where the reduced Gram is the short one)."""
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(shape, generator=gen, dtype=torch.float64)
    steps = resolve_coefficients(coefficients, 5)
    want = ns_reference(full, steps)
    world = 4
    short_split = shape[axis] == min(shape) and shape[0] != shape[1]
    for gram in (False,) if short_split else (False, True):
        got = simulated_distributed_ns(full, axis, world, steps, gram)
        err = (torch.linalg.norm(got - want) / torch.linalg.norm(want)).item()
        assert err < 1e-10, (gram, err)


# ----------------------------------------------------------------------------- validation
def _info(partition_dim: int = 0) -> TPShardInfo:
    return TPShardInfo(partition_dim, group=None, world_size=2, rank=0)


def test_unknown_tp_mode_lists_the_choices():
    p = torch.nn.Parameter(torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"tp_mode='sharded'.*blockwise.*duplicated.*distributed"):
        Muon([p], tp_mode="sharded", tp_shards={p: _info()})


@pytest.mark.parametrize("cls", [KLSoap, MOP])
def test_distributed_mode_is_refused_where_not_built(cls):
    p = torch.nn.Parameter(torch.zeros(4, 6))
    with pytest.raises(ValueError, match=r"does not support tp_mode='distributed'.*duplicated"):
        cls([p], tp_mode="distributed", tp_shards={p: _info()})


def test_partition_dim_must_split_the_matrices():
    p = torch.nn.Parameter(torch.zeros(3, 4, 6))  # dim 0 of an expert stack is the expert index
    with pytest.raises(ValueError, match="partition_dim=0 does not split"):
        Muon([p], tp_shards={p: _info(0)})
    q = torch.nn.Parameter(torch.zeros(4, 6))
    with pytest.raises(ValueError, match="partition_dim=2 does not split"):
        KLSoap([q], tp_shards={q: _info(2)})


def test_fused_qkv_must_be_row_split():
    layout = QKVLayout(2, 2, 4)
    p = torch.nn.Parameter(torch.zeros(layout.rows, 8))
    with pytest.raises(ValueError, match="split along its rows"):
        Muon([{"params": [p], "qkv_layout": layout}], tp_shards={p: _info(1)})


def test_tp_world_size_one_is_a_whole_matrix():
    """A shard map entry over one rank changes nothing (no collective is attempted)."""
    gen = torch.Generator().manual_seed(3)
    w, g = torch.randn(8, 12, generator=gen), torch.randn(8, 12, generator=gen)
    out = []
    for shards in (None, "one"):
        p = torch.nn.Parameter(w.clone())
        info = {p: TPShardInfo(0, None, 1, 0)} if shards else None
        opt = Muon([p], tp_mode="distributed", tp_shards=info)
        p.grad = g.clone()
        opt.step()
        out.append(p.detach())
    assert torch.equal(out[0], out[1])


def test_fused_qkv_holds_whole_query_groups():
    layout = QKVLayout(2, 2, 4)
    p = torch.nn.Parameter(torch.zeros(layout.rows, 8))
    strided = TPShardInfo(0, group=None, world_size=2, rank=0, partition_stride=2)
    with pytest.raises(ValueError, match="whole query groups"):
        Muon([{"params": [p], "qkv_layout": layout}], tp_shards={p: strided})


def test_partition_stride_must_divide_the_shard():
    p = torch.nn.Parameter(torch.zeros(6, 4))
    strided = TPShardInfo(0, group=None, world_size=2, rank=0, partition_stride=4)
    with pytest.raises(ValueError, match="cannot hold partition_stride=4"):
        KLSoap([p], tp_shards={p: strided})
