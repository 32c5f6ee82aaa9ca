"""Per-expert load of a MoE GPT model, one figure set per optimizer step.

Two sources, both megatron-core's own:

- the routing map each :class:`~megatron.core.transformer.moe.router.TopKRouter` returns
  (``[tokens, experts]``, after any capacity dropping): a forward hook sums it over the tokens of
  every training micro-batch, so ``tokens_per_expert[layer, e]`` is the number of (token, slot)
  assignments expert ``e`` received in this rank's share of the global batch; the counts are
  then summed over the data-parallel ranks (expert-parallel ranks are data-parallel ranks of the
  router, which every rank holds whole), over tensor-parallel ranks when sequence parallelism
  splits the tokens between them, and over pipeline stages (each holds its own layers);
- megatron-core's MoE metrics tracker (``moe_logging.get_moe_metrics_tracker``): the aux losses
  (``load_balancing_loss``, ``seq_load_balancing_loss``, ``global_load_balancing_loss``) and
  ``z_loss`` the routers record, without their coefficients, reduced and averaged by the tracker
  itself (mean over micro-batches and data-parallel ranks).

Figures of a step (``metrics.jsonl``; TensorBoard ``train/<name>`` and, per layer,
``train/<name>/layer_<n>``, ``n`` the 1-based layer number):

- ``moe_expert_batch``: B·k/E, tokens of the global batch times top-k over the expert count —
  the tokens an expert would receive under perfect balance;
- ``moe_tokens_per_expert_max`` / ``_mean``: per layer, over the experts (the mean equals
  ``moe_expert_batch`` unless tokens were dropped);
- ``moe_load_imbalance``: per layer, max / mean; ``moe_load_imbalance_max``: the worst layer;
- ``moe_<loss>``: per layer, and ``moe_<loss>_mean`` over the MoE layers (megatron-core's
  aggregate), for each aux/z loss the recipe enables.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.transformer_config import TransformerConfig

__all__ = ["ExpertLoad", "format_moe", "moe_layer_numbers"]

# megatron-core's tracker names of the router losses, and the short name in the log line.
LOSS_NAMES = {
    "load_balancing_loss": "aux",
    "seq_load_balancing_loss": "seq_aux",
    "global_load_balancing_loss": "global_aux",
    "z_loss": "z",
}


def moe_layer_numbers(config: TransformerConfig) -> list[int]:
    """The 1-based numbers of the MoE layers (``moe_layer_freq``: every n-th layer from the
    first, or a 0/1 pattern over the layers)."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    else:
        pattern = list(freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


def _enabled_losses(config: TransformerConfig) -> list[str]:
    """The tracker names of the losses the routers of ``config`` record."""
    types = config.moe_router_load_balancing_type
    coeffs = config.moe_aux_loss_coeff
    if isinstance(types, str):
        types, coeffs = [types], [coeffs]
    elif not isinstance(coeffs, list | tuple):
        coeffs = [coeffs] * len(types)
    by_type = {
        "aux_loss": "load_balancing_loss",
        "seq_aux_loss": "seq_load_balancing_loss",
        "global_aux_loss": "global_load_balancing_loss",
    }
    names = [by_type[t] for t, c in zip(types, coeffs, strict=True) if t in by_type and c]
    if config.moe_z_loss_coeff:
        names.append("z_loss")
    return names


class _Capture:
    """A TensorBoard-writer stand-in: keeps what the tracker's ``report`` writes."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def add_scalar(self, name: str, value: Any, step: int) -> None:
        self.values[name] = float(value)


class ExpertLoad:
    """Counts tokens per expert in every MoE layer of ``module`` (hooks on its routers) and
    turns them, with megatron-core's tracked router losses, into one step's figures.

    ``counts``: ``[num_layers, num_experts]`` int64, row ``n − 1`` for layer ``n``; this rank's
    training micro-batches since the last :meth:`collect`.
    """

    def __init__(self, module: torch.nn.Module, config: TransformerConfig) -> None:
        self.config = config
        self.layers = moe_layer_numbers(config)
        self.losses = _enabled_losses(config)
        self.routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
        device = next(module.parameters()).device
        self.counts = torch.zeros(
            config.num_layers, config.num_moe_experts, dtype=torch.int64, device=device
        )
        for router in self.routers:
            router.register_forward_hook(self._count)
        get_moe_metrics_tracker().clear()  # nothing from before this run counts

    def _count(self, router: TopKRouter, args: Any, output: tuple[torch.Tensor, ...]) -> None:
        # The same condition megatron-core uses for its aux losses: training forwards only,
        # not validation (eval mode, no grad).
        if router.training and torch.is_grad_enabled():
            routing_map = output[1]  # [tokens, experts] bool
            self.counts[router.layer_number - 1] += routing_map.sum(dim=0).to(torch.int64)

    def collect(self, tokens_in_batch: int, num_microbatches: int, step: int) -> dict[str, Any]:
        """The figures of the step just run (collective: every rank calls it), then reset.

        ``tokens_in_batch``: tokens of the global batch; ``num_microbatches``: this rank's
        micro-batches in it (the tracker's losses are summed over them)."""
        counts = self.counts.clone()
        self.counts.zero_()
        dist.all_reduce(
            counts, group=parallel_state.get_data_parallel_group(with_context_parallel=True)
        )
        if self.config.sequence_parallel:
            dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
        dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        c = self.config
        figures: dict[str, Any] = {
            "moe_expert_batch": tokens_in_batch * c.moe_router_topk / c.num_moe_experts
        }
        per = counts.double()[[n - 1 for n in self.layers]]  # [moe layers, experts]
        high, mean = per.max(dim=1).values, per.mean(dim=1)
        imbalance = high / mean.clamp(min=1e-30)
        keys = [f"layer_{n}" for n in self.layers]
        figures["moe_tokens_per_expert_max"] = dict(zip(keys, high.tolist(), strict=True))
        figures["moe_tokens_per_expert_mean"] = dict(zip(keys, mean.tolist(), strict=True))
        figures["moe_load_imbalance"] = dict(zip(keys, imbalance.tolist(), strict=True))
        figures["moe_load_imbalance_max"] = float(imbalance.max())
        if self.losses:
            capture = _Capture()
            get_moe_metrics_tracker().report(
                loss_scale=1.0 / num_microbatches,
                iteration=step,
                writer=capture,
                per_layer_logging=True,
                force_initialize=True,  # a pipeline stage without MoE layers joins the reduce
                track_names=self.losses,
                num_layers=c.num_layers,
                moe_layer_freq=c.moe_layer_freq,
                mtp_num_layers=c.mtp_num_layers,
            )
            for name in self.losses:
                figures[f"moe_{name}"] = {
                    f"layer_{n}": capture.values[f"moe/{name}_layer_{n - 1}"] for n in self.layers
                }
                figures[f"moe_{name}_mean"] = capture.values[name]
        return figures


def format_moe(figures: dict[str, Any]) -> str:
    """The MoE part of the log line: worst layer's max/mean load, the mean router losses."""
    parts = [f"moe imb {figures['moe_load_imbalance_max']:.2f}"]
    for name, short in LOSS_NAMES.items():
        if f"moe_{name}_mean" in figures:
            parts.append(f"{short} {figures[f'moe_{name}_mean']:.4g}")
    return " | " + " ".join(parts)
