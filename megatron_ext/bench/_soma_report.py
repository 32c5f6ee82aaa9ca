"""The printed SPSA figures of ``bench soma`` (split from :mod:`megatron_ext.bench.soma`)."""

from __future__ import annotations

from typing import Any


def print_spsa(spsa: dict[str, Any], threads: int) -> None:
    s = spsa["shape"]
    print(
        f"SPSA losses of {2 * s['n_pert']} perturbed bodies (d={s['d_model']}, D={s['blocks']}, "
        f"{s['body_parameters']:,} params), B={s['batch']} T={s['seq']}, on {spsa['device']}"
        f"{f', {threads} threads' if spsa['device'] == 'cpu' else ''}, fastest of "
        f"{spsa['rounds']} rounds ({spsa['repeat']['stopped']})"
    )
    if not spsa["fused_available"]:
        print(f"  fused scan UNAVAILABLE ({spsa['fused_unavailable_reason']})")
    if not spsa["native_available"] and spsa["device"] == "cpu":
        print(f"  native C recurrence UNAVAILABLE ({spsa['native_unavailable_reason']})")
    tokens = s["perturbed_tokens_per_update"]
    print(f"  {'':24s} {'s/update':>10s} {'perturbed tok/s':>16s}")
    for name, sec in spsa["anchors_s"].items():
        tag = " (anchor)" if name == spsa["naive_anchor"] else ""
        print(f"  {name + ' loop' + tag:24s} {sec:10.3f} {tokens / sec:16,.0f}")
    for name, sec in spsa["batched_variants_s"].items():
        print(f"  {'batched ' + name:24s} {sec:10.3f} {tokens / sec:16,.0f}")
    fused = spsa["fused_vs_eager"]
    print(
        f"  speedup {spsa['speedup']:.2f}x (batched {spsa['batched_best']}) vs the "
        f"{spsa['naive_anchor']} loop, target >= 2x; eager {spsa['speedup_eager']:.2f}x"
        + (f"; fused/eager {fused:.2f}x" if fused else "")
        + (f"; native/eager {spsa['native_vs_eager']:.2f}x" if spsa["native_vs_eager"] else "")
        + f"; {spsa['speedup_vs_own_kernels_loop']:.2f}x vs the own-kernels loop"
    )
    per_round = spsa["speedup_rounds"]
    spread = "n/a" if per_round["spread"] is None else f"±{100 * per_round['spread']:.1f}%"
    print(f"  speedup per round: median {per_round['median']:.2f}x ({spread})")
    print(
        f"  ceiling here {spsa['speedup_ceiling']:.1f}x (the anchor at {spsa['naive_gflops']:.1f} "
        f"GFLOP/s vs matmul {spsa['matmul_gflops']:.1f}): reached "
        f"{spsa['fraction_of_ceiling']:.0%} (target >= 55%); batched {spsa['gflops']:.1f} GFLOP/s"
        f" = {spsa['fraction_of_matmul_rate']:.0%} of matmul; peak +{spsa['peak_mem_mb']:.0f} MB"
        f" ({spsa['peak_mem_variant']})"
    )
    if spsa["fma_peak_gflops"]:
        print(
            f"  FMA peak of the kernels' vectors {spsa['fma_peak_gflops']:.1f} GFLOP/s: "
            f"batched {spsa['fraction_of_fma_peak']:.0%} of it, torch's matmul "
            f"{spsa['matmul_fraction_of_fma_peak']:.0%}"
            + (
                " (slower than the batched forward: the ceiling above is no ceiling on this CPU)"
                if spsa["fraction_of_ceiling"] > 1
                else ""
            )
        )
    print(
        "  max |loss - batched eager| "
        + ", ".join(f"{k} {v:.1e}" for k, v in spsa["max_loss_difference_vs_batched_eager"].items())
    )
