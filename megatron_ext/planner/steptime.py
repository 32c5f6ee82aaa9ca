"""Time of one optimizer step on one rank, from FLOPs and bytes at stated rates.

- **compute**: the GPT FLOP model (:func:`megatron_ext.gpt.flops.gpt_train_flops_per_token`)
  times the tokens of a step, over the ranks, at the GPU's dense BF16 peak × ``mfu`` (an
  assumption the user sets: published Megatron-LM / torchtitan runs of dense models at this
  scale report 0.35–0.50); the 1F1B pipeline bubble ``(pp − 1) / micro-batches`` on top;
- **optimizer**: the FLOPs of the parameters this rank updates (each optimizer spec's FLOP
  model) at the same rate;
- **communication**: bytes over the link the group spans — NVLink inside an NVLink domain, the
  network between domains — with no overlap for the tensor-parallel, expert and pipeline
  collectives and the gradient reduce-scatter (the trainer does not overlap them), and the
  parameter all-gather hidden behind the next forward up to the forward's length (the
  layer-wise optimizer's overlap).

Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["StepTime", "link_gbps", "step_time"]


@dataclass
class StepTime:
    """Seconds of one step on one rank."""

    compute_s: float
    bubble_s: float
    optimizer_s: float
    exposed_comm_s: float
    hidden_comm_s: float

    @property
    def total_s(self) -> float:
        return self.compute_s + self.bubble_s + self.optimizer_s + self.exposed_comm_s

    def as_dict(self) -> dict[str, float]:
        return {**vars(self), "total_s": self.total_s}


def link_gbps(
    group_span: int, nvlink_domain: int, nvlink_gbps: float, network_gbps: float
) -> float:
    """The bandwidth a group runs at: NVLink when its ranks ``group_span`` consecutive GPUs
    apart stay in one NVLink domain, else the network."""
    return nvlink_gbps if group_span <= nvlink_domain else network_gbps


def step_time(
    *,
    model_flops: float,
    optimizer_flops: float,
    peak_tflops: float,
    mfu: float,
    pp: int,
    micro_batches: int,
    comm_exposed: dict[str, tuple[int, float]],
    gather: tuple[int, float],
    vp: int = 1,
) -> StepTime:
    """``model_flops``: this rank's training FLOPs of a step; ``comm_exposed``: per collective
    (bytes sent, link GB/s) not overlapped; ``gather``: the parameter all-gather's (bytes, GB/s),
    hidden behind the forward (a third of the compute) as far as it lasts; ``vp``: model chunks
    per pipeline rank (the interleaved schedule's bubble is ``1/vp`` of 1F1B's: Narayanan et
    al., 2021, "Efficient large-scale language model training on GPU clusters using
    Megatron-LM", section 2.2.2)."""
    rate = peak_tflops * 1e12 * mfu
    compute = model_flops / rate
    bubble = compute * (pp - 1) / (micro_batches * vp) if pp > 1 else 0.0
    exposed = sum(nbytes / (gbps * 1e9) for nbytes, gbps in comm_exposed.values() if nbytes)
    gather_s = gather[0] / (gather[1] * 1e9) if gather[0] else 0.0
    forward = compute / 3
    hidden = min(gather_s, forward)
    return StepTime(
        compute_s=compute,
        bubble_s=bubble,
        optimizer_s=optimizer_flops / rate,
        exposed_comm_s=exposed + gather_s - hidden,
        hidden_comm_s=hidden,
    )
