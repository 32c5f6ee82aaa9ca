"""Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms")."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from .validation import check_betas, check_range

__all__ = ["Lion"]


class Lion(torch.optim.Optimizer):
    """Sign of an interpolated momentum, with decoupled weight decay.

    ``u = sign(β1·m + (1 − β1)·g)``, ``W ← (1 − ηλ)W − η·s·u``, then ``m ← β2·m + (1 − β2)·g``
    (the conventions of the paper and of Emerging-Optimizers; tests/test_optim_parity.py).
    Works on tensors of any shape; one state tensor (m) per parameter.

    Args:
        params: parameters or parameter-group dicts.
        lr: learning rate η (Lion wants 3–10× smaller than AdamW).
        betas: (β1, β2), default (0.95, 0.98).
        weight_decay: decoupled weight decay λ.
        update_scale: s, the RMS of the update (the sign has RMS 1); recipes set it to AdamW's
            update RMS (0.2) so that one LR serves Lion and AdamW.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 1e-4,
        betas: tuple[float, float] = (0.95, 0.98),
        weight_decay: float = 0.0,
        update_scale: float = 1.0,
    ) -> None:
        defaults = dict(
            lr=lr, betas=tuple(betas), weight_decay=weight_decay, update_scale=update_scale
        )
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        check_range("lr", group["lr"], low=0.0)
        check_betas("betas", group["betas"])
        check_range("weight_decay", group["weight_decay"], low=0.0)
        check_range("update_scale", group["update_scale"], low=0.0, low_open=True)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimisation step; ``closure`` re-evaluates the loss as in torch.optim."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            moms = []
            for p in params:
                if "exp_avg" not in self.state[p]:
                    self.state[p]["exp_avg"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format
                    )
                moms.append(self.state[p]["exp_avg"])
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            if wd != 0.0:
                torch._foreach_mul_(params, 1.0 - lr * wd)
            updates = torch._foreach_lerp(moms, grads, 1.0 - beta1)
            torch._foreach_sign_(updates)
            torch._foreach_add_(params, updates, alpha=-lr * group["update_scale"])
            torch._foreach_lerp_(moms, grads, 1.0 - beta2)
        return loss
