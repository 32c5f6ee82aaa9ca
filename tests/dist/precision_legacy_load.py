"""Load the upgrade (``megatron-ext ckpt upgrade``) of a checkpoint written when bf16 models
kept their norms in fp32 (no fp32 master saved for them), then train two steps; prints one JSON
line on rank 0.

Checks on every rank: every parameter is bf16 now (Float16Module, norms included); the fp32
master of each norm is bit for bit the fp32 weight the original checkpoint holds (with the
element-sharded AdamW, this rank's 1-D range of it; the ranks' ranges cover it), and the bf16
norm its rounding.

Usage (under torchrun): precision_legacy_load.py RECIPE UPGRADED_DIR ORIGINAL_DIR [key=value ...]
"""

import dataclasses
import json
import sys

import torch


def main() -> None:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.optimizer import get_param_id_to_sharded_param_map

    from megatron_ext.config import load_recipe
    from megatron_ext.gpt.checkpoint import Checkpointer
    from megatron_ext.gpt.setup import setup
    from megatron_ext.gpt.step import train_step
    from megatron_ext.megatron.optimizer import _flat_range as flat_range

    recipe_path, ckpt, original, *overrides = sys.argv[1:]
    recipe = load_recipe(recipe_path, [*overrides, f"checkpoint.load={ckpt}"], world_size=2)
    run = setup(recipe)
    loop = Checkpointer(run.run_dir / "checkpoints", recipe.checkpoint).resume(
        run.chunks[0], run.optimizer
    )
    opt = run.optimizer
    names = opt.master_names
    assert {p.dtype for p in opt.model_params} == {torch.bfloat16}, "norms must be bf16 too"
    gpt = run.chunks[0].module.module  # DDP -> Float16Module -> GPTModel
    id_map = get_param_id_to_sharded_param_map(gpt.sharded_state_dict(), opt.model_params)
    shards = {n: id_map[i] for i, n in enumerate(names)}
    norms = [i for i, n in enumerate(names) if "norm" in n]
    request = {
        names[i]: dataclasses.replace(
            shards[names[i]],
            data=torch.empty(opt.model_params[i].shape, dtype=torch.float32),
            dtype=torch.float32,
        )
        for i in norms
    }
    saved = dist_checkpointing.load(request, original)
    moved = 0
    held = torch.zeros(len(norms), dtype=torch.int64, device=opt.model_params[0].device)
    sharded = 0
    for k, i in enumerate(norms):
        master, param, weight = opt.master_params[i], opt.model_params[i], saved[names[i]]
        # an element-sharded (ZeRO-1 AdamW) master is this rank's 1-D range of the weight
        flat = flat_range(opt.optimizer, names[i])
        expect = weight if flat is None else weight.reshape(-1)[flat[0] : flat[1]]
        sharded += int(flat is not None)
        assert master.dtype == torch.float32, names[i]
        assert torch.equal(master.detach().cpu(), expect), names[i]
        assert torch.equal(param.cpu(), weight.bfloat16()), names[i]
        held[k] = master.numel()
        moved += int(not torch.equal(weight, weight.bfloat16().float()))
    assert moved, "the saved norms should hold values bf16 cannot (else the check is void)"
    # element-sharded masters: the ranks' ranges together hold each norm's every element once
    assert sharded in (0, len(norms)), "norms are all element-sharded or none"
    if sharded:
        torch.distributed.all_reduce(held)
        want = [opt.model_params[i].numel() for i in norms]
        assert held.tolist() == want, (held.tolist(), want)
    start = int(loop["step"])
    losses = [train_step(run, step).loss for step in range(start, start + 2)]
    if torch.distributed.get_rank() == 0:
        print(json.dumps({"start": start, "norms": len(norms), "losses": losses}), flush=True)


if __name__ == "__main__":
    main()
