"""The text ``megatron-ext plan`` prints: one block per figure group, bytes in GB (10⁹)."""

from __future__ import annotations

from megatron_ext.planner.figures import Plan, StagePlan

__all__ = ["format_plan"]


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:8.2f} GB"


def _duration(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} days"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds:.0f} s"


def _row(label: str, value: str, extra: str = "") -> str:
    return f"  {label:<40}{value}" + (f"  {extra}" if extra else "")


def _memory(plan: Plan, s: StagePlan) -> list[str]:
    m = s.memory
    dtype = "fp32" if plan.precision == "fp32" else "bf16"
    lines = [
        f"memory per rank (stage {s.stage}, most loaded rank: dense {s.dense_rank}"
        + (f", expert {s.expert_rank}" if s.expert is not None else "")
        + ")",
        _row(f"parameters ({dtype})", _gb(m.parameters)),
        _row("gradients (fp32 main_grad)", _gb(m.gradients)),
        _row("fp32 masters", _gb(m.masters)),
    ]
    for route, nbytes in sorted(m.optimizer_state.items()):
        lines.append(_row(f"optimizer state: {route}", _gb(nbytes)))
    many = "es" if s.in_flight > 1 else ""
    if plan.layout.vp > 1:  # a pass is one micro-batch through one model chunk
        many += " x chunk"
    lines += [
        _row("static (the above)", _gb(m.static), f"mean rank {_gb(s.mean_static).strip()}"),
        _row(
            f"activations ({s.in_flight} micro-batch{many}, recompute={_recompute(plan)})",
            _gb(m.activations),
        ),
        _row("largest transient", _gb(m.transient), m.transient_what),
        _row(
            "peak = static + max(activations, transient)",
            _gb(m.peak),
            f"of {plan.usable_bytes / 1e9:.1f} GB usable ({plan.cluster.gpu.memory_bytes / 1e9:.0f}"
            f" GB - {plan.cluster.reserve_bytes / 1e9:g} GB reserve)",
        ),
    ]
    return lines


def _comm(s: StagePlan) -> list[str]:
    names = {
        "grad_reduce_scatter": "gradient reduce-scatter-v (fp32)",
        "param_all_gather": "parameter all-gather-v",
        "replicated_all_reduce": "replicated params' all-reduce",
        "ddp_all_reduce": "DDP gradient all-reduce (fp32)",
        "tensor_parallel": "tensor/sequence parallel",
        "expert_all_to_all": "expert all-to-all",
        "pipeline": "pipeline activations",
    }
    lines = ["communication per step (this rank: sent / received)"]
    for key, value in s.comm.as_dict().items():
        if value["sent"] or value["received"]:
            lines.append(_row(names[key], f"{_gb(value['sent'])} / {_gb(value['received'])}"))
    if len(lines) == 1:
        lines.append("  none (one rank)")
    return lines


def _balance(plan: Plan, s: StagePlan) -> list[str]:
    lines = []
    for label, loads in (("dense", s.dense), ("expert", s.expert)):
        if loads is None:
            continue
        d = loads.as_dict()
        lines.append(
            f"  layer-wise plan, {label} over {loads.ranks} ranks: state max/mean "
            f"{d['state_bytes']['imbalance']:.3f}, optimizer FLOPs max/mean "
            f"{d['flops']['imbalance']:.3f}"
        )
    names = {
        "ours": "this project's layer-wise plan",
        "megatron_core_layerwise": "megatron-core layer-wise optimizer",
        "zero1": "ZeRO-1 (megatron-core distributed optimizer)",
    }
    if plan.baselines:
        lines.append(
            f"  matrix parameters over dp={plan.layout.dp}: state+masters max (max/mean), "
            "FLOPs max/mean, all-gather-in max"
        )
    for key, b in plan.baselines.items():
        flops = "n/a" if b["flops"] is None else f"{b['flops']['imbalance']:.3f}"
        state = b["state_bytes"]
        lines.append(
            f"    {names[key]:<45}{_gb(state['max'])} ({state['imbalance']:.3f})  {flops:>6}"
            f"  {_gb(b['gather_bytes']['max'])}"
        )
    if any(b["flops"] is None for b in plan.baselines.values()):
        lines.append("    (n/a: ZeRO-1 holds slices of matrices; a matrix step needs them whole)")
    return ["balance", *lines] if lines else []


