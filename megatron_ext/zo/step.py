"""The whole SPSA step, for one body or several side by side: perturb -> batched losses ->
differences (gathered over the ranks that split the directions) -> estimate.

A trainer describes each body by an :class:`SPSABody` (its flat parameters, its ε, how to
regenerate its probes and how to score a batch of perturbed copies) and calls
:func:`spsa_step`; it never assembles the primitives of :mod:`megatron_ext.zo.spsa` itself. SOMA
trains its experts with it, and DiPaCo's zero-order option is meant to call the same function.

Per body, with ``J`` this rank's directions (:class:`~megatron_ext.zo.directions.DirectionSplit`)::

    Z_J      = probes(J)                                  # (|J|, n)
    losses   = loss(perturb(θ, Z_J, ε))                   # (2|J|,), one batched forward
    d        = gather(loss_differences(losses))           # (n_pert,), scalars only
    ĝ        = spsa_estimate(d, probes(all), ε)           # (n,); the local probes when J = all

``summed=True`` estimates every body from the sum of their differences, ``d = Σ_b d_b`` (the
finite difference of the summed loss along the joint probe (z_1, ..., z_B)).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from megatron_ext.zo.directions import DirectionSplit
from megatron_ext.zo.spsa import loss_differences, perturb, spsa_estimate

__all__ = ["SPSABody", "SPSAResult", "spsa_accumulated", "spsa_step"]


@dataclass(frozen=True)
class SPSABody:
    """One body's part of an SPSA step.

    ``theta``: (n,) parameters. ``eps``: the perturbation size. ``probes(directions)``: the
    (len(directions), n) probe rows of this step, regenerated from their counter-based keys.
    ``loss(thetas)``: (2k, n) perturbed bodies -> (2k,) losses on this step's batch.
    """

    theta: torch.Tensor
    eps: float
    probes: Callable[[range], torch.Tensor]
    loss: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class SPSAResult:
    """``grad``: (n,) the estimate ĝ. ``diffs``: (n_pert,) the loss differences it was built
    from (after gathering, and summing when ``summed``). ``mean_loss``: the mean of this rank's
    perturbed losses (≈ the loss at θ to second order in ε; NaN when it holds no direction)."""

    grad: torch.Tensor
    diffs: torch.Tensor
    mean_loss: float


def spsa_step(
    bodies: Sequence[SPSABody], split: DirectionSplit, *, summed: bool = False
) -> list[SPSAResult]:
    """One SPSA estimate per body (see the module docstring). With ``split.world > 1`` every
    rank calls this with the same bodies in the same order (one all-gather per body)."""
    local, every = split.local(), range(split.n_pert)
    diffs, probes, means = [], [], []
    for body in bodies:
        z = body.probes(local)
        if len(z) == 0:
            part, mean = torch.zeros(0), math.nan
        else:
            losses = body.loss(perturb(body.theta, z, body.eps))
            part, mean = loss_differences(losses), float(losses.mean())
        diffs.append(split.gather(part))
        # One rank holding every direction reuses its probes; a split regenerates the others.
        probes.append(z if local == every else body.probes(every))
        means.append(mean)
    if summed:
        total = torch.stack(diffs).sum(0)
        diffs = [total for _ in bodies]
    return [
        SPSAResult(spsa_estimate(d, z, body.eps), d, mean)
        for body, d, z, mean in zip(bodies, diffs, probes, means, strict=True)
    ]


def spsa_accumulated(
    batches: Sequence[Sequence[SPSABody]], split: DirectionSplit, *, summed: bool = False
) -> list[SPSAResult]:
    """One update's estimate per body averaged over ``A = len(batches)`` accumulation batches,
    with DDPP splitting batches AND directions (paper: App. H.2, "DDPP splits batches and
    perturbations across devices").

    ``batches[a][b]``: body ``b``'s :class:`SPSABody` on accumulation batch ``a`` (its loss
    scores batch ``a``, its probes are batch ``a``'s). ``split`` is over the ``A·n_pert`` work
    units ``u = a·n_pert + j`` (``split.n_pert == A·n_pert``): a rank evaluates only its block
    of units, so a rank that holds no direction of batch ``a`` never builds or scores batch
    ``a``; one all-gather per body then gives every rank all ``A·n_pert`` differences, and every
    rank rebuilds ``ĝ_b = (1/A)·Σ_a ĝ_{a,b}`` from them and the regenerated probes. With one
    rank this is :func:`spsa_step` on each batch, averaged: the same bits.

    Returns per body: the averaged estimate, its (A·n_pert,) differences, and the mean of this
    rank's perturbed losses (NaN when it holds no unit)."""
    n_batches = len(batches)
    if n_batches == 0 or split.n_pert % n_batches:
        raise ValueError(f"split over {split.n_pert} units does not fit {n_batches} batches")
    n_pert, n_bodies = split.n_pert // n_batches, len(batches[0])
    local, every = split.local(), range(n_pert)
    # this rank's directions of each batch (empty: batch a is another rank's)
    mine = []
    for a in range(n_batches):
        lo, hi = max(local.start - a * n_pert, 0), min(local.stop - a * n_pert, n_pert)
        mine.append(range(lo, max(lo, hi)))
    held = sum(1 for m in mine if len(m))
    means = [0.0 if held else math.nan] * n_bodies
    parts: list[list[torch.Tensor]] = [[] for _ in range(n_bodies)]
    probes: list[list[torch.Tensor | None]] = [[None] * n_bodies for _ in range(n_batches)]
    for a, bodies in enumerate(batches):
        if len(mine[a]) == 0:
            continue  # not built, not scored on this rank
        for b, body in enumerate(bodies):
            z = body.probes(mine[a])
            losses = body.loss(perturb(body.theta, z, body.eps))
            parts[b].append(loss_differences(losses))
            means[b] += float(losses.mean()) / held
            if mine[a] == every:
                probes[a][b] = z  # a whole batch held here: its probes are reused
    diffs = []
    for b in range(n_bodies):
        local_diffs = torch.cat(parts[b]) if parts[b] else torch.zeros(0)
        diffs.append(split.gather(local_diffs))
    if summed:
        total = torch.stack(diffs).sum(0)
        diffs = [total for _ in range(n_bodies)]
    results = []
    for b in range(n_bodies):
        grad = torch.zeros_like(batches[0][b].theta)
        for a, bodies in enumerate(batches):
            body, z = bodies[b], probes[a][b]
            z = body.probes(every) if z is None else z
            grad += spsa_estimate(diffs[b][a * n_pert : (a + 1) * n_pert], z, body.eps)
        results.append(SPSAResult(grad / n_batches, diffs[b], means[b]))
    return results
