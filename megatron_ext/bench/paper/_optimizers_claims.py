"""The claims of ``megatron-ext bench paper optimizers``, computed from the runs' figures
(``results[arm][seed]``, :func:`.optimizers.summarize_run`).

Each claim's Q is signed so that the paper's claim is ``Q > 0`` (or ``Q ≈ 0`` within a tolerance
fixed here, with its reason). Final losses are training losses in nats/token (= nats/byte: byte
tokens), the paper compares training losses (Sec. 5.3); ``rise(opt, mode)`` is ``loss(opt, 4×,
mode) − loss(opt, 1×)`` at equal tokens. Every claim's precondition: the validation loss of each
run it reads is at least :data:`~.claims.UNIGRAM_MARGIN` nats/byte below the corpus' byte-unigram
entropy (for the stability arms: "the spike setting also trains").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from megatron_ext.bench.paper._optimizers_arms import smoothed_tokens_to
from megatron_ext.bench.paper.claims import Claim, Fact, Precondition, below_unigram

__all__ = ["CLAIM_IDS", "FACT_IDS", "FIG8_RELATIVE_TOLERANCE", "REFRESH_LOSS_TOLERANCE", "claims"]

#: |loss(QR) − loss(eigh)| that still counts as equal (nats/token), fixed before any run: ~1% of
#: a trained loss here (~1.8 nats/byte), the scale the paper calls "slight" (Fig. 8 inset < 1%)
REFRESH_LOSS_TOLERANCE = 0.02
#: |loss(X) / loss(Muon) − 1| that counts as "within ~1%" (Fig. 8 inset: relative difference
#: < 1%), fixed before any run
FIG8_RELATIVE_TOLERANCE = 0.01
#: the stability settings: claim-id prefix suffix and arm prefix
STAB_SETTINGS = (("", "stab"), ("1x", "stab1x"))

_STAB_IDS = (
    "stale.per_step_fewer_loss_spikes",
    "stale.per_step_fewer_grad_spikes",
    "stale.per_step_lower_loss",
    "kl.fewer_loss_spikes",
    "kl.fewer_grad_spikes",
    "kl.lower_loss",
    "refresh.qr_matches_eigh_loss",
)
CLAIM_IDS = (
    "lr.muon_below_adamw_at_1x",
    "tokens.adamw_needs_more_than_muon_at_4x",
    "tokens.adamw_needs_more_than_kl_soap_at_4x",
    "batch.adamw_rises_more_than_muon",
    "batch.adamw_rises_more_than_kl_soap",
    "batch.adamw_rises_more_than_mop",
    "ramp.adamw_rises_more_than_muon",
    "ramp.adamw_rises_more_than_kl_soap",
    "ramp.muon_2x_below_adamw_1x",
    "fig8.mop_below_muon",
    "fig8.kl_soap_below_muon",
    "fig8.mop_within_1pct_of_muon",
    "fig8.kl_soap_within_1pct_of_muon",
    "fig7.kl_soap_below_muon_at_4x",
    *_STAB_IDS,
    *(i.replace(".", "1x.", 1) for i in _STAB_IDS),
)
FACT_IDS = ("refresh.eigh_step_over_qr_step",)

Results = dict[str, dict[str, dict[str, Any]]]


def claims(
    results: Results, seeds: list[int], best: dict[str, float], entropy: float
) -> tuple[list[Claim], list[Fact]]:
    """Every claim of :data:`CLAIM_IDS`, in that order, from ``results`` (``best``: the chosen LR
    multiples, for the notes; ``entropy``: the corpus' byte-unigram entropy, nats/byte), each with
    its precondition; and the facts of :data:`FACT_IDS`."""

    def per_seed(fn: Callable[[Callable[[str, str], float]], float]) -> list[float]:
        def values(seed: int) -> float:
            return fn(lambda arm, key: float(results[arm][str(seed)][key]))

        return [values(s) for s in seeds]

    def loss(opt: str, k: int, mode: str = "const") -> Callable[[Callable], float]:
        name = f"sweep.{opt}.1x" if k == 1 else f"sweep.{opt}.{k}x.{mode}"
        return lambda get: get(name, "final_loss")

    def rise(opt: str, mode: str) -> Callable[[Callable], float]:
        return lambda get: loss(opt, 4, mode)(get) - loss(opt, 1)(get)

    def rise_gap(other: str, mode: str) -> list[float]:
        return per_seed(lambda get: rise("adamw", mode)(get) - rise(other, mode)(get))

    def diff(a: str, b: str, key: str) -> list[float]:
        return per_seed(lambda get: get(a, key) - get(b, key))

    def ratio(a: str, b: str) -> list[float]:
        return per_seed(lambda get: get(a, "final_loss") / get(b, "final_loss") - 1)

    def efficiency(opt: str, seed: int) -> float:
        """ln(tokens to the target at 4× / at 1×); the target: the 1× run's smoothed loss at
        half its tokens (so the 1× run reaches it by then)."""
        one, four = (
            results[f"sweep.{opt}.1x"][str(seed)],
            results[f"sweep.{opt}.4x.const"][str(seed)],
        )
        c1, c4 = one["curve"], four["curve"]
        half = [i for i, t in enumerate(c1["tokens"]) if t <= c1["tokens"][-1] / 2]
        target = _window_mean(c1["tokens"][: half[-1] + 1], c1["loss"][: half[-1] + 1], FRAC)
        t1 = smoothed_tokens_to(c1["tokens"], c1["loss"], target, FRAC)
        t4 = smoothed_tokens_to(c4["tokens"], c4["loss"], target, FRAC)
        return math.log(t4 / t1) if math.isfinite(t4) else math.inf

    def tokens_gap(other: str) -> list[float]:
        return [efficiency("adamw", s) - efficiency(other, s) for s in seeds]

    rise_q = "rise(AdamW) − rise({}) ; rise = loss(4×) − loss(1×), nats/token, equal tokens"
    lr_note = "each optimizer at its own LR, chosen on validation loss at 1× (× the reference): "
    lr_note += ", ".join(f"{o} {m:.3g}" for o, m in best.items())
    eff_q = (
        "ln(T4/T1)(AdamW) − ln(T4/T1)({}); Tk = tokens until the k× run's training loss "
        f"(mean over the last {FRAC:.0%} of tokens) reaches the 1× run's at half its tokens"
    )
    out = [
        Claim(
            "lr.muon_below_adamw_at_1x",
            "Muon reaches a lower loss than AdamW at the baseline batch, each at its tuned LR",
            "Sec. 5.3; Fig. 1, 2",
            "Fig. 1/2: Muon's 1× curve below AdamW's 1× curve (curves only)",
            "loss(AdamW, 1×) − loss(Muon, 1×), nats/token, each at its chosen LR",
            per_seed(lambda get: loss("adamw", 1)(get) - loss("muon", 1)(get)),
            note=lr_note,
        ),
        Claim(
            "tokens.adamw_needs_more_than_muon_at_4x",
            "beyond the critical batch AdamW needs more tokens to reach a loss; Muon keeps its "
            "token efficiency",
            "Sec. 5.3; Fig. 1, 7",
            "Fig. 1: Muon at 2×/3× the batch reaches the AdamW 1× loss in the same tokens; AdamW "
            "'fails to scale effectively' (no number printed)",
            eff_q.format("Muon") + " (no ramp)",
            tokens_gap("muon"),
            note="inf: a 4× run that never reached its target within the run",
        ),
        Claim(
            "tokens.adamw_needs_more_than_kl_soap_at_4x",
            "SOAP keeps token efficiency at large batches where AdamW degrades",
            "Sec. 1, 5.5, 7; Fig. 7",
            "Fig. 7: KL-SOAP at 1×, 2×, 4× GBS (curves only)",
            eff_q.format("KL-SOAP") + " (no ramp)",
            tokens_gap("kl_soap"),
        ),
        Claim(
            "batch.adamw_rises_more_than_muon",
            "AdamW degrades beyond a critical batch size; Muon keeps token efficiency at larger "
            "batches",
            "Sec. 5.3; Fig. 1, 7",
            "Fig. 1: Muon at 2×/3× the batch reaches the AdamW 1× baseline's loss; AdamW 'fails "
            "to scale effectively' (no number printed)",
            rise_q.format("Muon") + " (no ramp, each at its chosen LR)",
            rise_gap("muon", "const"),
        ),
        Claim(
            "batch.adamw_rises_more_than_kl_soap",
            "SOAP, like Muon, keeps token efficiency at large batches where AdamW degrades",
            "Sec. 1, 5.5, 7; Fig. 7",
            "Fig. 7: KL-SOAP at 1×, 2×, 4× GBS, slightly below Muon throughout (curves only)",
            rise_q.format("KL-SOAP") + " (no ramp, each at its chosen LR)",
            rise_gap("kl_soap", "const"),
        ),
        Claim(
            "batch.adamw_rises_more_than_mop",
            "MOP (Muon with the exact polar factor) scales with the batch like Muon",
            "Sec. 5.5; Fig. 8",
            "Fig. 8: MOP slightly below Muon at a 24 M-token batch (curves only)",
            rise_q.format("MOP") + " (no ramp, each at its chosen LR)",
            rise_gap("mop", "const"),
        ),
        Claim(
            "ramp.adamw_rises_more_than_muon",
            "with the batch ramp and √B LR, Muon uses the larger batch; the same techniques do "
            "not help AdamW",
            "Sec. 5.3; Fig. 2, 3, 10; App. C",
            "Fig. 10: AdamW at 50 M (ramp + √B) above its 25 M baseline; Fig. 2: Muon at 2× "
            "below AdamW 1× (curves only)",
            rise_q.format("Muon") + " (ramp + √B LR)",
            rise_gap("muon", "ramp"),
        ),
        Claim(
            "ramp.adamw_rises_more_than_kl_soap",
            "with the ramp and √B LR, KL-SOAP degrades less with the batch than AdamW",
            "Sec. 5.3, 5.5; Fig. 7, 10",
            "no ramp figure for SOAP; by the paper's conclusion (Sec. 7) SOAP scales like Muon",
            rise_q.format("KL-SOAP") + " (ramp + √B LR)",
            rise_gap("kl_soap", "ramp"),
        ),
        Claim(
            "ramp.muon_2x_below_adamw_1x",
            "Muon at 2× the batch (with the ramp) ends below the AdamW 1× baseline",
            "Sec. 5.3; Fig. 2",
            "Fig. 2: 72B-A8B, 1 T tokens: Muon 2× has lower loss and no spikes vs AdamW 1× "
            "(inset, curves only)",
            "loss(AdamW, 1×) − loss(Muon, 2×, ramp + √B LR), nats/token",
            per_seed(lambda get: loss("adamw", 1)(get) - loss("muon", 2, "ramp")(get)),
        ),
        Claim(
            "fig8.mop_below_muon",
            "MOP has slightly lower loss than Muon",
            "Sec. 5.5; Fig. 8",
            "Fig. 8: Qwen-3-30B-A3B, 24 M-token batch: MOP slightly below Muon (inset: relative "
            "difference < 1%)",
            "loss(Muon, 1×) − loss(MOP, 1×), nats/token",
            per_seed(lambda get: loss("muon", 1)(get) - loss("mop", 1)(get)),
        ),
        Claim(
            "fig8.kl_soap_below_muon",
            "KL-SOAP keeps a slight edge over Muon in CE loss",
            "Sec. 5.5; Fig. 8",
            "Fig. 8: SOAP slightly below Muon through most of the run (inset < 1%)",
            "loss(Muon, 1×) − loss(KL-SOAP, 1×), nats/token",
            per_seed(lambda get: loss("muon", 1)(get) - loss("kl_soap", 1)(get)),
        ),
        Claim(
            "fig8.mop_within_1pct_of_muon",
            "MOP and Muon end within ~1% of each other",
            "Sec. 5.5; Fig. 8",
            "Fig. 8 inset: relative difference MOP vs Muon < 1%",
            "loss(MOP, 1×) / loss(Muon, 1×) − 1",
            ratio("sweep.mop.1x", "sweep.muon.1x"),
            expect="equal",
            tolerance=FIG8_RELATIVE_TOLERANCE,
            note=f"tolerance {FIG8_RELATIVE_TOLERANCE:.0%}: the paper's inset bound",
        ),
        Claim(
            "fig8.kl_soap_within_1pct_of_muon",
            "KL-SOAP and Muon end within ~1% of each other",
            "Sec. 5.5; Fig. 8",
            "Fig. 8 inset: relative difference SOAP vs Muon < 1%",
            "loss(KL-SOAP, 1×) / loss(Muon, 1×) − 1",
            ratio("sweep.kl_soap.1x", "sweep.muon.1x"),
            expect="equal",
            tolerance=FIG8_RELATIVE_TOLERANCE,
            note=f"tolerance {FIG8_RELATIVE_TOLERANCE:.0%}: the paper's inset bound",
        ),
        Claim(
            "fig7.kl_soap_below_muon_at_4x",
            "at 4× the batch (no ramp) KL-SOAP stays slightly below Muon",
            "Sec. 5.5; Fig. 7 (bottom)",
            "Fig. 7 bottom: 4× GBS, SOAP below Muon (inset: relative difference, curves only)",
            "loss(Muon, 4×) − loss(KL-SOAP, 4×), no ramp, nats/token",
            per_seed(lambda get: loss("muon", 4)(get) - loss("kl_soap", 4)(get)),
        ),
        *_stability_claims(diff, "", "stab"),
        *_stability_claims(diff, "1x", "stab1x"),
    ]
    assert tuple(c.id for c in out) == CLAIM_IDS
    out = [replace(c, precondition=_precondition(c.id, results, seeds, entropy)) for c in out]
    facts = [
        Fact(
            "refresh.eigh_step_over_qr_step",
            "optimizer-step time of KL-SOAP with eigh over with QR, minus 1 (medians per run; the "
            "QR refresh is the cheap one by construction, the reason Alg. 2 uses it; step times "
            "taken with other runs of the study sharing the cores)",
            tuple(
                per_seed(
                    lambda get: (
                        get("stab.kl_soap_eigh", "optimizer_s")
                        / get("stab.kl_soap_qr", "optimizer_s")
                        - 1
                    )
                )
            ),
            "ratio − 1",
        )
    ]
    return out, facts


#: the window of the smoothed loss for the tokens-to-target claims, × the run's tokens
FRAC = 0.1


def _window_mean(tokens: list[int], loss: list[float], frac: float) -> float:
    span = tokens[-1] * frac
    return statistics.fmean(v for t, v in zip(tokens, loss, strict=True) if t > tokens[-1] - span)


def _reads(claim_id: str) -> list[str]:
    """The arms whose runs a claim reads (for its precondition)."""
    stab = "stab1x" if "1x." in claim_id.split(".", 1)[0] + "." else "stab"
    if claim_id.startswith(("stale", "kl", "refresh")):
        pairs = {"stale": ("soap_stale", "soap_per_step"), "kl": ("soap_per_step", "kl_soap_qr"),
                 "refresh": ("kl_soap_qr", "kl_soap_eigh")}  # fmt: skip
        return [f"{stab}.{a}" for a in pairs[claim_id.split(".")[0].removesuffix("1x")]]
    names = {
        "lr.muon_below_adamw_at_1x": ["adamw.1x", "muon.1x"],
        "tokens.adamw_needs_more_than_muon_at_4x": ["adamw.1x", "adamw.4x.const", "muon.1x",
                                                    "muon.4x.const"],
        "tokens.adamw_needs_more_than_kl_soap_at_4x": ["adamw.1x", "adamw.4x.const", "kl_soap.1x",
                                                       "kl_soap.4x.const"],
        "ramp.muon_2x_below_adamw_1x": ["adamw.1x", "muon.2x.ramp"],
        "fig7.kl_soap_below_muon_at_4x": ["muon.4x.const", "kl_soap.4x.const"],
    }  # fmt: skip
    if claim_id in names:
        return [f"sweep.{n}" for n in names[claim_id]]
    if claim_id.startswith("batch."):
        other = claim_id.removeprefix("batch.adamw_rises_more_than_")
        return [f"sweep.{o}.{k}" for o in ("adamw", other) for k in ("1x", "4x.const")]
    if claim_id.startswith("ramp."):
        other = claim_id.removeprefix("ramp.adamw_rises_more_than_")
        return [f"sweep.{o}.{k}" for o in ("adamw", other) for k in ("1x", "4x.ramp")]
    assert claim_id.startswith("fig8."), claim_id
    x = "mop" if "mop" in claim_id else "kl_soap"
    return [f"sweep.{x}.1x", "sweep.muon.1x"]


def _precondition(
    claim_id: str, results: Results, seeds: list[int], entropy: float
) -> Precondition:
    """Every run the claim reads ends with a validation loss at least UNIGRAM_MARGIN below the
    corpus' byte-unigram entropy (per seed: the worst of those runs)."""
    reads = _reads(claim_id)
    worst = [max(float(results[a][str(s)]["val_loss"]) for a in reads) for s in seeds]
    return below_unigram(f"worst validation loss of {', '.join(reads)}", worst, entropy)


def _stability_claims(diff: Callable, tag: str, arm: str) -> list[Claim]:
    """The stale/KL/refresh claims at one stability setting (``arm``: ``stab`` = the spike LR,
    ``stab1x`` = the reference LR; ``tag``: the claim-id suffix)."""
    setting = "spike LR" if arm == "stab" else "reference LR"
    found = [
        Claim(
            f"stale{tag}.per_step_fewer_loss_spikes",
            "a stale preconditioner (refresh every 10 steps, current gradient excluded) gives "
            "loss spikes that per-step refresh with the current gradient removes",
            "Sec. 5.4.1–5.4.2; Fig. 4, 5",
            "Fig. 4: 621M dense, 12.5 M-token batch, lr 3e-3: oscillating loss spikes with the "
            "stale refresh; Fig. 5: 8B diverges; per-step: none",
            "loss spikes(stale) − loss spikes(per step), count (SOAP, Shampoo factors)",
            diff(f"{arm}.soap_stale", f"{arm}.soap_per_step", "loss_spikes"),
        ),
        Claim(
            f"stale{tag}.per_step_fewer_grad_spikes",
            "the stale refresh's loss spikes are preceded by gradient-norm spikes, absent per step",
            "Sec. 5.4.1; Fig. 4",
            "Fig. 4: oscillating weight-gradient norms before each loss spike",
            "grad-norm spikes(stale) − grad-norm spikes(per step), count",
            diff(f"{arm}.soap_stale", f"{arm}.soap_per_step", "grad_spikes"),
        ),
        Claim(
            f"stale{tag}.per_step_lower_loss",
            "per-step refresh with the current gradient ends at a lower loss than the stale one",
            "Sec. 5.4.1; Fig. 5",
            "Fig. 5: 8B dense: large loss gaps of stale SOAP vs the per-step baseline",
            "loss(stale) − loss(per step), nats/token",
            diff(f"{arm}.soap_stale", f"{arm}.soap_per_step", "final_loss"),
        ),
        Claim(
            f"kl{tag}.fewer_loss_spikes",
            "KL-Shampoo factors suppress the loss spikes of plain Shampoo accumulation",
            "Sec. 5.4.3; Fig. 6",
            "Fig. 6: Qwen-3-30B-A3B: fewer loss spikes with KL (curves only)",
            "loss spikes(Shampoo factors) − loss spikes(KL factors), count, per-step QR",
            diff(f"{arm}.soap_per_step", f"{arm}.kl_soap_qr", "loss_spikes"),
        ),
        Claim(
            f"kl{tag}.fewer_grad_spikes",
            "KL-Shampoo factors stabilise training (gradient norms)",
            "Sec. 5.4.3; Fig. 6; App. A.3",
            "κ(S_KL) = √κ(S_Shampoo) (Eq. 4, 13); no gradient-norm figure",
            "grad-norm spikes(Shampoo factors) − grad-norm spikes(KL factors), count",
            diff(f"{arm}.soap_per_step", f"{arm}.kl_soap_qr", "grad_spikes"),
        ),
        Claim(
            f"kl{tag}.lower_loss",
            "KL-Shampoo factors give a lower final training loss",
            "Sec. 5.4.3; Fig. 6",
            "Fig. 6: lower training loss with KL (curves only)",
            "loss(Shampoo factors) − loss(KL factors), nats/token",
            diff(f"{arm}.soap_per_step", f"{arm}.kl_soap_qr", "final_loss"),
        ),
        Claim(
            f"refresh{tag}.qr_matches_eigh_loss",
            "one QR power step per refresh tracks the eigenbasis as well as an eigendecomposition",
            "Alg. 2 lines 10–11; Sec. 5.4.3",
            "Alg. 2 refreshes by Q = QR(L·Q).Q; 'whether using QR or eigendecomposition-based "
            "eigensolvers' (no loss figure)",
            "loss(QR) − loss(eigh), nats/token",
            diff(f"{arm}.kl_soap_qr", f"{arm}.kl_soap_eigh", "final_loss"),
            expect="equal",
            tolerance=REFRESH_LOSS_TOLERANCE,
            note=f"tolerance {REFRESH_LOSS_TOLERANCE} nats/token, fixed before any run",
        ),
    ]
    return [replace(c, quantity=f"{c.quantity}; {setting} ({arm}.*)") for c in found]
