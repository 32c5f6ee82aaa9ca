"""``megatron-ext bench paper optimizers``: the SOAP/Muon paper's comparisons (Vavre et al.,
``soap-muon-and-beyond.txt``) at CPU scale, claim by claim.

Corpus: the English prose of the Python Language Reference shipped with Python
(``data.source=[python-docs]``, byte tokens), built on first use. Every run goes through the normal
launcher (``megatron-ext launch tiny_cpu_gpt ...``, :func:`~megatron_ext.bench.common.launch_run`)
with the overrides of :mod:`._optimizers_arms`, once per seed (``seed=1, 2, ...``: the model's
initialisation and the data order):

(a) **LR sweep, then large-batch sweep** (Sec. 3.2, 5.2, 5.3, 5.5; Fig. 1–2, 7, 8, 10): AdamW,
    Muon, MOP and KL-SOAP at 1× the baseline batch at each LR of ``Scale.lr_grid``; each
    optimizer's LR is the one with the lowest mean validation loss (the paper tunes per
    optimizer); then 2×, 4× the batch at equal tokens at that LR, with the k× batch from the
    first step (``const``, Fig. 7) and with the doubling ramp + √B LR (``ramp``, Fig. 2, 10).
    Final loss = mean training loss over the steps in the last 10% of the tokens (the paper
    compares training losses, Sec. 5.3); validation loss after the last step on 64 fixed
    sequences (the LR choice and the preconditions).
(b) **stale vs per-step refresh** (Sec. 5.4.1–5.4.2, Fig. 4–5): SOAP (plain Shampoo factors)
    refreshed every 10 steps from factors without the current gradient, vs per step with it, at
    4× the baseline batch, both at the reference LR and (full size) at 30× it, the lowest LR at
    which a pilot saw the stale arm spike; spikes counted by the fixed definition
    :data:`~._optimizers_arms.SPIKE_DEFINITION` (chosen before any run).
(c) **KL vs plain Shampoo factors** (Sec. 5.4.3, Fig. 6): per-step SOAP vs KL-SOAP, same settings.
(d) **eigh vs QR refresh** (Alg. 2 lines 10–11): KL-SOAP's final loss with one QR power step vs
    an eigendecomposition per refresh (a claim); their optimizer-step times (a fact: QR is the
    cheap one by construction).

Every claim's precondition: each run it reads ends with a validation loss >= 0.3 nats/byte
below the corpus' byte-unigram entropy (:func:`corpus_unigram_entropy`).

Scales (``--size``; :data:`~._optimizers_arms.SCALES`):

- ``full``: the recipe's demo GPT (4 layers, d = 128, 4 heads / 2 KV groups, SwiGLU 384,
  886 K parameters incl. byte embeddings), seq 128, baseline batch 8 sequences (1 K tokens),
  256 steps at 1× = 262 K tokens per run; only the sweep arms a claim reads; 27–28 runs per
  seed (12 LR-sweep, 8 batch-sweep, 8 stability; identical settings run once), two at a time,
  one rank and one thread each. Estimated 35–40 min for 3 seeds on a quiet 2-core machine
  from the run of 2026-12-04 (48 runs of 320 steps in 25.0–27.9 min: ~33 s per run at two
  jobs, ~4.5 s of it the launcher's start-up); not yet run under these settings.
- ``quick``: a 1-layer d = 32 model (34 K parameters), seq 32, 32 steps of 4 sequences (4 K
  tokens), every claim (23 runs per seed): a smoke run, no verdicts. Its time is the launcher's
  start-up (~9 CPU-s per run), not training: 13 min wall for 1 seed on this shared machine at
  load average 11–30 under ``nice -n 10`` (2026-12-05).

Claims that do not reproduce here are reported so: no setting was tuned to make one pass.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

from megatron_ext.bench.paper._optimizers_arms import (
    GRAD_SPIKE_RISE,
    LOSS_SPIKE_RISE,
    OPTIMIZERS,
    RECIPE,
    SCALES,
    SPIKE_DEFINITION,
    Arm,
    Scale,
    arm_overrides,
    arms,
    final_loss,
    lr_arms,
    lr_name,
    spike_onsets,
    stability_arms,
    sweep_arms,
)
from megatron_ext.bench.paper._optimizers_claims import CLAIM_IDS, FACT_IDS, claims
from megatron_ext.bench.paper.report import StudyResult
from megatron_ext.errors import ConfigError

__all__ = ["CLAIM_IDS", "FACT_IDS", "PAPER", "TITLE", "run_study", "summarize_run"]

PAPER = "soap-muon-and-beyond.txt"
TITLE = "SOAP, Muon and beyond (Vavre et al.): the paper's optimizer comparisons at CPU scale"


def summarize_run(run_dir: Path, scale: Scale) -> dict[str, Any]:
    """One run's figures from its ``metrics.jsonl``: final loss, spike counts and onsets, step
    times, and the curves they were computed from (every step)."""
    from megatron_ext.bench.common import read_metrics

    train, evals = read_metrics(run_dir)
    curve = {
        "tokens": [r["consumed_tokens"] for r in train],
        "loss": [r["loss"] for r in train],
        "grad_norm": [r["grad_norm"] for r in train],
        "lr": [r["lr"] for r in train],
        "global_batch": [r["global_batch"] for r in train],
    }
    loss_on = spike_onsets(curve["loss"], LOSS_SPIKE_RISE)
    grad_on = spike_onsets(curve["grad_norm"], GRAD_SPIKE_RISE)
    timed = train[1:] or train  # the first step pays for compilation and allocation
    return {
        "steps": train[-1]["step"],
        "tokens": train[-1]["consumed_tokens"],
        "final_loss": final_loss(curve["tokens"], curve["loss"], scale.final_frac),
        # after the last step, on the same validation sequences for every arm (nats/byte)
        "val_loss": evals[-1]["val_loss"] if evals else math.nan,
        "loss_spikes": len(loss_on),
        "grad_spikes": len(grad_on),
        "loss_spike_steps": loss_on,
        "grad_spike_steps": grad_on,
        "max_grad_norm": max(curve["grad_norm"]),
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "optimizer_s": statistics.median(r["optimizer_s"] for r in timed),
        "curve": curve,
    }


def finished_run(run_dir: Path, scale: Scale) -> tuple[float, float]:
    """``(start, end)`` wall-clock times (epoch s) of a run that consumed the study's tokens:
    its ``summary.json``'s time, less the run's elapsed and start-up seconds. A run that is
    missing or did not finish is a ``ConfigError`` naming it (``--from-runs``)."""
    from megatron_ext.bench.common import read_metrics

    summary = run_dir / "summary.json"
    train = read_metrics(run_dir)[0] if summary.is_file() else []
    if not train or train[-1]["consumed_tokens"] != scale.tokens:
        raise ConfigError(
            f"--from-runs: {run_dir} is not a finished run of {scale.tokens:,} tokens; run the "
            "study without --from-runs"
        )
    figures = json.loads(summary.read_text())
    end = summary.stat().st_mtime
    return end - figures["elapsed_s"] - figures["startup_s"]["total"], end


def _run_arms(
    scale: Scale,
    arm_list: list[Arm],
    seeds: list[int],
    out: Path,
    stage: str,
    spans: list[tuple[float, float]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Every arm × seed of ``arm_list`` through the launcher, ``scale.jobs`` at a time; the
    results by arm and seed, in the order of ``arm_list``. Arms whose overrides are identical
    (e.g. KL-SOAP at 4× in the stability and the batch sweep) are one run, reported under each
    name. A seed's stability arms are queued side by side, so the QR and eigh step times are
    taken under similar load. ``stage`` names them on the progress bar. ``spans`` given
    (``--from-runs``): no run is launched; each finished run's (start, end) is appended."""
    from megatron_ext.bench.common import launch_run, progress

    runs: dict[tuple[str, ...], tuple[Arm, int]] = {}  # overrides -> the first arm that has them
    names: dict[tuple[str, ...], list[tuple[str, int]]] = {}
    for seed in seeds:
        for arm in arm_list:
            key = tuple(arm_overrides(scale, arm, seed))
            runs.setdefault(key, (arm, seed))
            names.setdefault(key, []).append((arm.name, seed))

    def one(key: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, Any]]:
        arm, seed = runs[key]
        run_dir = out / "runs" / arm.name / f"seed{seed}"
        if spans is not None:
            spans.append(finished_run(run_dir, scale))
        else:
            with shown.running(f"{arm.name} seed {seed}"):  # beside the pool's others
                launch_run(RECIPE, list(key), run_dir, f"{arm.name} seed {seed}")
        result = summarize_run(run_dir, scale)
        also = [n for n, _ in names[key] if n != arm.name]
        print(
            f"[optimizers] {arm.name} seed {seed}: final loss {result['final_loss']:.4f}, "
            f"validation {result['val_loss']:.4f}, {result['steps']} steps, "
            f"{result['tokens']:,} tokens, spikes loss {result['loss_spikes']} / grad "
            f"{result['grad_spikes']}" + (f" (also {', '.join(also)})" if also else ""),
            flush=True,
        )
        return key, result

    results: dict[str, dict[str, Any]] = {}
    with (
        progress("paper", f"optimizers, {stage}", len(runs)) as shown,
        ThreadPoolExecutor(max_workers=scale.jobs) as pool,
    ):
        for key, result in pool.map(one, list(runs)):
            for name, seed in names[key]:
                results.setdefault(name, {})[str(seed)] = result
    return {a.name: results[a.name] for a in arm_list}


