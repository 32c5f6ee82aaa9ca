"""Run under torchrun (gloo): record when the layer-wise optimizer updates, launches and waits
for each bucket, and when each layer's forward runs; rank 0 saves the event list.

Usage: layerwise_overlap.py OUT.json
"""

import json
import sys

import torch

from megatron_ext.distributed.allgather_v import make_allgather_v
from megatron_ext.distributed.layerwise import LayerwiseOptimizer
from tests.dist.ending import leave

LAYERS = 4


def main(out: str) -> None:
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32, bias=False) for _ in range(LAYERS)))
    events: list[tuple[str, int]] = []
    # One 32x32 matrix per bucket, so bucket i is layer i.
    opt = LayerwiseOptimizer(
        list(model.named_parameters()),
        "muon",
        make_allgather_v(),
        bucket_numel=32 * 32,
        events=events,
    )
    opt.attach_forward_hooks(model)
    for i, layer in enumerate(model):  # registered after the optimizer's: runs after its wait
        layer.register_forward_pre_hook(lambda m, a, i=i: events.append(("forward", i)))
    model(torch.randn(2, 32)).sum().backward()
    after_backward = len(events)
    opt.step()
    in_flight = [b.pending is not None for b in opt.buckets]
    after_step = len(events)
    model(torch.randn(2, 32))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(opt.world)]
    torch.distributed.all_gather(gathered, flat)
    if opt.rank == 0:
        with open(out, "w") as f:
            json.dump(
                {
                    "events": events,
                    "after_backward": after_backward,
                    "after_step": after_step,
                    "in_flight_after_step": in_flight,
                    "ranks_agree": all(torch.equal(g, flat) for g in gathered),
                    "owners": [opt.plan.owner[n] for n, _ in model.named_parameters()],
                },
                f,
            )
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