def _time(plan: Plan) -> list[str]:
    t = plan.step
    a = plan.assumptions
    return [
        f"time per step (MFU {a['mfu']:.2f} of {a['bf16_peak_tflops']:.0f} dense BF16 TFLOP/s)",
        _row("model FLOPs per rank", f"{plan.model_flops_per_rank / 1e12:8.1f} TFLOP"),
        _row("compute", f"{t.compute_s:8.3f} s"),
        _row("pipeline bubble", f"{t.bubble_s:8.3f} s"),
        _row("optimizer step", f"{t.optimizer_s:8.3f} s"),
        _row(
            "exposed communication",
            f"{t.exposed_comm_s:8.3f} s",
            f"(all-gather hidden behind the forward: {t.hidden_comm_s:.3f} s)",
        ),
        _row(
            "step",
            f"{t.total_s:8.3f} s",
            f"{plan.tokens_per_second:,.0f} tokens/s; {plan.train_tokens / 1e9:,.1f}B tokens in "
            f"{_duration(plan.time_to_budget_s)}",
        ),
        "  links GB/s: "
        + ", ".join(f"{k} {v:g}" for k, v in a["link_gbps"].items())
        + f" (NVLink domain {a['nvlink_domain']} GPUs)",
    ]


def format_plan(plan: Plan) -> str:
    """The plan as the terminal shows it."""
    lay, c = plan.layout, plan.cluster
    head = [
        f"plan: {plan.recipe} on {c.nodes} x {c.gpus_per_node} {c.gpu.name} "
        f"({c.world} GPUs), optimizer={plan.optimizer}, precision={plan.precision}",
        f"  {plan.total_params / 1e9:.2f}B parameters; TP={lay.tp} PP={lay.pp}"
        f"{f' x {lay.vp} chunks' if lay.vp > 1 else ''} CP={lay.cp} "
        f"EP={lay.ep} DP={lay.dp} (expert DP {lay.edp}), sequence_parallel="
        f"{str(lay.sequence_parallel).lower()}; micro-batch {lay.micro_batch} x "
        f"{lay.micro_batches} per rank, global batch {lay.global_batch} x {lay.seq} tokens",
        f"  attention: {plan.assumptions['attention']}",
    ]
    worst = plan.worst
    body: list[str] = [*_memory(plan, worst), *_comm(worst), *_balance(plan, worst), *_time(plan)]
    if len(plan.stages) > 1:
        body.append("pipeline stages (peak per stage)")
        body += [
            f"  stage {s.stage}: {_gb(s.memory.peak)}  ({s.params / 1e6:.1f}M parameters)"
            for s in plan.stages
        ]
    if plan.fits:
        verdict = "FITS"
    elif plan.fix:
        verdict = f"DOES NOT FIT: first change that fits: {plan.fix}"
    else:
        verdict = "DOES NOT FIT: no single change (SP, recompute, micro-batch, TP, PP) makes it fit"
    notes = [f"note: {n}" for n in plan.notes]
    return "\n".join([*head, *body, verdict, *notes])


def _recompute(plan: Plan) -> str:
    """The layout's recomputation as the report line names it (full's method and layer count
    where they are not uniform over 1)."""
    lay = plan.layout
    form = (lay.recompute_method, lay.recompute_num_layers)
    if lay.recompute != "full" or form == ("uniform", 1):
        return lay.recompute
    return f"full, {lay.recompute_method} over {lay.recompute_num_layers}"
