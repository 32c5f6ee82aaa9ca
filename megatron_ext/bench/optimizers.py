"""``megatron-ext bench optimizers``: seconds per step of every optimizer on the reference workload.

Workload (fp32, :class:`Workload`): 4 layers of a d=512 GPT block — fused QKV 1536×512, proj
512×512, fc1 2048×512, fc2 512×2048 — each with 16 experts of 256×512 and 16 of 512×256: 144
matrices, 29,360,128 parameters (``--layers/--width/--experts`` change it), gradients drawn from
N(0, 1e-3²). Prints, per optimizer and mode: seconds per step (median over ``--steps`` after
``--warmup``), Newton–Schulz GFLOP/s against the machine's measured fp32 matmul rate, the
orthogonality error ‖O − UVᵀ‖_F/‖UVᵀ‖_F, and optimizer state in bytes. If Emerging-Optimizers is
importable its Muon and KL-SOAP run in the same process and the ratios (our time / theirs) are
reported. Figures only, never pass/fail.

Timing (:mod:`megatron_ext.bench._trust`): by default every mode is built first and the steps run
in rounds, one step of each mode per round in alternating order, at least ``--steps`` rounds and
more until the per-round ratios of the compared pairs (``RATIO_PAIRS``: ours / Emerging-
Optimizers') have a spread of at most ``--spread``, or ``--budget`` seconds pass; each pair's
median per-round ratio and its spread are printed and written (``repeat``). A load average above
the threads used is warned about."""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from typing import Any

from megatron_ext.bench._optimizers_report import (
    headline_ratios,
    pair_ratios,
    print_table,
    spreads,
)
from megatron_ext.bench._trust import Repeat, add_trust_arguments, load_check, round_order
from megatron_ext.bench.common import matmul_gflops as measured_matmul_gflops
from megatron_ext.bench.common import optimizer_state_bytes, progress, write_json
from megatron_ext.commands import positive_int
from megatron_ext.errors import ConfigError

DESCRIPTION = "time Muon / MOP / KL-SOAP / AdamW / Lion on the reference workload (figures + JSON)"

MODES = (
    "muon_quintic_plain",
    "muon_quintic",
    "muon_polar_express",
    "muon_quintic_cubic",
    "mop",
    "kl_soap_qr",
    "kl_soap_cholesky_qr2",
    "kl_soap_eigh",
    "kl_soap_ns_root",
    "adamw",
    "lion",
    "emerging_muon",
    "emerging_kl_soap",
)
DEFAULT_MODES = tuple(m for m in MODES if m != "kl_soap_eigh")


def all_modes() -> tuple[str, ...]:
    """:data:`MODES` (the shipped optimizers' variants and Emerging-Optimizers' peers), then
    every registered optimizer not among them by its name, built with its recipe defaults
    (``muon``, ``kl_soap``, a plugin's)."""
    from megatron_ext.optimizers import registered_optimizers

    return (*MODES, *(name for name in registered_optimizers() if name not in MODES))


def _registered_factory(name: str) -> Any:
    """``params -> optimizer``: the registered optimizer ``name`` with the keyword
    hyperparameters of a recipe's default ``optimizer:`` section naming it."""
    from megatron_ext.config import OptimizerConfig
    from megatron_ext.optimizers import build_optimizer, optimizer_spec

    kwargs = optimizer_spec(name).kwargs(OptimizerConfig(name=name))
    return lambda ps: build_optimizer(name, ps, kwargs)


