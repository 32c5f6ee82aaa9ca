"""The shared SPSA step (zo.step) against what SOMA's update computed before it existed.

The reference below is the SOMA update as it was written before the step moved into the
zero-order core (soma/update.py, commit 57e001a): the primitives assembled by hand. The SOMA
update built on ``spsa_step`` must give the same bodies bit for bit, in both loss modes, with
accumulation; and the step's own result (estimate, differences, mean loss) must match the
primitives. A one-rank split exercises the probe reuse; the split over ranks (probes
regenerated) is covered end to end by the DDPP test in test_soma_trainer.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_ext.soma.data import ExpertShard, sample_batch
from megatron_ext.soma.layout import BodyLayout, ExpertShape, init_body, init_embedding
from megatron_ext.soma.model import batched_loss
from megatron_ext.soma.recipe import SomaConfig
from megatron_ext.soma.state import ExpertState
from megatron_ext.soma.update import UpdateContext, key_id, spsa_update
from megatron_ext.zo.directions import DirectionSplit
from megatron_ext.zo.probes import probe_matrix
from megatron_ext.zo.spsa import PlateauHalving, ZOAdam, loss_differences, perturb, spsa_estimate
from megatron_ext.zo.step import SPSABody, spsa_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_update(ctx: UpdateContext, states: list[ExpertState], shards: list[ExpertShard]):
    """SOMA's spsa_update before zo.step (one rank, every direction local)."""
    c = ctx.cfg
    grads = [torch.zeros_like(s.theta) for s in states]
    mean_losses = [0.0 for _ in states]
    local = range(c.n_pert)
    for a in range(c.accumulation):
        diffs, probes = [], []
        for i, (state, shard) in enumerate(zip(states, shards, strict=True)):
            key = (ctx.seed, key_id(state.expert), state.update, a)
            tokens = sample_batch(ctx.windows, shard.train, c.batch_size, c.seq_length, key)
            z = probe_matrix(
                ctx.seed, key_id(state.expert), state.update, a, local, ctx.layout.gain_mask
            )
            losses = batched_loss(
                perturb(state.theta, z, state.plateau.eps), ctx.emb, tokens, ctx.layout
            )
            diffs.append(loss_differences(losses))
            probes.append(z)
            mean_losses[i] += float(losses.mean()) / c.accumulation
        if c.loss_mode == "summed":
            total = torch.stack(diffs).sum(0)
            diffs = [total for _ in states]
        for i, state in enumerate(states):
            grads[i] += spsa_estimate(diffs[i], probes[i], state.plateau.eps)
    for state, g in zip(states, grads, strict=True):
        g /= c.accumulation
        state.adam.step(state.theta, g, state.plateau.lr, c.weight_decay)
        state.update += 1
    return mean_losses


def make(loss_mode: str) -> tuple[UpdateContext, list[ExpertState], list[ExpertShard]]:
    cfg = SomaConfig(
        d_embed=8, d_model=8, num_blocks=1, n_pert=5, batch_size=3, seq_length=16,
        accumulation=2, loss_mode=loss_mode, weight_decay=0.01,
    )  # fmt: skip
    shape = ExpertShape(d_embed=8, d_model=8, num_blocks=1)
    gen = torch.Generator().manual_seed(3)
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 256, size=(12, 33), dtype=np.uint8)
    ctx = UpdateContext(
        cfg=cfg,
        layout=BodyLayout.from_shape(shape),
        emb=init_embedding(shape, gen),
        windows=windows,
        seed=11,
        split=DirectionSplit(cfg.n_pert * cfg.accumulation),
    )
    states, shards = [], []
    for e, eps in ((0, 1e-2), (1, 3e-3)):  # different ε per expert, as after plateau halvings
        theta = init_body(shape, gen)
        states.append(ExpertState(e, theta, ZOAdam(theta.numel()), PlateauHalving(eps=eps)))
        shards.append(ExpertShard(e, np.arange(e, 12, 2), np.array([], dtype=np.int64)))
    return ctx, states, shards


@pytest.mark.parametrize("loss_mode", ["independent", "summed"])
def test_soma_update_on_the_shared_step_equals_the_old_update_bit_for_bit(loss_mode):
    ctx, new, shards = make(loss_mode)
    _, old, _ = make(loss_mode)
    for _ in range(3):
        new_losses = spsa_update(ctx, new, shards)
        old_losses = reference_update(ctx, old, shards)
        assert new_losses == old_losses
    for a, b in zip(new, old, strict=True):
        assert a.update == b.update == 3
        assert torch.equal(a.theta, b.theta)
        assert torch.equal(a.adam.m, b.adam.m) and torch.equal(a.adam.v, b.adam.v)


def test_spsa_step_is_perturb_losses_differences_estimate():
    """On a quadratic: the step's estimate, differences and mean loss are the primitives'."""
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(6, generator=gen)
    thetas = [torch.randn(6, generator=gen) for _ in range(2)]
    z_all = [torch.randn(4, 6, generator=gen) for _ in range(2)]

    def body(theta: torch.Tensor, z: torch.Tensor, eps: float) -> SPSABody:
        return SPSABody(theta, eps, lambda d: z[list(d)], lambda t: ((t - target) ** 2).sum(dim=1))

    split = DirectionSplit(4)
    for summed in (False, True):
        results = spsa_step(
            [body(thetas[0], z_all[0], 0.1), body(thetas[1], z_all[1], 0.01)], split, summed=summed
        )
        diffs = []
        for theta, z, eps in zip(thetas, z_all, (0.1, 0.01), strict=True):
            losses = ((perturb(theta, z, eps) - target) ** 2).sum(dim=1)
            diffs.append(loss_differences(losses))
        if summed:
            diffs = [diffs[0] + diffs[1]] * 2
        for r, d, z, eps, theta in zip(results, diffs, z_all, (0.1, 0.01), thetas, strict=True):
            assert torch.equal(r.diffs, d)
            assert torch.equal(r.grad, spsa_estimate(d, z, eps))
            losses = ((perturb(theta, z, eps) - target) ** 2).sum(dim=1)
            assert r.mean_loss == float(losses.mean())
        # the quadratic's gradient 2(θ - t): central differences are exact for it, so each
        # estimate is the probe-projected gradient (1/k) Σ z_j z_jᵀ ∇
        if not summed:
            for r, theta, z in zip(results, thetas, z_all, strict=True):
                zd = z.double()
                expected = (zd.T @ (zd @ (2 * (theta - target).double()))) / 4
                assert torch.allclose(r.grad.double(), expected, rtol=1e-4, atol=1e-4)
