"""A torch optimizer that every data-parallel rank steps over every parameter (megatron-core's
non-distributed optimizer), with the same name-keyed state as the layer-wise optimizer.

:class:`ReplicatedOptimizer` is plain ``torch.optim.AdamW`` over fp32 masters, each rank holding
the whole state: megatron-core's optimizer without ``--use-distributed-optimizer``. The trainer
runs ZeRO-1 AdamW instead (:mod:`megatron_ext.distributed.sharded_adam`); this one is its
reference in the tests (``tests/test_sharded_adam.py``: equal trajectories). It answers the
interface the adapter (:class:`~megatron_ext.megatron.optimizer.MegatronExtOptimizer`) asks of
any wrapped optimizer
-- ``master(name)``, ``set_grads``, ``reload_masters``, ``named_state``/``load_named_state``,
``saves(name)`` -- so one checkpoint form holds every optimizer's state: keyed by parameter
name, written once (data-parallel rank 0), loadable at any data-parallel size.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from megatron_ext.distributed.layerwise import MASTER_KEY, fp32_master

__all__ = ["ReplicatedOptimizer"]

NamedParams = Sequence[tuple[str, torch.nn.Parameter]]


class ReplicatedOptimizer:
    """``build(masters)`` over fp32 masters of ``named_params``, stepped by every rank.

    Args:
        named_params: the trained ``(name, parameter)`` pairs, forward order.
        build: makes the torch optimizer from the named masters (e.g. AdamW over megatron-core's
            weight-decay groups).
        writer: whether this rank writes ``name``'s state to a checkpoint (rank 0 of the
            parameter's data-parallel group: every replica holds the same values).
    """

    def __init__(
        self,
        named_params: NamedParams,
        build: Callable[[list[tuple[str, torch.nn.Parameter]]], torch.optim.Optimizer],
        writer: Callable[[str], bool] = lambda name: True,
    ) -> None:
        self._params = dict(named_params)
        # fp32 parameters are their own masters; bf16 ones get an fp32 copy
        self.masters = {n: fp32_master(p) for n, p in named_params}
        self.optimizer = build(list(self.masters.items()))
        self._writer = writer
        self._names = {id(m): n for n, m in self.masters.items()}

    # -- what the adapter steps -----------------------------------------------------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Mapping[Any, Any]:
        return self.optimizer.state

    def master(self, name: str) -> torch.nn.Parameter:
        """The fp32 tensor the optimizer updates for ``name`` (the parameter itself if fp32)."""
        return self.masters[name]

    def set_grads(self, grads: Mapping[str, torch.Tensor | None]) -> None:
        """Each master's gradient, as fp32 (an fp32 gradient is used in place, not copied)."""
        for name, g in grads.items():
            self.masters[name].grad = None if g is None else g.float()

    @torch.no_grad()
    def step(self) -> None:
        """Update the masters, then round them into the model parameters."""
        self.optimizer.step()
        for name, master in self.masters.items():
            if master is not self._params[name]:
                self._params[name].copy_(master)

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Copy the model parameters into the fp32 masters (after the model was loaded)."""
        for name, master in self.masters.items():
            if master is not self._params[name]:
                master.copy_(self._params[name])

    # -- name-keyed state -------------------------------------------------------------------
    def saves(self, name: str) -> bool:
        """Whether this rank writes ``name``'s state (one replica of it)."""
        return self._writer(name)

    def named_state(self) -> dict[str, dict[str, Any]]:
        """``{parameter name: {state key: value}}`` (copies), with a bf16 parameter's fp32
        master under ``"fp32_param"``; every parameter, since every rank holds them all."""
        out: dict[str, dict[str, Any]] = {}
        for p, st in self.optimizer.state.items():
            out[self._names[id(p)]] = {
                k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()
            }
        for name, master in self.masters.items():
            if master is not self._params[name]:
                out.setdefault(name, {})[MASTER_KEY] = master.detach().clone()
        return out

    def load_named_state(self, named: Mapping[str, Mapping[str, Any]]) -> None:
        """Install :meth:`named_state` output (from a run at any data-parallel size); a
        parameter missing from ``named`` is an error."""
        missing = [n for n in self.masters if n not in named]
        if missing:
            raise ValueError(
                f"optimizer state is missing for {len(missing)} parameters (e.g. {missing[0]}): "
                f"the checkpoint was written for a different model or optimizer"
            )
        self.optimizer.state.clear()
        for name, master in self.masters.items():
            st = {
                k: v.detach().clone().to(master.device) if torch.is_tensor(v) else v
                for k, v in named[name].items()
                if k != MASTER_KEY
            }
            if st:  # a parameter never stepped has no state yet
                self.optimizer.state[master] = st
            if MASTER_KEY in named[name]:
                with torch.no_grad():
                    master.copy_(named[name][MASTER_KEY])
