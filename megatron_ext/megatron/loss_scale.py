"""fp16's loss scale, on any device: megatron-core's ``DynamicGradScaler`` / ``ConstantGradScaler``
rules (megatron/core/optimizer/grad_scaler.py), whose scale megatron-core allocates on CUDA only.

Megatron-LM's ``--fp16`` multiplies the loss by the scale before backward (the model config's
``grad_scale_func``), then, before the optimizer step, multiplies every main gradient by 1/scale
and checks them for inf/nan (``torch._amp_foreach_non_finite_check_and_unscale_``, the flag
max-reduced over the ranks that hold other parts of the gradients). A step with a non-finite
gradient is skipped. The dynamic scale then follows megatron-core's rule exactly:

* non-finite: the growth count restarts; the hysteresis count drops by one, and at 0 the scale
  is multiplied by ``backoff_factor`` (floored at ``min_scale``);
* finite: the growth count rises; at ``growth_interval`` both counts restart and the scale is
  multiplied by ``growth_factor``.

Megatron-LM's flags and defaults: ``--loss-scale`` (a constant scale; none = dynamic),
``--initial-loss-scale`` 2³², ``--min-loss-scale`` 1, ``--loss-scale-window`` 1000 (the growth
interval), ``--hysteresis`` 2; growth 2 and backoff 0.5 (fixed in Megatron-LM).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["LossScale"]


@dataclass
class LossScale:
    """The loss scale of one run (every rank holds the same).

    ``constant``: megatron-core's ``ConstantGradScaler`` (``update`` changes nothing, its state
    is empty); else ``DynamicGradScaler``'s rule (module docstring). ``scale`` is a float32
    tensor of shape (1,) on ``device``, as megatron-core keeps it."""

    initial_scale: float = 2.0**32
    min_scale: float = 1.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    hysteresis: int = 2
    constant: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    def __post_init__(self) -> None:
        if self.constant:
            if self.initial_scale <= 0:
                raise ValueError(f"a constant loss scale must be > 0, got {self.initial_scale}")
        else:  # megatron-core's assertions, as errors
            if not 0.0 < self.min_scale <= self.initial_scale:
                raise ValueError(
                    f"min_loss_scale={self.min_scale} must be in (0, initial_loss_scale="
                    f"{self.initial_scale}]"
                )
            if self.growth_factor <= 1.0 or not 0.0 < self.backoff_factor < 1.0:
                raise ValueError("the growth factor must be > 1 and the backoff in (0, 1)")
            if self.growth_interval < 1 or self.hysteresis < 1:
                raise ValueError("loss_scale_window and hysteresis must be >= 1")
        self.scale = torch.tensor([self.initial_scale], dtype=torch.float32, device=self.device)
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    @classmethod
    def from_megatron(
        cls,
        loss_scale: float | None,
        initial_loss_scale: float,
        min_loss_scale: float,
        loss_scale_window: int,
        hysteresis: int,
        device: torch.device,
    ) -> LossScale:
        """Megatron-LM's flags (megatron-core ``OptimizerConfig`` names): a constant scale when
        ``loss_scale`` is given, else the dynamic one (growth 2, backoff 0.5)."""
        if loss_scale is not None:
            return cls(initial_scale=loss_scale, constant=True, device=device)
        return cls(
            initial_scale=initial_loss_scale,
            min_scale=min_loss_scale,
            growth_interval=loss_scale_window,
            hysteresis=hysteresis,
            device=device,
        )

    @property
    def inv_scale(self) -> torch.Tensor:
        return self.scale.double().reciprocal().float()

    def unscale_and_check(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """Multiply ``grads`` by 1/scale in place; a (1,) float32 tensor, 1 when any of them
        is not finite (before the caller's max-reduction over ranks), else 0."""
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        if grads:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, self.inv_scale)
        return found

    def update(self, found_inf: bool) -> None:
        """One step's outcome (megatron-core's rule; a constant scale ignores it)."""
        if self.constant:
            return
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                floor = torch.tensor([self.min_scale], dtype=torch.float32, device=self.device)
                self.scale = torch.max(self.scale * self.backoff_factor, floor)
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.growth_tracker = 0
                self.hysteresis_tracker = self.hysteresis
                self.scale = self.scale * self.growth_factor

    def state_dict(self) -> dict[str, Any]:
        """Plain values (a checkpoint's loop state): empty for a constant scale, as
        megatron-core's ``ConstantGradScaler``."""
        if self.constant:
            return {}
        return {
            "scale": float(self.scale),
            "growth_tracker": self.growth_tracker,
            "hysteresis_tracker": self.hysteresis_tracker,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.constant:
            return
        self.scale = torch.tensor([state["scale"]], dtype=torch.float32, device=self.device)
        self.growth_tracker = int(state["growth_tracker"])
        self.hysteresis_tracker = int(state["hysteresis_tracker"])
