"""The SPSA estimator, its Adam update and the plateau rule that halves lr and ε together.

One update of a body ``θ`` (n,) with ``k`` probes ``z_j`` (rows of a probe matrix, see
:mod:`megatron_ext.zo.probes`)::

    thetas = perturb(θ, Z, ε)                    # (2k, n): θ+εz_0..θ+εz_{k-1}, θ-εz_0..θ-εz_{k-1}
    losses = model_loss(thetas)                  # (2k,), one batched forward
    ĝ      = spsa_estimate(loss_differences(losses), Z, ε)
    adam.step(θ, ĝ, lr, weight_decay)            # coupled decay: Adam sees ĝ + λθ

so ``ĝ = (1/k)·Σ_j [L(θ+εz_j) − L(θ−εz_j)]/(2ε)·z_j``.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def perturb(theta: torch.Tensor, probes: torch.Tensor, eps: float) -> torch.Tensor:
    """(n,), (k, n) -> (2k, n): rows ``[θ+εz_0, …, θ+εz_{k-1}, θ−εz_0, …, θ−εz_{k-1}]``."""
    if theta.dim() != 1 or probes.dim() != 2 or probes.shape[1] != theta.shape[0]:
        raise ValueError(
            f"perturb needs theta (n,) and probes (k, n); got {tuple(theta.shape)} and "
            f"{tuple(probes.shape)}"
        )
    step = probes.to(theta.dtype) * eps
    return torch.cat([theta + step, theta - step])


def loss_differences(losses: torch.Tensor) -> torch.Tensor:
    """(2k,) losses in :func:`perturb`'s row order -> (k,) ``L(θ+εz_j) − L(θ−εz_j)``."""
    if losses.dim() != 1 or losses.numel() % 2:
        raise ValueError(f"loss_differences needs an even-length (2k,) vector, got {losses.shape}")
    k = losses.numel() // 2
    return losses[:k] - losses[k:]


def spsa_estimate(diffs: torch.Tensor, probes: torch.Tensor, eps: float) -> torch.Tensor:
    """(k,), (k, n) -> (n,) ``ĝ = (1/k)·Σ_j diffs_j/(2ε)·z_j``.

    A fixed-order sum of separately rounded products and additions (no BLAS reduction, no fused
    multiply-add), so the result depends on ``(diffs, probes, ε)`` only: a run that gathers the
    differences from several ranks gets the same bits as a single-rank run, on any device."""
    k = diffs.numel()
    if diffs.dim() != 1 or probes.dim() != 2 or probes.shape[0] != k or k == 0:
        raise ValueError(
            f"spsa_estimate needs diffs (k,) and probes (k, n) with k > 0; got "
            f"{tuple(diffs.shape)} and {tuple(probes.shape)}"
        )
    dtype = torch.promote_types(diffs.dtype, probes.dtype)
    coeffs = diffs.to(dtype) / (2.0 * eps)
    grad = torch.zeros(probes.shape[1], dtype=dtype, device=probes.device)
    for j in range(k):
        grad = grad + probes[j].to(dtype) * coeffs[j]
    return grad / k


