"""One SPSA update of one or more experts (the inner step of the SOMA trainer).

Per accumulation batch ``a`` and expert ``e`` (all counters are part of the keys, so nothing
random is stored), the shared zero-order step (:func:`megatron_ext.zo.step.spsa_accumulated`)
runs on:

1. ``tokens = sample_batch(shard_e.train, key=(seed, e+1, update, a))``  — (B, T+1) bytes;
2. ``z_j = probe_matrix(seed, e+1, update, a, j)`` for this rank's directions ``j``;
3. the loss of all ``2·|j|`` perturbed bodies ``θ ± ε z_j`` in ONE batched forward on the
   shared batch;

where DDPP splits the ``A·n_pert`` (batch, direction) units over the ranks (a rank draws and
scores only the batches it holds directions of), gathers the differences (scalars only) and returns
``ĝ_a = (1/n)·Σ_j d_j/(2ε)·z_j`` (``summed`` mode: ``d_j`` is the sum over the rank's experts of
their differences along the joint probe ``(z_{e,j})_e``). Then ``ĝ = mean_a ĝ_a`` goes through
Adam with coupled weight decay. Expert id ``e+1`` in the keys leaves 0 for the seed run
(``e = -1``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from megatron_ext.errors import TrainingDivergedError
from megatron_ext.soma.data import ExpertShard, sample_batch
from megatron_ext.soma.layout import BodyLayout
from megatron_ext.soma.model import batched_loss, body_hidden, head_gradient
from megatron_ext.soma.recipe import SomaConfig
from megatron_ext.soma.state import SEED_EXPERT, ExpertState
from megatron_ext.zo.directions import DirectionSplit
from megatron_ext.zo.probes import probe_matrix
from megatron_ext.zo.spsa import ZOAdam
from megatron_ext.zo.step import SPSABody, spsa_accumulated


@dataclass
class UpdateContext:
    """What every update reads and nothing writes (except ``emb`` during the seed run).

    ``windows``: (n, window_bytes) uint8 corpus windows; ``emb``: (256, d_embed) tied E;
    ``split``: over the ``n_pert·accumulation`` (batch, direction) units of one update.
    """

    cfg: SomaConfig
    layout: BodyLayout
    emb: torch.Tensor
    windows: np.ndarray
    seed: int
    split: DirectionSplit


def key_id(expert: int) -> int:
    """Expert id used in probe/data keys: the seed run (-1) is 0, expert e is e + 1."""
    return expert + 1


def _batch(ctx: UpdateContext, shard: ExpertShard, expert: int, update: int, a: int):
    c = ctx.cfg
    key = (ctx.seed, key_id(expert), update, a)
    return sample_batch(ctx.windows, shard.train, c.batch_size, c.seq_length, key)


def _body(ctx: UpdateContext, state: ExpertState, shard: ExpertShard, a: int) -> SPSABody:
    """Expert ``state``'s part of accumulation batch ``a`` of its next update. The batch is
    drawn when first scored: under DDPP a rank that holds none of batch ``a``'s directions
    never draws it."""
    update, n = state.update, ctx.layout.spsa_numel
    tokens: list[torch.Tensor] = []
    gains = ctx.layout.gain_mask[:n]
    # A wide expert's head (the suffix) is never perturbed: every perturbed copy carries it.
    head = state.theta[n:]

    def probes(directions: range) -> torch.Tensor:
        return probe_matrix(ctx.seed, key_id(state.expert), update, a, directions, gains)

    def loss(thetas: torch.Tensor) -> torch.Tensor:
        if not tokens:
            tokens.append(_batch(ctx, shard, state.expert, update, a))
        if head.numel():
            thetas = torch.cat([thetas, head.expand(thetas.shape[0], -1)], dim=1)
        return batched_loss(thetas, ctx.emb, tokens[0], ctx.layout)

    return SPSABody(state.theta[:n], state.plateau.eps, probes, loss)


def spsa_update(
    ctx: UpdateContext, states: Sequence[ExpertState], shards: Sequence[ExpertShard]
) -> list[float]:
    """Advance every expert in ``states`` by one update; return their mean perturbed losses
    (≈ the training loss at θ, to second order in ε), nats/byte. Raises
    :class:`TrainingDivergedError` before any state changes when a loss difference is not
    finite."""
    c = ctx.cfg
    if ctx.split.n_pert != c.n_pert * c.accumulation:
        raise ValueError(
            f"ctx.split covers {ctx.split.n_pert} units, not the n_pert·A = "
            f"{c.n_pert * c.accumulation} (batch, direction) units of an update"
        )
    batches = [
        [_body(ctx, st, shard, a) for st, shard in zip(states, shards, strict=True)]
        for a in range(c.accumulation)
    ]
    results = spsa_accumulated(batches, ctx.split, summed=c.loss_mode == "summed")
    for state, result in zip(states, results, strict=True):
        if not bool(torch.isfinite(result.diffs).all()):
            name = "seed run" if state.expert == SEED_EXPERT else f"expert {state.expert}"
            raise TrainingDivergedError(
                f"{name}, update {state.update + 1}: the SPSA loss differences are not "
                f"finite (mean perturbed loss {result.mean_loss}); stopping without "
                "checkpointing this state. Lower soma.lr or soma.eps, or resume from the "
                "last checkpoint (checkpoint.load=auto)",
                # a split estimate is gathered: every rank sees the same differences
                on_every_rank=ctx.split.world > 1,
            )
    grads = [r.grad for r in results]
    mean_losses = [r.mean_loss for r in results]
    n = ctx.layout.spsa_numel
    for state, g in zip(states, grads, strict=True):
        state.adam.step(state.theta[:n], g, state.plateau.lr, c.weight_decay)
        state.update += 1
    return mean_losses


def head_update(
    ctx: UpdateContext,
    state: ExpertState,
    shard: ExpertShard,
    head_adam: ZOAdam,
    update: int,
) -> None:
    """One Adam step of the decoder with the exact decoder-path gradient (paper: App. E, Eq. 7)
    ``∇_W = (1/BT)·Σ (p − onehot(y))·hᵀ`` at the unperturbed body, hidden states held fixed
    (nothing flows back through the LSTM or the input side of the tied matrix). ``W`` is the
    shared tied E (``ctx.emb``, seed run of a narrow body) or a wide expert's own head (the
    suffix of ``state.theta``; seed run and every expert, never shared). Uses the batches of
    the body's update ``update``; no weight decay (the paper's coupled decay is the SPSA
    body's, App. E)."""
    c, layout = ctx.cfg, ctx.layout
    table = layout.views(state.theta[None])["head"][0] if layout.shape.wide else ctx.emb
    grad = torch.zeros_like(table)
    for a in range(c.accumulation):
        tokens = _batch(ctx, shard, state.expert, update, a)
        hidden = body_hidden(state.theta[None], ctx.emb, tokens[:, :-1], layout)[0]
        grad += head_gradient(hidden, table, tokens[:, 1:])
    grad /= c.accumulation
    head_adam.step(table.view(-1), grad.view(-1), c.head_lr, 0.0)


def validation_loss(ctx: UpdateContext, theta: torch.Tensor, shard: ExpertShard) -> float:
    """Mean next-byte loss (nats/byte) of the unperturbed body over the first
    ``cfg.val_windows`` validation windows of the shard (whole windows, state reset per window)."""
    idx = shard.val[: ctx.cfg.val_windows]
    tokens = torch.from_numpy(ctx.windows[idx].astype(np.int64))
    return float(batched_loss(theta[None], ctx.emb, tokens, ctx.layout)[0])
