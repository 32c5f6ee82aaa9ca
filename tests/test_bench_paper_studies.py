"""Every study of ``megatron-ext bench paper`` in its ``--quick`` form, as a user runs it: exit 0,
the report's JSON keys, every claim the study declares (``CLAIM_IDS``) with its precondition
measured and no verdict (a smoke run says "smoke run: no verdicts" and prints no verdict word),
the Markdown page and every plot it lists. The study that the benchmark's
``EXAMPLE`` runs is smoke-run by ``tests/test_smoke.py`` already and is not run twice; its figure
checks live here too (``STUDY_CHECKS``) and are called from there."""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.bench.paper import EXAMPLE, JSON_KEYS, STUDIES, study_module
from megatron_ext.bench.paper.claims import SMOKE, VERDICTS
from tests.conftest import run_cli

#: the study the benchmark's EXAMPLE runs (smoke-run by tests/test_smoke.py)
EXAMPLE_STUDY = shlex.split(EXAMPLE)[3]


def check_dipaco(report: dict[str, Any], stdout: str, out: Path) -> None:
    """The figures hold what they measure: DiLoCo's 4 workers and the dense arm share every
    parameter, so re-routing cannot change their perplexity (exactly); the early-stopping
    perplexity recomputed by the study equals the trainer's own once-per-sequence figure;
    every arm ran for every seed."""
    arms, seeds = report["arms"], [str(s) for s in report["seeds"]]
    for arm in ("diloco", "dense"):
        for s in seeds:
            figures = arms[arm][s]
            assert figures["once"] == figures["w64"] == figures["w16"], (arm, s)
    for s in seeds:
        assert arms["early_stopping"][s]["on"] == pytest.approx(
            arms["dipaco_2x2"][s]["once"], rel=1e-6
        )
        assert all(s in figures for figures in arms.values())
    assert "[dipaco] seed" in stdout and report["settings"]["size"] == "quick"


#: study -> a check of its quick run's figures (report, stdout, run folder)
STUDY_CHECKS: dict[str, Callable[[dict[str, Any], str, Path], None]] = {"dipaco": check_dipaco}


def check_report(study: str, report: dict[str, Any], stdout: str, out: Path) -> None:
    """What every study's report holds; then the study's own check."""
    module = study_module(study)
    assert tuple(report) == JSON_KEYS
    assert report["study"] == study and report["size"] == "quick" and len(report["seeds"]) >= 1
    assert tuple(c["id"] for c in report["claims"]) == module.CLAIM_IDS
    assert tuple(f["id"] for f in report["facts"]) == getattr(module, "FACT_IDS", ())
    for c in report["claims"]:
        assert len(c["values"]) == len(report["seeds"]), c["id"]
        assert c["verdict"] is None, c["id"]  # a smoke run decides nothing
        assert c["paper"] and c["source"] and c["quantity"], c["id"]
        pre = c["precondition"]
        if pre is not None:  # measured on every run, met or not
            assert len(pre["measured"]) == len(report["seeds"]) and isinstance(pre["met"], bool)
            assert pre["what"] and pre["threshold"] == pre["threshold"], c["id"]
    for plot in report["plots"]:
        assert (out / plot).stat().st_size > 5_000, plot
    page = (out / f"paper_{study}.md").read_text()
    assert all(f"| {c['claim']} |" in page for c in report["claims"])
    assert "[paper] --quick: --size quick" in stdout and SMOKE in stdout and SMOKE in page
    for word in VERDICTS:
        assert word not in stdout and word not in page, word
    if study in STUDY_CHECKS:
        STUDY_CHECKS[study](report, stdout, out)


def run_quick(study: str, tmp: Path) -> tuple[dict[str, Any], str, Path]:
    """``megatron-ext bench paper STUDY --quick`` in a subprocess; (report, stdout, run folder)."""
    out = tmp / "out"
    report = tmp / "report.json"
    argv = ["bench", "paper", study, "--quick", "--out", str(out), "--json", str(report)]
    done = run_cli(argv, tmp)
    return json.loads(report.read_text()), done.stdout, out


@pytest.mark.parametrize("study", [s for s in STUDIES if s != EXAMPLE_STUDY])
def test_study_quick_run(study: str, tmp_path: Path) -> None:
    report, stdout, out = run_quick(study, tmp_path)
    check_report(study, report, stdout, out)


def _check_soma(report: dict[str, Any], stdout: str, out: Path) -> None:
    import math

    """SOMA's claims are computed from its arms: the N sweep's ends, monolith − SOMA N=2 at about
    equal size (Table 2's count) with compute-matched updates, summed − independent from one
    start, a k sweep over 1..N; every loss a finite nats/byte figure."""
    claims = {c["id"]: c for c in report["claims"]}
    for i, seed in enumerate(report["seeds"]):
        a = report["arms"][str(seed)]
        ns = sorted(a["n_sweep"], key=int)
        assert claims["scaling.more_experts_fixed_width"]["values"][i] == pytest.approx(
            a["n_sweep"][ns[0]] - a["n_sweep"][ns[-1]]
        )
        mono, soma = a["monolith"], a["soma_n2"]
        assert claims["compute.soma_n2_beats_monolith"]["values"][i] == pytest.approx(
            mono["test_loss"] - soma["test_loss"]
        )
        assert abs(soma["params"] / mono["params"] - 1) < 0.1
        # equal arithmetic compute (Eq. 21), seed runs counted, up to rounding to whole updates
        f1, f2 = mono["flops_per_token"], soma["flops_per_token"]
        work = soma["seed_updates"] * f2 + 2 * f2 * soma["updates"]
        assert abs(work - f1 * (mono["seed_updates"] + mono["updates"])) <= f2
        assert claims["shards.tfidf_beats_random"]["values"][i] == pytest.approx(
            a["shards"]["random"] - a["shards"]["tfidf"]
        )
        assert 0 < a["unigram_entropy"] < math.log(256)
        lm = a["loss_mode"]
        assert claims["mechanism.independent_beats_summed"]["values"][i] == pytest.approx(
            lm["summed"] - lm["independent"]
        )
        assert list(a["k_sweep"]) == [str(k) for k in range(1, int(ns[-1]) + 1)]
        losses = [*a["n_sweep"].values(), *a["k_sweep"].values(), *lm.values(),
                  *a["shards"].values()]  # fmt: skip
        assert all(0 < x < 10 for x in losses), losses


