"""Train a GPT recipe (``megatron-ext train``'s path) while an independent float64 reference
watches every router: from the router's input and weight it recomputes the logits, the top-k
selection, the tokens per expert, the Switch aux loss and the z loss of each training
micro-batch, and writes them to ``OUT/ref.rank<r>.json`` per step (``{step: {layer: ...}}``).

Usage (under torchrun): moe_load_check.py OUT RECIPE [key=value ...]
"""

import json
import os
import sys
from collections import defaultdict
from pathlib import Path

import torch
from megatron.core.transformer.moe.router import TopKRouter

import megatron_ext.gpt.trainer as gpt_trainer
from megatron_ext.run.entry import train_main

STEP = [0]  # completed steps before the current one
REF: dict = defaultdict(lambda: defaultdict(lambda: {"counts": None, "aux": [], "z": []}))


def reference(router: TopKRouter, args: tuple, output: tuple) -> None:
    """Float64 recomputation of megatron-core's routing of this micro-batch (no expert bias,
    no capacity: the recipe under test uses neither)."""
    if not (router.training and torch.is_grad_enabled()):
        return
    x = args[0].detach().double().reshape(-1, args[0].shape[-1])  # [tokens, hidden]
    logits = x @ router.weight.detach().double().T  # [tokens, experts]
    k, experts = router.topk, logits.shape[1]
    top = torch.topk(logits, k, dim=1).indices  # softmax is monotonic: same selection
    counts = torch.bincount(top.reshape(-1), minlength=experts)
    scores = torch.softmax(logits, dim=1)
    tokens = logits.shape[0]
    aux = experts / (k * tokens * tokens) * float((scores.sum(0) * counts.double()).sum())
    z = float(torch.logsumexp(logits, dim=1).square().mean())
    rec = REF[STEP[0] + 1][router.layer_number]
    rec["counts"] = (
        counts.tolist()
        if rec["counts"] is None
        else ([a + b for a, b in zip(rec["counts"], counts.tolist(), strict=True)])
    )
    rec["aux"].append(aux)
    rec["z"].append(z)


if __name__ == "__main__":
    out, recipe, *overrides = sys.argv[1:]
    setup, train_step = gpt_trainer.setup, gpt_trainer.train_step

    def watched_setup(recipe_):
        run = setup(recipe_)
        routers = [m for m in run.chunks[0].modules() if isinstance(m, TopKRouter)]
        assert routers, "no MoE routers in the model"
        for router in routers:
            router.register_forward_hook(reference)
        return run

    def counted_step(run, step, *rest):
        STEP[0] = step
        return train_step(run, step, *rest)

    gpt_trainer.setup, gpt_trainer.train_step = watched_setup, counted_step
    code = train_main(recipe, overrides)
    rank = int(os.environ.get("RANK", "0"))  # the process groups are gone by now
    Path(out).mkdir(parents=True, exist_ok=True)
    Path(out, f"ref.rank{rank}.json").write_text(json.dumps(REF))
    sys.exit(code)
