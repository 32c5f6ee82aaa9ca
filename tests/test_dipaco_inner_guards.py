"""DiPaCo's two inner loops stop on a non-finite loss before taking that step, naming where, and
refuse to run out of batches (``megatron_ext.dipaco.steps.guards``)."""

from __future__ import annotations

import pytest
import torch

from megatron_ext.dipaco.steps.inner import inner_steps
from megatron_ext.dipaco.steps.zero_order import SPSAInner, spsa_inner_steps
from megatron_ext.errors import TrainingDivergedError


class Counting:
    """An inner optimizer that only counts its steps."""

    def __init__(self) -> None:
        self.steps = 0

    def zero_grad(self) -> None:
        pass

    def step(self, lr: float) -> None:
        self.steps += 1


def _loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return (model(batch) ** 2).mean()


def test_gradient_loop_stops_before_a_nan_step_and_when_batches_run_out() -> None:
    model = torch.nn.Linear(3, 2)
    good, bad = torch.ones(4, 3), torch.full((4, 3), float("nan"))
    opt = Counting()
    with pytest.raises(TrainingDivergedError, match=r"path 2 inner step 1: loss is nan; lower"):
        inner_steps(model, opt, [good, bad, good], [0.1] * 3, _loss, where="path 2")
    assert opt.steps == 1  # the NaN step was not taken
    with pytest.raises(ValueError, match=r"path 2: 3 inner steps but only 2 batches"):
        inner_steps(model, Counting(), [good, good], [0.1] * 3, _loss, where="path 2")
    assert (
        inner_steps(model, Counting(), [good, [good, good]], [0.1] * 2, _loss)
        == [pytest.approx(_loss(model, good).item())] * 2
    )


def _spsa() -> SPSAInner:
    model = torch.nn.Linear(3, 2)
    return SPSAInner(
        model, n_pert=2, eps=1e-3, weight_decay=0.0, betas=(0.9, 0.999), seed=1, path=0
    )


def test_zero_order_loop_names_a_nan_spsa_loss_and_runs_out_of_batches_loudly() -> None:
    """(The zero-order step scores and updates in one call, so its check follows the step.)"""
    good, bad = torch.ones(4, 3), torch.full((4, 3), float("nan"))
    with pytest.raises(TrainingDivergedError, match=r"path 0 inner step 1: SPSA loss is nan"):
        spsa_inner_steps(_spsa(), [good, bad], [0.1] * 2, 0, 0, _loss, where="path 0")
    with pytest.raises(ValueError, match=r"path 0: 2 inner steps but only 1 batches"):
        spsa_inner_steps(_spsa(), [good], [0.1] * 2, 0, 0, _loss, where="path 0")
