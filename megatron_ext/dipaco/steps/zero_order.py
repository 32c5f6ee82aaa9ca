"""Zero-order inner steps (``dipaco.inner: spsa``) through the shared SPSA step of
:mod:`megatron_ext.zo` (the one SOMA trains with).

A path's parameters are one flat vector θ (GPTModel order). Step k of phase t of path p:
``dipaco.spsa_n_pert`` sparse Rademacher probes keyed by (seed, path, phase, step, direction)
(norm weights are "gains": ±1 always), the 2·n_pert perturbed losses on the step's batch, the
estimate ĝ (:func:`megatron_ext.zo.step.spsa_step`), then Adam with coupled weight decay
(:class:`megatron_ext.zo.spsa.ZOAdam`) at the inner schedule's LR. No backward pass; the Adam
moments persist across phases per path, as the gradient optimizer's state does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from megatron_ext.zo.directions import DirectionSplit
from megatron_ext.zo.probes import probe_rows
from megatron_ext.zo.spsa import ZOAdam
from megatron_ext.zo.step import SPSABody, spsa_step

from .guards import check_every_step_ran, check_finite_loss

__all__ = ["SPSAInner", "spsa_inner_steps"]

LossFn = Callable[[torch.nn.Module, Any], torch.Tensor]


class SPSAInner:
    """The zero-order inner optimizer of one path: ZOAdam over the flat parameters, probes
    keyed by (seed, path); ``n_pert`` directions of size ``eps``."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        n_pert: int,
        eps: float,
        weight_decay: float,
        betas: tuple[float, float],
        seed: int,
        path: int,
    ) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.n_pert, self.eps, self.weight_decay = n_pert, eps, weight_decay
        self.key = (seed, path)
        self.gain_mask = torch.cat([torch.full((p.numel(),), p.ndim == 1) for p in self.params])
        self.adam = ZOAdam(self.gain_mask.numel(), betas=betas, dtype=self.params[0].dtype)

    def step(self, batch: Any, loss_fn: LossFn, lr: float, phase: int, step: int) -> float:
        """One SPSA update on ``batch``; returns the mean of the perturbed losses."""
        theta = parameters_to_vector(self.params).detach().clone()

        def probes(directions: range) -> torch.Tensor:
            keys = [(*self.key, phase, step, d) for d in directions]
            return probe_rows(keys, self.gain_mask, dtype=theta.dtype)

        def losses(thetas: torch.Tensor) -> torch.Tensor:
            out = []
            with torch.no_grad():
                for row in thetas:
                    vector_to_parameters(row, self.params)
                    out.append(float(loss_fn(self.model, batch)))
            return torch.tensor(out, dtype=torch.float64)

        (result,) = spsa_step(
            [SPSABody(theta, self.eps, probes, losses)], DirectionSplit(self.n_pert)
        )
        self.adam.step(theta, result.grad.to(theta.dtype), lr, self.weight_decay)
        vector_to_parameters(theta, self.params)
        return result.mean_loss

    def state_dict(self) -> dict[str, Any]:
        return {"zo_adam": self.adam.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.adam.load_state_dict(state["zo_adam"])


def spsa_inner_steps(
    optimizer: SPSAInner,
    batches: Iterable[Any],
    lrs: Sequence[float],
    first_step: int,
    phase: int,
    loss_fn: LossFn,
    where: str = "",
) -> list[float]:
    """``len(lrs)`` SPSA updates (inner steps ``first_step, first_step + 1, ...``); a batch of
    micro-batches is scored as their mean loss. Returns the mean perturbed loss of each."""

    def mean_loss(model: torch.nn.Module, micro: Any) -> torch.Tensor:
        parts = micro if isinstance(micro, list) else [micro]
        return torch.stack([loss_fn(model, m) for m in parts]).mean()

    out = []
    optimizer.model.eval()  # no dropout noise between the two sides of a difference
    for k, (lr, batch) in enumerate(zip(lrs, batches, strict=False)):
        value = optimizer.step(batch, mean_loss, lr, phase, first_step + k)
        remedy = "lower optimizer.lr or dipaco.spsa_eps"
        check_finite_loss(value, where, k, "SPSA loss", remedy)
        out.append(value)
    check_every_step_ran(out, lrs, where)
    return out
