"""The optimizer itself. Each step appends one JSON line to $MX_PLUGIN_LOG (when set): the
step, the learning rate and shrink it was given, and how many entries it updated."""

import json
import os

import torch


class SignDescent(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float = 1e-3,
        weight_decay: float = 0.0,
        shrink: float = 0.0,
        beta: float = 0.0,
    ):
        defaults = {"lr": lr, "weight_decay": weight_decay, "shrink": shrink, "beta": beta}
        super().__init__(params, defaults)
        self.steps = 0

    @torch.no_grad()
    def step(self, closure=None):
        self.steps += 1
        entries = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("momentum", torch.zeros_like(p))
                m.mul_(group["beta"]).add_(p.grad, alpha=1.0 - group["beta"])
                p.add_(m.sign() + group["shrink"] * p, alpha=-group["lr"])
                entries += p.numel()
        group = self.param_groups[0]
        line = {"step": self.steps, "lr": group["lr"], "shrink": group["shrink"], "n": entries}
        if "MX_PLUGIN_LOG" in os.environ:
            with open(os.environ["MX_PLUGIN_LOG"], "a") as log:
                log.write(json.dumps(line) + "\n")