@dataclass(frozen=True)
class Workload:
    """The benchmark's matrices: ``layers`` GPT blocks of width ``width`` (d), each a fused QKV
    (3d × d), proj (d × d), fc1 (4d × d), fc2 (d × 4d) and ``experts`` experts of (d/2 × d) and
    (d × d/2). The default is the reference workload: 144 matrices, 29,360,128 parameters."""

    layers: int = 4
    width: int = 512
    experts: int = 16

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Workload:
        """The workload of ``--layers/--width/--experts``; ConfigError when one is too small."""
        if args.layers < 1 or args.width < 2 or args.width % 2 or args.experts < 0:
            raise ConfigError(
                "--layers must be >= 1, --width even and >= 2, --experts >= 0; got "
                f"{args.layers}, {args.width}, {args.experts}"
            )
        return cls(args.layers, args.width, args.experts)

    def dense_shapes(self) -> tuple[tuple[int, int], ...]:
        """QKV, proj, fc1, fc2 of one block."""
        d = self.width
        return ((3 * d, d), (d, d), (4 * d, d), (d, 4 * d))

    def expert_shapes(self) -> tuple[tuple[int, int], ...]:
        """fc1, fc2 of one expert."""
        d = self.width
        return ((d // 2, d), (d, d // 2))

    def shapes(self) -> list[tuple[int, int]]:
        """Every matrix's shape, block by block, in forward order."""
        shapes: list[tuple[int, int]] = []
        for _ in range(self.layers):
            shapes.extend(self.dense_shapes())
            for shape in self.expert_shapes():
                shapes.extend([shape] * self.experts)
        return shapes

    def describe(self) -> str:
        shapes = self.shapes()
        return f"{len(shapes)} matrices, {sum(m * n for m, n in shapes):,} parameters"


QUICK = {"layers": 1, "width": 128, "experts": 2, "steps": 1, "warmup": 0, "budget": 0.0}
EXAMPLE = "megatron-ext bench optimizers --quick --json runs/bench_optimizers.json"
#: the JSON's top-level keys; ``results`` holds one entry per mode that ran
JSON_KEYS = (
    "workload",
    "machine",
    "steps",
    "warmup",
    "interleave",
    "results",
    "ratios",
    "repeat",
    "meta",
)
#: the baseline this benchmark's ratios are against (``meta.anchor`` of its JSON)
ANCHOR = (
    "Emerging-Optimizers' Muon and KL-SOAP timed in the same run (ratios: ours / theirs); "
    "GFLOP/s against the fp32 matmul rate measured in the run"
)


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """``--layers/--width/--experts`` (defaults: the reference workload)."""
    ref = Workload()
    parser.add_argument("--layers", type=int, default=ref.layers, help="GPT blocks (default 4)")
    parser.add_argument("--width", type=int, default=ref.width, help="d (default 512)")
    parser.add_argument("--experts", type=int, default=ref.experts, help="per block (default 16)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON here")
    add_workload_arguments(parser)
    parser.add_argument(
        "--steps",
        type=positive_int,
        default=3,
        help="timed steps per mode at least (default 3; more until --spread or --budget)",
    )
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.add_argument("--threads", type=positive_int, default=2, help="torch threads (default 2)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where the steps run (default cpu)"
    )
    parser.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="build every mode first and time their steps in rounds (step 1 of each mode, "
        "then step 2 in reverse order, ...), so that load from other processes hits all modes "
        "alike (default); --no-interleave runs the modes one after another, one in memory at "
        "a time",
    )
    add_trust_arguments(parser)
    parser.add_argument(
        "--modes",
        nargs="+",
        choices=all_modes(),
        default=list(DEFAULT_MODES),
        metavar="MODE",
        help=f"modes to run (default: all but kl_soap_eigh); from {all_modes()}",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    from megatron_ext.optimizers import (
        MOP,
        KLSoap,
        Lion,
        Muon,
        kl_soap_flops,
        newton_schulz,
        newton_schulz_flops,
    )

    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("bench optimizers: --steps must be >= 1, --warmup >= 0")
    workload = Workload.from_args(args)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("bench optimizers: --device cuda needs a CUDA GPU, and torch sees none")
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    shapes = workload.shapes()
    gen = torch.Generator().manual_seed(0)  # drawn on the CPU: the same values on any device
    weights = [(torch.randn(s, generator=gen) * 0.02).to(device) for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(device) for s in shapes]
    numel = sum(w.numel() for w in weights)

    emerging = _import_emerging()
    factories: dict[str, Any] = {
        "muon_quintic_plain": lambda ps: Muon(ps, coefficients="quintic", ns_method="plain"),
        "muon_quintic": lambda ps: Muon(ps, coefficients="quintic"),
        "muon_polar_express": lambda ps: Muon(ps, coefficients="polar_express"),
        "muon_quintic_cubic": lambda ps: Muon(ps, coefficients="quintic_cubic", num_steps=4),
        "mop": lambda ps: MOP(ps),
        "kl_soap_qr": lambda ps: KLSoap(ps, refresh_mode="qr"),
        "kl_soap_cholesky_qr2": lambda ps: KLSoap(ps, refresh_mode="cholesky_qr2"),
        "kl_soap_eigh": lambda ps: KLSoap(ps, refresh_mode="eigh"),
        "kl_soap_ns_root": lambda ps: KLSoap(ps, inverse_root="newton_schulz"),
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "lion": lambda ps: Lion(ps),
    }
    if emerging is not None:
        eo_muon, eo_soap = emerging
        # Emerging-Optimizers names the (3.4445, −4.7750, 2.0315) triple "simple"; it is the
        # coefficient set this project calls "quintic", so both sides run the same polynomial.
        factories["emerging_muon"] = lambda ps: eo_muon.Muon(
            ps, lr=0.02, weight_decay=0.0, fp32_matmul_prec="highest", coefficient_type="simple"
        )
        factories["emerging_kl_soap"] = lambda ps: eo_soap.SOAP(
            ps,
            lr=3e-3,
            weight_decay=0.0,
            use_kl_shampoo=True,
            fp32_matmul_prec="highest",
            qr_fp32_matmul_prec="highest",
        )

    matmul_gflops = measured_matmul_gflops(device=args.device)
    sample = _one_of_each_shape(grads)
    polar = [_polar64(torch, g) for g in sample]
    ns_settings = {  # coefficients, method, steps
        "muon_quintic_plain": ("quintic", "plain", 5),
        "muon_quintic": ("quintic", "auto", 5),
        "muon_polar_express": ("polar_express", "auto", 5),
        "muon_quintic_cubic": ("quintic_cubic", "auto", 4),
    }

    def set_grads(params: list[Any]) -> None:
        for p, g in zip(params, grads, strict=True):
            p.grad = g

    def timed_step(opt: Any, params: list[Any]) -> float:
        set_grads(params)
        sync()
        start = time.perf_counter()
        opt.step()
        sync()
        return time.perf_counter() - start

    for mode in all_modes():
        if mode not in MODES:  # a registered optimizer by its name, at its recipe defaults
            factories[mode] = _registered_factory(mode)
    modes = []
    for mode in args.modes:
        if mode in factories:
            modes.append(mode)
        else:
            print(f"{mode}: skipped (emerging-optimizers is not importable)")
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    states: dict[str, int] = {}
    load = load_check(args.threads if args.device == "cpu" else 1, "bench optimizers")
    repeat = Repeat(args.spread, args.budget, min_rounds=args.steps, max_rounds=args.max_rounds)
    if args.interleave:
        running = {}
        for mode in modes:
            params = [torch.nn.Parameter(w.clone()) for w in weights]
            running[mode] = (factories[mode](params), params)
        # the repeat rule decides the rounds: the bar counts steps, no total; it is drawn
        # between steps, never inside the clock of one
        what = f"steps, a round of {len(modes)} modes"
        with progress("optimizers", what, None, unit="step") as shown:
            for i in range(args.warmup):
                for mode, (opt, params) in running.items():
                    with shown.running(f"warm-up {i + 1}: {mode}"):
                        timed_step(opt, params)
            rounds = 0
            while True:  # rounds until every pair's ratio is tight enough (bench._trust)
                for mode in round_order(list(running), rounds):
                    with shown.running(f"round {rounds + 1}: {mode}"):
                        times[mode].append(timed_step(*running[mode]))
                rounds += 1
                if repeat.done(rounds, list(pair_ratios(times).values())):
                    break
        states = {mode: optimizer_state_bytes(opt) for mode, (opt, _) in running.items()}
        del running
    else:
        with progress("optimizers", "modes", len(modes), unit="mode") as shown:
            for mode in modes:
                params = [torch.nn.Parameter(w.clone()) for w in weights]
                opt = factories[mode](params)
                with shown.running(mode):
                    for i in range(args.warmup + args.steps):
                        elapsed = timed_step(opt, params)
                        if i >= args.warmup:
                            times[mode].append(elapsed)
                states[mode] = optimizer_state_bytes(opt)
                del opt, params
        repeat.reason = f"--no-interleave: {args.steps} steps per mode, not repeated"

    results: dict[str, dict[str, Any]] = {}
    for mode in modes:
        entry: dict[str, Any] = {
            "s_per_step": statistics.median(times[mode]),
            "s_per_step_min": min(times[mode]),
            "state_bytes": states[mode],
            "ortho_error": None,
        }
        if mode in ns_settings:
            coefficients, method, steps = ns_settings[mode]
            outs = [
                newton_schulz(g, coefficients=coefficients, method=method, num_steps=steps)
                for g in sample
            ]
            entry["ortho_error"] = _mean_error(torch, outs, polar)
            entry["ns_steps"] = steps
            flops = 0
            for m, n in shapes:
                count = {
                    kind: newton_schulz_flops(m, n, steps, kind, coefficients=coefficients)
                    for kind in ("plain", "gram")
                }
                flops += min(count.values()) if method == "auto" else count[method]
            entry["ns_gflop_per_step"] = flops / 1e9
            entry["ns_gflops"] = flops / 1e9 / entry["s_per_step"]
            entry["ns_fraction_of_matmul_rate"] = entry["ns_gflops"] / matmul_gflops
        elif mode == "kl_soap_qr":
            # the step's flop model (factor updates, triangular products, Householder QR and
            # forming Q, Adam's rotations), against the measured time
            flops = sum(kl_soap_flops(m, n) for m, n in shapes)
            entry["gflop_per_step"] = flops / 1e9
            entry["gflops"] = flops / 1e9 / entry["s_per_step"]
            entry["fraction_of_matmul_rate"] = entry["gflops"] / matmul_gflops
        elif mode == "mop":
            from megatron_ext.optimizers import polar_factor

            outs = [polar_factor(g[None])[0][0] for g in sample]
            entry["ortho_error"] = _mean_error(torch, outs, polar)
        elif mode == "emerging_muon" and emerging is not None:
            from emerging_optimizers.orthogonalized_optimizers import muon_utils

            outs = [muon_utils.newton_schulz(g, 5, "simple") for g in sample]
            entry["ortho_error"] = _mean_error(torch, outs, polar)
            flops = sum(newton_schulz_flops(m, n, 5, "plain") for m, n in shapes)
            entry["ns_gflops"] = flops / 1e9 / entry["s_per_step"]
            entry["ns_fraction_of_matmul_rate"] = entry["ns_gflops"] / matmul_gflops
        results[mode] = entry

    ratios = headline_ratios(results, matmul_gflops)
    report = {
        "workload": {
            "layers": workload.layers,
            "width": workload.width,
            "experts": workload.experts,
            "matrices": len(shapes),
            "parameters": numel,
            "grad_std": 1e-3,
        },
        "machine": {
            "device": args.device,
            "threads": args.threads,
            "matmul_gflops_fp32": matmul_gflops,
        },
        "steps": args.steps,
        "warmup": args.warmup,
        "interleave": args.interleave,
        "results": results,
        "ratios": ratios,
        "repeat": {
            **repeat.as_dict(),
            "rounds": len(next(iter(times.values()), [])),
            "pair_ratios": spreads(times),
            "load": load,
        },
    }
    print_table(report)
    write_json(report, args.json)
    return 0


def _import_emerging() -> tuple[Any, Any] | None:
    try:
        from emerging_optimizers.orthogonalized_optimizers import muon as eo_muon
        from emerging_optimizers.soap import soap as eo_soap
    except ImportError:
        return None
    return eo_muon, eo_soap


def _one_of_each_shape(grads: list[Any]) -> list[Any]:
    seen: dict[tuple[int, ...], Any] = {}
    for g in grads:
        seen.setdefault(tuple(g.shape), g)
    return list(seen.values())


def _polar64(torch: Any, g: Any) -> Any:
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    return u @ vh


def _mean_error(torch: Any, outs: list[Any], polar: list[Any]) -> float:
    errs = [
        (torch.linalg.norm(o.double() - p) / torch.linalg.norm(p)).item()
        for o, p in zip(outs, polar, strict=True)
    ]
    return sum(errs) / len(errs)
