"""``megatron-ext bench soma``: the batched SPSA update and routed inference, on this CPU.

SPSA (one expert, d_t = d_E = 32, D = 2 unless overridden): the losses of all ``2·n_pert``
perturbed bodies on one shared (B, T+1) batch --

* ``batched native``: one forward with a perturbation axis on the C kernels of
  :mod:`megatron_ext.soma.native` (what the trainer runs on CPU; absent, and said so, where
  they cannot be built);
* ``batched eager``: the same forward in torch, the seven-kernel eager recurrence;
* ``batched fused``: the same forward with each recurrent step one ``bmm`` plus one compiled
  element-wise pass (``torch.compile``; absent, and said so, where it cannot compile);
* two per-probe Python loops (one forward per perturbed body), measured in the same run:
  ``torch_nn``, the textbook loop -- the expert as standard ``torch.nn`` modules (``nn.LSTM``,
  which runs oneDNN's fused RNN kernel on CPU, ``nn.LayerNorm``, ``nn.Linear``), each probe's
  parameters copied in before its forward (:mod:`._soma_textbook`) -- and ``own_kernels``,
  this project's forward at P = 1. The anchor (``naive``) is the faster of the two, so the
  speedup is not flattered by a slow loop.

Figures: perturbed byte-tokens per second (``2·n_pert·B·T`` per update), the speedup of the
faster batched variant, the batched forward's achieved GFLOP/s (analytic FLOP count of the
forward) against the machine's measured fp32 matmul rate (a 1024³ matmul timed in every round,
its best kept), the speedup ceiling (anchor time / the forward's FLOPs at that matmul rate: what
a batched forward at torch's matmul rate would reach here) and the share of it reached, the
share of the CPU's FMA peak (:func:`~megatron_ext.soma.native.fma_peak_gflops`, also timed in
every round; torch's matmul is not always near it, and a forward may then beat the "ceiling"),
and the peak resident memory
added by the batched update the trainer runs (native where built, else eager). Every variant is
timed in the same rounds (alternating order, :mod:`megatron_ext.bench._trust`: at least
``--repeats``, more until the loops' per-round ratios to the eager forward have a spread of at
most ``--spread`` or ``--budget`` seconds pass) and reports its fastest round (medians, and the
speedup's per-round median with its spread, in the JSON).

Routed inference: the two sweeps of :mod:`._soma_inference` (equal total parameters, equal
expert size) with the ratio N=256 / N=8 beside the paper's 9.19×. ``--inference-sweep`` runs
only those, ``--spsa-only`` only the SPSA part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from typing import Any

from megatron_ext.bench._soma_report import print_spsa
from megatron_ext.bench._soma_textbook import torch_nn_expert, torch_nn_loss_loop
from megatron_ext.bench._trust import (
    Repeat,
    add_trust_arguments,
    load_check,
    ratio_spread,
    timed_rounds,
)
from megatron_ext.bench.common import progress, write_json
from megatron_ext.commands import positive_int

DESCRIPTION = (
    "SOMA: batched SPSA perturbed-tokens/s (eager and fused) vs a per-probe loop, GFLOP/s vs "
    "matmul rate, peak memory; routed-inference sweeps over N at equal total parameters and at "
    "equal expert size (figures + JSON)"
)


QUICK = {  # a smoke run: the per-probe loops (most of its time) on 2·4 bodies of 2×32 tokens
    "n_pert": 4,
    "batch": 2,
    "seq": 32,
    "repeats": 1,
    "budget": 0.0,
    "experts": [8, 32],
    "windows": 16,
    "inference_repeats": 1,
    "skip_compiled": True,
}
EXAMPLE = "megatron-ext bench soma --quick --json runs/bench_soma.json"
#: the JSON's top-level keys (``spsa`` without ``--inference-sweep``, ``inference`` without
#: ``--spsa-only``)
JSON_KEYS = ("spsa", "inference", "meta")
#: the baseline this benchmark's ratios are against (``meta.anchor`` of its JSON)
ANCHOR = (
    "the faster per-probe Python loop (naive), timed in the same rounds; GFLOP/s against "
    "the fp32 matmul rate timed in every round"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--d-model", type=positive_int, default=32)
    parser.add_argument("--blocks", type=positive_int, default=2)
    parser.add_argument("--n-pert", type=positive_int, default=64)
    parser.add_argument("--batch", type=positive_int, default=16)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed SPSA rounds at least (the fastest is reported; more until --spread or "
        "--budget)",
    )
    add_trust_arguments(parser, budget_s=60.0)
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--device",
        default="cpu",
        help="device of the SPSA timing (cpu, or cuda[:N] on a GPU host); routed inference "
        "always runs on the CPU",
    )
    parser.add_argument(
        "--experts", type=int, nargs="+", default=[8, 32, 256], help="N of the inference sweeps"
    )
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--windows", type=int, default=128, help="windows per inference run")
    parser.add_argument(
        "--sweep-total",
        type=int,
        default=0,
        help="total body parameters of the equal-total sweep (default: 8 experts of width 128)",
    )
    parser.add_argument(
        "--inference-repeats",
        type=int,
        default=3,
        help="timed inference rounds (the fastest is reported)",
    )
    parser.add_argument(
        "--fused",
        choices=["auto", "on", "off", "native"],
        default="auto",
        help="the inference sweeps' recurrence: compiled (on), eager torch (off), the C kernel "
        "(native), or what was measured to help (auto); the SPSA timing measures them all",
    )
    part = parser.add_mutually_exclusive_group()
    part.add_argument(
        "--inference-sweep", action="store_true", help="only the routed-inference sweeps"
    )
    part.add_argument("--spsa-only", action="store_true", help="only the SPSA timing")
    parser.add_argument(
        "--skip-compiled",
        action="store_true",
        help="leave out the torch.compile'd variant of the SPSA timing (its first compile takes "
        "minutes on a CPU)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")


def forward_flops_per_token(d_model: int, d_embed: int, blocks: int, vocab: int = 256) -> int:
    """Multiply-adds ×2 of one token through the body and the head (norms/gates not counted):
    per block the LSTM's input and recurrent products (2·2·4d²) and the MLP (2·2·4d²)."""
    flops = blocks * 32 * d_model * d_model + 2 * d_embed * vocab
    if d_model != d_embed:
        flops += 2 * 2 * d_model * d_embed
    return flops


