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

__all__ = ["SPSABody", "SPSAResult", "spsa_step"]


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