class ZOAdam:
    """Adam on a flat body with coupled weight decay (decay enters the moments).

    ``g = ĝ + λθ``; ``m ← β1·m + (1−β1)·g``; ``v ← β2·v + (1−β2)·g²``;
    ``θ ← θ − lr·m̂/(√v̂ + eps)`` with ``m̂ = m/(1−β1^t)``, ``v̂ = v/(1−β2^t)`` (torch.optim.Adam
    with ``weight_decay=λ``). ``m`` and ``v`` are (numel,) in ``dtype`` on ``device``.
    """

    def __init__(
        self,
        numel: int,
        *,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0) or eps <= 0.0:
            raise ValueError(f"ZOAdam needs 0 <= betas < 1 and eps > 0, got {betas}, {eps}")
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = float(eps)
        self.m = torch.zeros(numel, dtype=dtype, device=device)
        self.v = torch.zeros(numel, dtype=dtype, device=device)
        self.steps = 0

    @torch.no_grad()
    def step(self, theta: torch.Tensor, grad: torch.Tensor, lr: float, weight_decay: float) -> None:
        """Update ``theta`` (numel,) in place from the estimate ``grad`` (numel,)."""
        if theta.shape != self.m.shape or grad.shape != self.m.shape:
            raise ValueError(
                f"ZOAdam holds {self.m.numel()} moments; got theta {tuple(theta.shape)} and "
                f"grad {tuple(grad.shape)}"
            )
        beta1, beta2 = self.betas
        self.steps += 1
        g = grad.to(self.m.dtype)
        if weight_decay != 0.0:
            g = g + weight_decay * theta.to(self.m.dtype)
        self.m.mul_(beta1).add_(g, alpha=1.0 - beta1)
        self.v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        bias1 = 1.0 - beta1**self.steps
        bias2 = 1.0 - beta2**self.steps
        denom = (self.v / bias2).sqrt_().add_(self.eps)
        theta.sub_((self.m / denom).mul_(lr / bias1).to(theta.dtype))

    def state_dict(self) -> dict[str, Any]:
        return {
            "m": self.m.clone(),
            "v": self.v.clone(),
            "steps": self.steps,
            "betas": self.betas,
            "eps": self.eps,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd["m"].shape != self.m.shape:
            raise ValueError(
                f"ZOAdam state holds {sd['m'].numel()} moments, this optimizer {self.m.numel()}"
            )
        self.m.copy_(sd["m"])
        self.v.copy_(sd["v"])
        self.steps = int(sd["steps"])
        self.betas = (float(sd["betas"][0]), float(sd["betas"][1]))
        self.eps = float(sd["eps"])


class PlateauHalving:
    """Halve lr and ε together when the validation loss stops improving.

    An observation improves when ``val_loss < best − min_delta``. When ``patience`` updates have
    passed since the last improvement (or the last halving), lr and ε are halved, each clamped at
    ``floor`` (a value already below the floor stays where it is), and the patience window
    restarts. A NaN loss never counts as an improvement.
    """

    def __init__(
        self,
        lr: float = 1e-3,
        eps: float = 1e-3,
        patience: int = 1000,
        min_delta: float = 1e-8,
        floor: float = 1e-5,
    ) -> None:
        if lr <= 0 or eps <= 0 or floor <= 0 or patience < 1 or min_delta < 0:
            raise ValueError(
                "PlateauHalving needs lr, eps, floor > 0, patience >= 1 and min_delta >= 0; got "
                f"lr={lr}, eps={eps}, floor={floor}, patience={patience}, min_delta={min_delta}"
            )
        self.lr = float(lr)
        self.eps = float(eps)
        self.patience = int(patience)
        self.min_delta = float(min_delta)
        self.floor = float(floor)
        self.best = math.inf
        self.last_improvement = 0

    def observe(self, update: int, val_loss: float) -> bool:
        """Record the validation loss after ``update`` updates; True when lr and ε were halved."""
        if val_loss < self.best - self.min_delta:
            self.best = float(val_loss)
            self.last_improvement = int(update)
            return False
        if update - self.last_improvement < self.patience:
            return False
        self.last_improvement = int(update)
        # Never below the floor, and never raised to it when a value started under it.
        lr = max(self.lr / 2, min(self.lr, self.floor))
        eps = max(self.eps / 2, min(self.eps, self.floor))
        halved = (lr, eps) != (self.lr, self.eps)
        self.lr, self.eps = lr, eps
        return halved

    def state_dict(self) -> dict[str, Any]:
        return {
            "lr": self.lr,
            "eps": self.eps,
            "patience": self.patience,
            "min_delta": self.min_delta,
            "floor": self.floor,
            "best": self.best,
            "last_improvement": self.last_improvement,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.lr = float(sd["lr"])
        self.eps = float(sd["eps"])
        self.patience = int(sd["patience"])
        self.min_delta = float(sd["min_delta"])
        self.floor = float(sd["floor"])
        self.best = float(sd["best"])
        self.last_improvement = int(sd["last_improvement"])
