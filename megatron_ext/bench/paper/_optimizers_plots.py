"""The PNGs of ``megatron-ext bench paper optimizers``: final loss vs batch per optimizer (without
and with the ramp), and the loss / gradient-norm curves of the stability arms with their spike
onsets marked (stale vs per-step refresh, plain Shampoo vs KL factors, QR vs eigh)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from megatron_ext.atomic import save_figure
from megatron_ext.bench.paper._optimizers_arms import MULTS, OPTIMIZERS, Scale
from megatron_ext.optimizers import optimizer_spec

__all__ = ["plot_all"]

Results = dict[str, dict[str, dict[str, Any]]]


def _sweep_arm(opt: str, k: int, mode: str) -> str:
    return f"sweep.{opt}.1x" if k == 1 else f"sweep.{opt}.{k}x.{mode}"


def plot_sweep(results: Results, scale: Scale, seeds: list[int], path: Path) -> None:
    """Final loss (mean over seeds, bars = seed range) vs global batch, one line per optimizer;
    left without the ramp (1× LR), right with the ramp + √B LR."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.3), sharey=True)
    batches = [k * scale.base_batch for k in MULTS]
    for ax, mode, title in zip(
        axes,
        ("const", "ramp"),
        ("no ramp, 1× LR (Fig. 7)", "doubling ramp + √B LR (Fig. 2, 10)"),
        strict=True,
    ):
        for opt in OPTIMIZERS:
            ks = [k for k in MULTS if _sweep_arm(opt, k, mode) in results]  # quick: claims' arms
            vals = [
                [results[_sweep_arm(opt, k, mode)][str(s)]["final_loss"] for s in seeds] for k in ks
            ]
            mean = [statistics.fmean(v) for v in vals]
            err = [
                [m - min(v) for m, v in zip(mean, vals, strict=True)],
                [max(v) - m for m, v in zip(mean, vals, strict=True)],
            ]
            xs = [k * scale.base_batch for k in ks]
            ax.errorbar(
                xs, mean, yerr=err, marker="o", capsize=3, label=optimizer_spec(opt).display
            )
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [f"{k}× ({b})" for k, b in zip(MULTS, batches, strict=True)])
        ax.set_xlabel("global batch (sequences), equal tokens")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel(f"final loss (nats/token, last {scale.final_frac:.0%} of tokens)")
    fig.suptitle(
        f"loss vs batch at {scale.tokens:,} tokens per run ({len(seeds)} seeds)", fontsize=10
    )
    save_figure(fig, path)


def plot_pair(
    results: Results,
    arms: tuple[str, str],
    labels: tuple[str, str],
    seeds: list[int],
    path: Path,
    title: str,
    show_time: bool = False,
) -> None:
    """Loss (top) and gradient norm (bottom) vs tokens of two arms, every seed, spike onsets
    marked with crosses; ``show_time``: each run's median optimizer-step time in its label."""
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    colors = ("tab:red", "tab:blue")
    for arm, label, color in zip(arms, labels, colors, strict=True):
        for i, s in enumerate(seeds):
            r = results[arm][str(s)]
            c = r["curve"]
            tag = f"{label} ({r['loss_spikes']} loss / {r['grad_spikes']} grad spikes, seed {s}"
            tag += f", {r['optimizer_s'] * 1e3:.0f} ms/optimizer step)" if show_time else ")"
            style = "-" if i == 0 else ":"
            top.plot(c["tokens"], c["loss"], style, lw=0.9, color=color, label=tag)
            bottom.plot(c["tokens"], c["grad_norm"], style, lw=0.9, color=color)
            for ax, key, steps in (
                (top, "loss", r["loss_spike_steps"]),
                (bottom, "grad_norm", r["grad_spike_steps"]),
            ):
                ax.plot(
                    [c["tokens"][t] for t in steps],
                    [c[key][t] for t in steps],
                    "x",
                    ms=7,
                    color=color,
                )
    top.set_ylabel("training loss (nats/token)")
    bottom.set_ylabel("gradient norm (before clipping)")
    bottom.set_yscale("log")
    bottom.set_xlabel("consumed tokens")
    top.set_title(title + "\n× = spike onsets (definition in the report)", fontsize=9)
    top.legend(fontsize=7)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    save_figure(fig, path)


def plot_all(results: Results, scale: Scale, seeds: list[int], out: Path) -> list[str]:
    """Write every PNG into ``out``; their names, relative to ``out``."""
    import matplotlib

    matplotlib.use("Agg")
    setting = f"{scale.spike_mult}× batch, {scale.spike_lr_mult:g}× LR"
    plot_sweep(results, scale, seeds, out / "optimizers_batch_sweep.png")
    plot_pair(
        results,
        ("stab.soap_stale", "stab.soap_per_step"),
        ("stale refresh (every 10, without G_t)", "per-step QR (with G_t)"),
        seeds,
        out / "optimizers_stale_spikes.png",
        f"SOAP (Shampoo factors), stale vs per-step refresh, {setting} (paper: Fig. 4–5)",
    )
    plot_pair(
        results,
        ("stab.soap_per_step", "stab.kl_soap_qr"),
        ("plain Shampoo factors", "KL-Shampoo factors"),
        seeds,
        out / "optimizers_kl_spikes.png",
        f"per-step QR: plain Shampoo vs KL factors, {setting} (paper: Fig. 6)",
    )
    plot_pair(
        results,
        ("stab.kl_soap_eigh", "stab.kl_soap_qr"),
        ("eigh refresh", "QR refresh"),
        seeds,
        out / "optimizers_refresh.png",
        f"KL-SOAP, eigh vs QR refresh, {setting} (Alg. 2)",
        show_time=True,
    )
    return [
        "optimizers_batch_sweep.png",
        "optimizers_stale_spikes.png",
        "optimizers_kl_spikes.png",
        "optimizers_refresh.png",
    ]