class PeakRSS:
    """Resident memory added during a ``with`` block: the process RSS sampled every millisecond
    by a thread, peak minus the value at entry (bytes). ``ru_maxrss`` cannot serve: it is the
    process's lifetime peak, usually set earlier by imports."""

    def __init__(self, interval_s: float = 1e-3) -> None:
        self.interval_s = interval_s
        self.added_bytes = 0

    def __enter__(self) -> PeakRSS:
        import psutil

        self._proc = psutil.Process()
        self._base = self._peak = self._proc.memory_info().rss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self._proc.memory_info().rss)
            time.sleep(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, self._proc.memory_info().rss)
        self.added_bytes = self._peak - self._base


def _spsa(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from megatron_ext.bench.common import matmul_gflops
    from megatron_ext.soma import (
        BodyLayout,
        ExpertShape,
        batched_loss,
        fma_peak_gflops,
        fused_available,
        init_body,
        init_embedding,
        naive_loss_loop,
        native_available,
    )
    from megatron_ext.zo import perturb, probe_matrix

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    load = load_check(1 if cuda else args.threads, "bench soma")
    shape = ExpertShape(d_embed=32, d_model=args.d_model, num_blocks=args.blocks)
    layout = BodyLayout.from_shape(shape)
    gen = torch.Generator().manual_seed(0)
    theta, emb = init_body(shape, gen), init_embedding(shape, gen).to(device)
    tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(device)
    z = probe_matrix(0, 1, 0, 0, range(args.n_pert), layout.gain_mask)
    thetas = perturb(theta, z, 1e-3).to(device)
    pert_tokens = thetas.shape[0] * args.batch * args.seq
    module = torch_nn_expert(layout).to(device)
    fused_ok, fused_why = fused_available(device)
    if fused_ok and args.skip_compiled:
        fused_ok, fused_why = False, "skipped (--skip-compiled)"
    batched = {"eager": lambda: batched_loss(thetas, emb, tokens, layout, fused="off")}
    native_ok, native_why = (False, "runs on CPU only") if cuda else native_available()
    if native_ok:
        batched["native"] = lambda: batched_loss(thetas, emb, tokens, layout, fused="native")
    if fused_ok:
        batched["fused"] = lambda: batched_loss(thetas, emb, tokens, layout, fused="on")
    loops = {
        "torch_nn": lambda: torch_nn_loss_loop(thetas, emb, tokens, layout, module),
        "own_kernels": lambda: naive_loss_loop(thetas, emb, tokens, layout),
    }
    with torch.inference_mode():
        for fn in (*batched.values(), *loops.values()):
            fn()  # warm-up (and the fused scan's compile)
        if fused_ok:  # asked again: a compile that failed at run time ran eager, and says why
            fused_ok, fused_why = fused_available(device)
            if not fused_ok:
                del batched["fused"]
        # Peak memory of one more call of what the trainer runs (the allocator reuses what the
        # warm-up allocated).
        peak_of = "native" if native_ok else "eager"
        if cuda:
            sync()
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            batched[peak_of]()
            sync()
            peak_bytes = torch.cuda.max_memory_allocated(device) - base
        else:
            with PeakRSS() as peak:
                batched[peak_of]()
            peak_bytes = peak.added_bytes
        # Each variant's fastest round: load from other jobs only ever slows a call down, and not
        # alike -- on 2 shared cores the per-probe loops (thousands of small kernels, each a
        # thread barrier) were seen 10x slower while the batched forward lost 1.5x.
        # The matmul rate is measured in every round too and its best kept, as each variant's
        # best round is: one reading after the rounds ranged 357-426 GFLOP/s on this host.
        # So is the FMA peak of the C kernels' vectors (CPU): torch's matmul is not always near
        # it (on an AMD host MKL ran 200 GFLOP/s where the FMAs reach 530, and the native
        # forward beat the matmul), so the share of the peak is printed beside the ceiling.
        rates: list[float] = []
        peaks: list[float] = []

        def measure_rates() -> None:
            rates.append(matmul_gflops(device=args.device))
            if native_ok:
                peaks.append(fma_peak_gflops(args.threads, repeats=1))

        timed = [*batched.values(), *loops.values(), measure_rates]
        n_batched = len(batched)

        def loop_over_eager(times: list[list[float]]) -> list[list[float]]:
            """Per round, each loop's time over the eager batched forward's."""
            return [
                [a / b for a, b in zip(times[i], times[0], strict=True)]
                for i in range(n_batched, n_batched + len(loops))
            ]

        repeat = Repeat(args.spread, args.budget, args.repeats, args.max_rounds)
        rounds = timed_rounds(timed, repeat, loop_over_eager, sync)[:-1]
        seconds = [min(t) for t in rounds]
        ref = batched["eager"]()
        diffs = {name: float((fn() - ref).abs().max()) for name, fn in {**batched, **loops}.items()}
    batched_s = dict(zip(batched, seconds[: len(batched)], strict=True))
    anchors = dict(zip(loops, seconds[len(batched) :], strict=True))
    best = min(batched_s, key=batched_s.__getitem__)
    anchor = min(anchors, key=anchors.__getitem__)
    naive_s = anchors[anchor]
    per_round = [
        a / b
        for a, b in zip(
            rounds[n_batched + list(loops).index(anchor)],
            rounds[list(batched).index(best)],
            strict=True,
        )
    ]
    flops = forward_flops_per_token(args.d_model, 32, args.blocks) * pert_tokens
    rate, peak = max(rates), max(peaks, default=None)
    ceiling = naive_s / (flops / (rate * 1e9))
    return {
        "shape": {
            "d_model": args.d_model,
            "blocks": args.blocks,
            "n_pert": args.n_pert,
            "batch": args.batch,
            "seq": args.seq,
            "body_parameters": layout.numel,
            "perturbed_tokens_per_update": pert_tokens,
        },
        "rounds": len(rounds[0]),
        # the speedup per round (same round's anchor loop / best batched) and its spread
        "speedup_rounds": ratio_spread(per_round).as_dict(),
        "repeat": {**repeat.as_dict(), "load": load},
        "seconds_all_rounds": dict(zip([*batched, *loops], rounds, strict=True)),
        "median_s": {
            name: statistics.median(t) for name, t in zip([*batched, *loops], rounds, strict=True)
        },
        "fused_available": fused_ok,
        "fused_unavailable_reason": fused_why,
        "native_available": native_ok,
        "native_unavailable_reason": native_why,
        "batched_variants_s": batched_s,
        "batched_best": best,
        "batched_s": batched_s[best],
        "naive_s": naive_s,
        "naive_anchor": anchor,
        "anchors_s": anchors,
        "batched_tokens_per_s": pert_tokens / batched_s[best],
        "naive_tokens_per_s": pert_tokens / naive_s,
        "speedup": naive_s / batched_s[best],
        "speedup_eager": naive_s / batched_s["eager"],
        "fused_vs_eager": batched_s["eager"] / batched_s["fused"] if fused_ok else None,
        "native_vs_eager": batched_s["eager"] / batched_s["native"] if native_ok else None,
        "speedup_vs_own_kernels_loop": anchors["own_kernels"] / batched_s[best],
        "speedup_ceiling": ceiling,
        "fraction_of_ceiling": naive_s / batched_s[best] / ceiling,
        "gflops": flops / batched_s[best] / 1e9,
        "naive_gflops": flops / naive_s / 1e9,
        "matmul_gflops": rate,
        "fraction_of_matmul_rate": flops / batched_s[best] / 1e9 / rate,
        "fma_peak_gflops": peak,
        "matmul_fraction_of_fma_peak": rate / peak if peak else None,
        "fraction_of_fma_peak": flops / batched_s[best] / 1e9 / peak if peak else None,
        "device": str(device),
        "peak_mem_mb": peak_bytes / 2**20,
        "peak_mem_kind": "device memory allocated" if cuda else "process resident memory",
        "peak_mem_variant": f"batched {peak_of}",
        "max_loss_difference_vs_batched_eager": diffs,
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_ext.bench._soma_inference import inference_sweeps, print_sweeps

    torch.set_num_threads(args.threads)
    try:
        kind = torch.device(args.device).type
    except RuntimeError:
        print(f"bench soma: --device {args.device!r} is not a torch device; use cpu or cuda[:N]")
        return 2
    if kind == "cuda" and not torch.cuda.is_available():
        print(
            f"bench soma: --device {args.device} needs a CUDA GPU, and torch sees none "
            "(torch.cuda.is_available() is False); run with --device cpu"
        )
        return 2
    report: dict[str, Any] = {}
    parts = (not args.inference_sweep) + (not args.spsa_only)
    with progress("soma", "parts", parts, unit="part") as shown:
        if not args.inference_sweep:
            with shown.running("SPSA update: batched vs per-probe forwards"):
                report["spsa"] = _spsa(args)
            print_spsa(report["spsa"], args.threads)
        if not args.spsa_only:
            with shown.running("inference sweeps"):
                report["inference"] = inference_sweeps(args)
            print_sweeps(report["inference"])
    print(json.dumps(report, indent=2))
    write_json(report, args.json)
    return 0