def choose_lr(scale: Scale, results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per optimizer, the LR multiple of ``scale.lr_grid`` whose 1× runs have the lowest
    validation loss, averaged over the seeds (a diverged run counts as +inf)."""

    def mean_val(opt: str, m: float) -> float:
        vals = [r["val_loss"] for r in results[lr_name(opt, m)].values()]
        return statistics.fmean(vals) if all(math.isfinite(v) for v in vals) else math.inf

    return {o: min(scale.lr_grid, key=lambda m, o=o: mean_val(o, m)) for o in OPTIMIZERS}


def _run_all(
    scale: Scale, seeds: list[int], out: Path, spans: list[tuple[float, float]] | None = None
) -> tuple[dict[str, dict[str, Any]], dict[str, float]]:
    """Stage 1 (the LR sweep at 1× and the stability arms), the choice of each optimizer's LR,
    stage 2 (the batch sweep at it); every result by arm, the 1× run of the chosen LR also as
    ``sweep.<opt>.1x``; and the chosen LR multiples. ``spans``: see :func:`_run_arms`."""
    first = _run_arms(
        scale,
        [*lr_arms(scale), *stability_arms(scale)],
        seeds,
        out,
        "LR sweep and stability",
        spans,
    )
    best = choose_lr(scale, first)
    print(
        "[optimizers] LR chosen on validation loss (× the reference "
        f"{scale.lr:g}): " + ", ".join(f"{o} {m:.3g}" for o, m in best.items()),
        flush=True,
    )
    second = _run_arms(scale, sweep_arms(scale, best), seeds, out, "batch sweep", spans)
    chosen = {f"sweep.{o}.1x": first[lr_name(o, m)] for o, m in best.items()}
    return {**first, **chosen, **second}, best


def run_study(
    size: Literal["quick", "full"], seeds: list[int], out: Path, from_runs: bool = False
) -> StudyResult:
    """Run every arm of ``size`` for each seed; the claims, the runs' figures and the plots.
    ``from_runs``: launch nothing, read the finished runs under ``out`` (the report rebuilt,
    e.g. after a fix to a claim; ``wall_s`` is then the runs' own span, from their files)."""
    from megatron_ext.bench.paper._optimizers_plots import plot_all

    scale = SCALES[size]
    n_runs = len({tuple(arm_overrides(scale, a, 1)) for a in arms(scale)}) * len(seeds)
    print(
        f"[optimizers] {size}: about {n_runs} runs of {scale.tokens:,} tokens each "
        f"({scale.num_layers} layers, d={scale.hidden_size})"
        + (", read from their finished folders (--from-runs)" if from_runs else ""),
        flush=True,
    )
    start = time.perf_counter()
    spans: list[tuple[float, float]] | None = [] if from_runs else None
    results, best = _run_all(scale, seeds, out, spans)
    wall = time.perf_counter() - start
    if spans:  # from the first run's launch to the last run's end, as the runs recorded them
        wall = max(e for _, e in spans) - min(s for s, _ in spans)
    entropy = corpus_unigram_entropy()
    settings = {
        **scale.settings(),
        "arms": len(results),
        "runs": len({id(r) for per in results.values() for r in per.values()}),
        "wall_s": round(wall, 1),
        "from_runs": from_runs,
        "chosen_lr_mult": best,
        "unigram_entropy": entropy,
    }
    plots = plot_all(results, scale, seeds, out)
    notes = [
        *(
            [
                "Report rebuilt from the study's finished runs (--from-runs): no run was "
                "launched; wall_s is the runs' span, from the first launch to the last end "
                "(their summary.json times less elapsed and start-up)."
            ]
            if from_runs
            else []
        ),
        f"Spikes: {SPIKE_DEFINITION}.",
        "Equal tokens: every arm consumes "
        f"{scale.tokens:,} tokens (checked from each run's consumed_tokens).",
        "Batch sweep 'const': the k× batch from the first step at the 1× LR (Fig. 7 used no "
        "ramp; its LR at 2×/4× is not stated). 'ramp': doubling from the 1× batch every "
        f"{scale.ramp_double_every} steps, warmup tied to the ramp, η ∝ √B at every stage.",
        f"Scale: a {scale.num_layers}-layer d={scale.hidden_size} dense GPT on ~0.5 MB of English "
        "prose, not the paper's 0.6–72 B models on trillions of tokens; the stability arms "
        f"(b)–(d) run at {scale.spike_mult}× the baseline batch, both at the reference LR "
        f"(stab1x.*) and at {scale.spike_lr_mult:g}× it (stab.*)"
        + (" (the lowest spiking LR of a pilot: see below)." if scale.notes else "."),
        "Step times (d) were taken while the other runs of the study (and, on a shared machine, "
        "other jobs) used the cores: read them as same-run ratios.",
        *scale.notes,
    ]
    notes.append(
        "Arms with identical settings (e.g. stab1x.kl_soap_qr and sweep.kl_soap.4x.const when "
        "KL-SOAP's chosen LR is the reference) are one run per seed, reported under each name."
    )
    if scale.grid == "claims":
        notes.append(
            "This size runs only the sweep arms a claim reads (1× and 4× of every optimizer, 4× "
            "ramp of AdamW, Muon and KL-SOAP, 2× ramp of Muon); the plot shows those points."
        )
    notes.append(
        "LR: each optimizer's 1× runs at "
        + ", ".join(f"{m:.3g}" for m in scale.lr_grid)
        + f" × {scale.lr:g}; its batch sweep at the multiple with the lowest mean validation "
        "loss over the seeds (chosen: "
        + ", ".join(f"{o} {m:.3g}" for o, m in best.items())
        + "). The 1× figures the claims read are those runs (the choice and the claims share "
        "the seeds)."
    )
    found, facts = claims(results, seeds, best, entropy)
    return StudyResult(found, settings, results, plots, notes, facts)


def corpus_unigram_entropy() -> float:
    """The byte-unigram entropy (nats/byte) of the study's corpus: the loss of a model that knows
    only the byte frequencies (:func:`~megatron_ext.bench.paper.claims.byte_unigram_entropy`)."""
    from megatron_ext.bench.paper.claims import byte_unigram_entropy
    from megatron_ext.data import python_docs_documents

    counts = [0] * 256
    for doc in python_docs_documents():
        for b, n in enumerate(np.bincount(np.frombuffer(doc.encode(), np.uint8), minlength=256)):
            counts[b] += int(n)
    return byte_unigram_entropy(counts)