STUDY_CHECKS["soma"] = _check_soma


def _spike_count(values: list[float], rise: float, window: int = 20) -> int:
    """The report's spike definition, written out again: onsets of runs of steps whose value is
    above (1 + rise) × the median of the ``window`` steps before (or not finite)."""
    import statistics

    count, before = 0, False
    for t in range(window, len(values)):
        prev = sorted(values[t - window : t])
        flagged = values[t] != values[t] or values[t] > (1 + rise) * statistics.median(prev)
        count += flagged and not before
        before = flagged
    return count


def check_optimizers(report: dict[str, Any], stdout: str, out: Path) -> None:
    """The SOAP/Muon study: equal tokens on every run, the ramp arms ramp and scale the LR,
    spike counts and final losses are what the curves give, claims are the arms' differences."""
    import math
    import statistics

    s, arms = report["settings"], report["arms"]
    tokens = s["base_steps"] * s["base_batch"] * s["seq_length"]
    assert s["tokens"] == tokens and "median of the 20 steps" in s["spike_definition"]
    # quick: 3 LRs × 4 optimizers at 1×, their chosen 1× under the sweep's name, the 8 sweep
    # arms a claim reads above 1×, 4 stability arms at 2 LRs
    assert s["arms"] == len(arms) == 12 + 4 + 8 + 8
    best = s["chosen_lr_mult"]
    for o, m in best.items():  # the lowest mean validation loss of the grid, and its run
        vals = {
            g: statistics.fmean(r["val_loss"] for r in arms[f"lr.{o}.{g:.3g}"].values())
            for g in s["lr_grid"]
        }
        assert m == min(vals, key=vals.get), o
        assert arms[f"sweep.{o}.1x"] == arms[f"lr.{o}.{m:.3g}"]
    assert 0 < s["unigram_entropy"] < math.log(256)
    for name, per_seed in arms.items():
        assert set(per_seed) == {str(x) for x in report["seeds"]}, name
        for seed, r in per_seed.items():
            c = r["curve"]
            assert r["tokens"] == c["tokens"][-1] == tokens, (name, seed)  # equal tokens
            assert r["steps"] == len(c["loss"]), (name, seed)
            for key, rise in (("loss", 0.05), ("grad_norm", 1.0)):
                n = r["loss_spikes" if key == "loss" else "grad_spikes"]
                assert isinstance(n, int) and n == _spike_count(c[key], rise) >= 0, (name, key)
            tail = [v for t, v in zip(c["tokens"], c["loss"], strict=True) if t > tokens * 0.9]
            assert math.isclose(r["final_loss"], statistics.fmean(tail)), name
            assert math.isfinite(r["val_loss"]) or not math.isfinite(r["final_loss"]), name
            batches = c["global_batch"]
            opt = name.split(".")[1]
            if name.startswith("lr."):
                mult, lr = 1, s["lr"] * float(name.split(".", 2)[2])
            elif name.startswith("sweep."):
                mult, lr = int(name.split(".")[2].rstrip("x")), s["lr"] * best[opt]
            else:
                mult = s["spike_mult"]
                lr = s["lr"] * (s["spike_lr_mult"] if name.startswith("stab.") else 1)
            assert batches[-1] == mult * s["base_batch"], name
            if name.endswith(".ramp"):  # doubling from 1×, the peak LR √k × the 1× LR
                assert batches[0] == s["base_batch"] and batches == sorted(batches), name
                assert math.isclose(max(c["lr"]), lr * math.sqrt(mult), rel_tol=1e-9)
            else:
                assert set(batches) == {mult * s["base_batch"]}, name
                assert math.isclose(max(c["lr"]), lr, rel_tol=1e-3), name
    claims = {c["id"]: c for c in report["claims"]}

    def loss(arm: str, seed: int) -> float:
        return arms[arm][str(seed)]["final_loss"]

    for i, seed in enumerate(report["seeds"]):
        rise = {
            o: loss(f"sweep.{o}.4x.const", seed) - loss(f"sweep.{o}.1x", seed)
            for o in ("adamw", "muon")
        }
        q = claims["batch.adamw_rises_more_than_muon"]["values"][i]
        assert math.isclose(q, rise["adamw"] - rise["muon"], abs_tol=1e-12)
        stale, fresh = arms["stab.soap_stale"][str(seed)], arms["stab.soap_per_step"][str(seed)]
        q = claims["stale.per_step_fewer_loss_spikes"]["values"][i]
        assert q == stale["loss_spikes"] - fresh["loss_spikes"]
        q = claims["lr.muon_below_adamw_at_1x"]["values"][i]
        assert math.isclose(q, loss("sweep.adamw.1x", seed) - loss("sweep.muon.1x", seed))
        # the precondition reads the validation losses of the runs the claim compares
        worst = max(arms[f"sweep.{o}.1x"][str(seed)]["val_loss"] for o in ("adamw", "muon"))
        pre = claims["lr.muon_below_adamw_at_1x"]["precondition"]
        assert pre["measured"][i] == worst and pre["threshold"] == s["unigram_entropy"] - 0.3


STUDY_CHECKS["optimizers"] = check_optimizers
