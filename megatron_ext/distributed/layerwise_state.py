"""The layer-wise optimizer's state keyed by parameter name: independent of the
data-parallel size and of the ownership plan, so a checkpoint written at one size loads at any
other (:class:`NamedState`, mixed into :class:`~.layerwise.LayerwiseOptimizer`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

MASTER_KEY = "fp32_param"  # the master's entry in the name-keyed state


class NamedState:
    """Name-keyed state over ``masters`` (name -> the fp32 tensor the optimizers step),
    ``_params`` (name -> model parameter), ``all_optimizers()`` and ``holds(name)``, which the
    class it is mixed into provides."""

    masters: dict[str, torch.nn.Parameter]
    _params: dict[str, torch.nn.Parameter]

    def all_optimizers(self) -> list[torch.optim.Optimizer]:
        raise NotImplementedError

    def holds(self, name: str) -> bool:
        raise NotImplementedError

    def _master_names(self) -> dict[int, str]:
        return {id(m): n for n, m in self.masters.items()}

    def named_state(self) -> dict[str, dict[str, Any]]:
        """``{parameter name: {state key: value}}`` for every parameter this rank holds, with the
        fp32 master of a low-precision parameter under ``"fp32_param"``.

        Tensors are copies: the optimizers keep some state as views of stacked tensors (KL-SOAP
        packs same-shape matrices), and a view would drag its whole stack into a file."""
        names = self._master_names()
        out: dict[str, dict[str, Any]] = {}
        for opt in self.all_optimizers():
            for p, st in opt.state.items():
                out[names[id(p)]] = {
                    k: v.detach().clone() if torch.is_tensor(v) else v for k, v in st.items()
                }
        for name, master in self.masters.items():
            if master is not self._params[name]:
                out.setdefault(name, {})[MASTER_KEY] = master.detach().clone()
        return out

    def load_named_state(self, named: Mapping[str, Mapping[str, Any]]) -> None:
        """Install name-keyed state (from :meth:`named_state` of any data-parallel size) for every
        parameter this rank holds; a held parameter missing from ``named`` is an error. A saved
        fp32 master is copied into this rank's master (for an fp32 parameter: the parameter)."""
        missing = [n for n in self._params if self.holds(n) and n not in named]
        if missing:
            raise ValueError(
                f"optimizer state is missing for {len(missing)} parameters (e.g. {missing[0]}): "
                f"the checkpoint was written for a different model or optimizer"
            )
        names = self._master_names()
        for opt in self.all_optimizers():
            by_id = {id(p): p for g in opt.param_groups for p in g["params"]}
            opt.state.clear()
            for pid, p in by_id.items():
                st = {
                    k: v.detach().clone().to(p.device) if torch.is_tensor(v) else v
                    for k, v in named[names[pid]].items()
                    if k != MASTER_KEY
                }
                if st:  # a parameter never stepped has a master but no optimizer state yet
                    opt.state[p] = st
        with torch.no_grad():
            for name, master in self.masters.items():
                if MASTER_KEY in named[name]:
                    master.copy_(named[name][MASTER_KEY])

    def state_dict(self) -> dict[str, Any]:
        """Name-keyed state of the parameters this rank holds (see :meth:`named_state`)."""
        return {"state": self.named_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output; ``state["state"]`` may be the union of every saving
        rank's dicts, written at any data-parallel size."""
        self.load_named_state(state["state"])
