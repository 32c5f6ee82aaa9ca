"""How noisy is the SPSA gradient of an expert? Measured against the exact gradient.

At fixed weights ``θ`` the estimator ``ĝ = (1/k)·Σ_j [L(θ+εz_j) − L(θ−εz_j)]/(2ε)·z_j`` is drawn
``R`` times with fresh probes (the real path: :func:`~megatron_ext.zo.probes.probe_matrix`,
:func:`~megatron_ext.zo.spsa.perturb`, :func:`~megatron_ext.soma.model.batched_loss`,
:func:`~megatron_ext.zo.spsa.spsa_estimate`), and its relative centered variance
``(1/(R−1))·Σ_r ‖ĝ_r − ḡ‖² / ‖g‖²`` is compared with the exact gradient ``g`` (autograd through
the LSTM). For small ε, ``ĝ ≈ (1/k)·Σ_j (z_jᵀg)·z_j`` and, with ``q_j = E[z_j²]`` and
``s = Σ_j q_j``, the fourth moments of the sparse Rademacher probes give::

    E‖ĝ − E ĝ‖² / ‖g‖² = Σ_j q_j·(1 + s − 2q_j)·g_j² / (k·‖g‖²)

(:func:`predicted_variance`). Training N experts on the sum of their losses with one probe over
all their bodies puts every other expert's directional derivative into each expert's estimate,
so the variance grows about N-fold over independent estimates (:func:`summed_vs_independent`).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from megatron_ext.atomic import atomic_path, save_figure
from megatron_ext.soma.layout import BodyLayout
from megatron_ext.soma.model import batched_loss
from megatron_ext.zo.probes import probe_rows, second_moments
from megatron_ext.zo.spsa import loss_differences, perturb, spsa_estimate

# Bodies evaluated per batched_loss call when many repeats are stacked into one forward.
BODIES_PER_CALL = 2048


def exact_gradient(
    theta: torch.Tensor, emb: torch.Tensor, tokens: torch.Tensor, layout: BodyLayout
) -> torch.Tensor:
    """(numel,) gradient of the mean next-byte cross-entropy (nats) w.r.t. the body, by autograd
    through the LSTM, in ``theta``'s dtype; ``tokens`` (B, T+1)."""
    with torch.enable_grad():
        leaf = theta.detach().clone().requires_grad_(True)
        loss = batched_loss(leaf[None], emb.detach(), tokens, layout)[0]
        (grad,) = torch.autograd.grad(loss, leaf)
    return grad


def _group_differences(
    thetas: torch.Tensor,
    emb: torch.Tensor,
    tokens: torch.Tensor,
    layout: BodyLayout,
    probes: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """(N, m) loss differences ``L_e(θ_e+εz_i) − L_e(θ_e−εz_i)`` of N experts along m probes.

    thetas (N, numel); tokens (N, B, T+1), expert e on tokens[e]; probes (m, N·numel), expert
    e's block of row i is its own probe. One batched forward per expert for all 2m bodies."""
    n_exp, numel = thetas.shape
    out = []
    for e in range(n_exp):
        bodies = perturb(thetas[e], probes[:, e * numel : (e + 1) * numel], eps)
        out.append(loss_differences(batched_loss(bodies, emb, tokens[e], layout)))
    return torch.stack(out)


def _narrow_only(layout: BodyLayout) -> None:
    """The estimators here perturb every coordinate of the body vector; a wide body's head is
    never perturbed in training (it is updated by the delta rule), so measuring it here would
    measure another estimator."""
    if layout.shape.wide:
        raise ValueError(
            "variance measurements need a narrow body (d_model == d_embed): a wide body's head "
            "is not SPSA-perturbed in training"
        )


def _groups(repeats: int, n_pert: int) -> Iterator[range]:
    """Repeats in groups whose perturbed bodies fit one batched forward."""
    if n_pert < 1 or repeats < 1:
        raise ValueError(f"need n_pert >= 1 and repeats >= 1, got {n_pert} and {repeats}")
    size = max(1, BODIES_PER_CALL // (2 * n_pert))
    for start in range(0, repeats, size):
        yield range(start, min(start + size, repeats))


def estimator_samples(
    theta: torch.Tensor,
    emb: torch.Tensor,
    tokens: torch.Tensor,
    layout: BodyLayout,
    *,
    n_pert: int,
    eps: float,
    repeats: int,
    seed: int,
    expert: int = 0,
) -> torch.Tensor:
    """(repeats, numel) independent SPSA estimates at ``theta`` (numel,), ``tokens`` (B, T+1).

    Repeat ``r`` uses the probes of update ``r`` (batch 0, directions ``0..n_pert-1``) of
    ``expert``; the bodies of many repeats share one batched forward."""
    _narrow_only(layout)
    mask = layout.gain_mask.to(theta.device)
    out = theta.new_empty(repeats, layout.numel)
    for reps in _groups(repeats, n_pert):
        keys = [(seed, expert, r, 0, j) for r in reps for j in range(n_pert)]
        z = probe_rows(keys, mask, dtype=theta.dtype)
        diffs = _group_differences(theta[None], emb, tokens[None], layout, z, eps)[0]
        for i, r in enumerate(reps):
            rows = slice(i * n_pert, (i + 1) * n_pert)
            out[r] = spsa_estimate(diffs[rows], z[rows], eps)
    return out


def relative_centered_variance(samples: torch.Tensor, g: torch.Tensor) -> float:
    """``(1/(R−1))·Σ_r ‖ĝ_r − mean‖² / ‖g‖²`` for samples (R, n) and the exact gradient (n,)."""
    if samples.dim() != 2 or samples.shape[0] < 2:
        raise ValueError(f"need at least two samples (R, n), got {tuple(samples.shape)}")
    s = samples.double()
    dev = s - s.mean(dim=0)
    return float(dev.pow(2).sum() / (s.shape[0] - 1) / g.double().pow(2).sum())


def relative_standard_error(samples: torch.Tensor) -> float:
    """Sampling error of :func:`relative_centered_variance` itself, relative to it: the standard
    error of the mean of ``‖ĝ_r − mean‖²`` over the R samples (R, n), divided by that mean."""
    s = samples.double()
    dev = (s - s.mean(dim=0)).pow(2).sum(dim=1)
    return float(dev.std() / dev.mean() / math.sqrt(s.shape[0]))


def predicted_variance(g: torch.Tensor, q: torch.Tensor, n_pert: int) -> float:
    """Small-ε relative centered variance ``Σ_j q_j(1 + s − 2q_j)g_j² / (n_pert·‖g‖²)``,
    ``s = Σ_j q_j``, for probes with second moments ``q`` (n,)."""
    g2, q = g.double().pow(2), q.double()
    return float((q * (1.0 + q.sum() - 2.0 * q) * g2).sum() / (n_pert * g2.sum()))


def summed_vs_independent(
    thetas: torch.Tensor,
    emb: torch.Tensor,
    tokens: torch.Tensor,
    layout: BodyLayout,
    *,
    n_pert: int,
    eps: float,
    repeats: int,
    seed: int,
) -> dict[str, float]:
    """Relative centered variance of the N experts' concatenated gradient, two ways.

    thetas (N, numel) bodies, tokens (N, B, T+1): expert ``e`` sees its own batch.
    ``independent``: each expert its own probes and its own loss differences (the SOMA way).
    ``summed``: ONE probe over the N concatenated bodies (the concatenation of the experts' own
    probes) and one finite difference of the sum of the N losses.
    Both are measured on the concatenated (N·numel,) estimate against the exact concatenated
    gradient; ``predicted_*`` are the small-ε values, ``*_rel_se`` the measurements' relative
    standard errors (:func:`relative_standard_error`), ``ratio`` = summed / independent.
    """
    _narrow_only(layout)
    n_exp = thetas.shape[0]
    if tokens.dim() != 3 or tokens.shape[0] != n_exp:
        raise ValueError(f"tokens must be (N={n_exp}, B, T+1), got {tuple(tokens.shape)}")
    grads = torch.stack([exact_gradient(thetas[e], emb, tokens[e], layout) for e in range(n_exp)])
    numel = layout.numel
    mask = layout.gain_mask.to(thetas.device)
    indep = thetas.new_empty(repeats, n_exp * numel)
    summed = thetas.new_empty(repeats, n_exp * numel)
    for reps in _groups(repeats, n_pert):
        # The joint probe is the concatenation of the experts' own probes, so both modes see
        # the same directions and the same per-expert loss differences: the independent
        # estimates use expert e's own differences, the summed one their sum over experts (what
        # the trainer's summed mode gathers).
        z = torch.cat(
            [
                probe_rows([(seed, e, r, 0, j) for r in reps for j in range(n_pert)], mask,
                           dtype=thetas.dtype)
                for e in range(n_exp)
            ],
            dim=1,
        )  # fmt: skip
        diffs = _group_differences(thetas, emb, tokens, layout, z, eps)  # (N, reps·k)
        for i, r in enumerate(reps):
            rows = slice(i * n_pert, (i + 1) * n_pert)
            for e in range(n_exp):
                cols = slice(e * numel, (e + 1) * numel)
                indep[r, cols] = spsa_estimate(diffs[e, rows], z[rows, cols], eps)
            summed[r] = spsa_estimate(diffs[:, rows].sum(0), z[rows], eps)
    q = second_moments(layout.gain_mask)
    g_all = grads.reshape(-1)
    g2 = grads.double().pow(2)
    s = q.sum()
    # Independent: expert e's probes only see s over its own body.
    pred_indep = float((q * (1.0 + s - 2.0 * q) * g2).sum() / (n_pert * g2.sum()))
    result = {
        "independent": relative_centered_variance(indep, g_all),
        "summed": relative_centered_variance(summed, g_all),
        "independent_rel_se": relative_standard_error(indep),
        "summed_rel_se": relative_standard_error(summed),
        "predicted_independent": pred_indep,
        "predicted_summed": predicted_variance(g_all, q.repeat(n_exp), n_pert),
    }
    result["ratio"] = result["summed"] / result["independent"]
    result["predicted_ratio"] = result["predicted_summed"] / result["predicted_independent"]
    return result


def write_report(
    rows: Sequence[dict[str, Any]], csv_path: str | Path, png_path: str | Path
) -> None:
    """Write the measurements as CSV and as a figure (PNG), each atomically (temp file, rename).

    Every row needs ``experiment`` (one panel per distinct value), ``x`` (a number: plotted on
    log-log axes, or a label: plotted as bars), ``measured`` and optionally ``predicted``; other
    keys are written to the CSV only. Columns are the union of the rows' keys in first-seen
    order."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    csv_path, png_path = Path(csv_path), Path(png_path)
    with atomic_path(csv_path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)

    experiments = list(dict.fromkeys(row["experiment"] for row in rows))
    fig, axes = plt.subplots(1, len(experiments), figsize=(5 * len(experiments), 4), squeeze=False)
    for ax, name in zip(axes[0], experiments, strict=True):
        sel = [row for row in rows if row["experiment"] == name]
        xs = [row["x"] for row in sel]
        measured = [float(row["measured"]) for row in sel]
        predicted = [float(row.get("predicted", math.nan)) for row in sel]
        if all(isinstance(x, int | float) for x in xs):
            ax.loglog(xs, measured, "o-", label="measured")
            if not all(math.isnan(p) for p in predicted):
                ax.loglog(xs, predicted, "k--", label="predicted (small ε)")
            ax.set_xticks(xs, [str(x) for x in xs])
            ax.minorticks_off()
            ax.set_xlabel(sel[0].get("x_label", "x"))
        else:
            pos = range(len(xs))
            ax.bar([p - 0.2 for p in pos], measured, width=0.4, label="measured")
            ax.bar([p + 0.2 for p in pos], predicted, width=0.4, label="predicted (small ε)")
            ax.set_xticks(list(pos), [str(x) for x in xs])
            ax.set_yscale("log")
        ax.set_ylabel("relative centered variance")
        ax.set_title(name)
        ax.legend()
    save_figure(fig, png_path, dpi=100)


def measure_paper_claims(
    out_dir: str | Path,
    *,
    n_perts: Sequence[int] = (1, 2, 4, 8),
    probes_per_point: int = 4800,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The estimator's variance claims at a small, exactly differentiable scale (float64,
    ε = 1e-5, d = 8, one block, V = 32, B = 2, T = 8): measured vs predicted relative centered
    variance for each ``n_pert`` (the 1/n_pert law), and independent vs summed losses over 4
    experts. Writes ``variance.csv`` and ``variance.png`` to ``out_dir``; returns the rows."""
    from megatron_ext.soma.layout import ExpertShape, init_body, init_embedding
    from megatron_ext.zo.probes import second_moments

    shape = ExpertShape(vocab=32, d_embed=8, d_model=8, num_blocks=1)
    layout = BodyLayout.from_shape(shape)
    gen = torch.Generator().manual_seed(seed)
    theta = init_body(shape, gen, dtype=torch.float64)
    gains = int(layout.gain_mask.sum())
    theta[layout.gain_mask] += 0.2 * torch.randn(gains, generator=gen, dtype=torch.float64)
    emb = init_embedding(shape, gen, dtype=torch.float64)
    tokens = torch.randint(0, shape.vocab, (2, 9), generator=gen)
    g = exact_gradient(theta, emb, tokens, layout)
    q = second_moments(layout.gain_mask)
    rows: list[dict[str, Any]] = []
    for k in n_perts:
        repeats = max(2, probes_per_point // k)
        samples = estimator_samples(
            theta, emb, tokens, layout, n_pert=k, eps=1e-5, repeats=repeats, seed=seed + 3
        )
        rows.append(
            {
                "experiment": "n_pert law",
                "x": k,
                "x_label": "n_pert",
                "measured": relative_centered_variance(samples, g),
                "predicted": predicted_variance(g, q, k),
                "repeats": repeats,
            }
        )
    thetas = theta + 0.1 * torch.randn(4, layout.numel, generator=gen, dtype=torch.float64)
    batches = torch.randint(0, shape.vocab, (4, 2, 9), generator=gen)
    repeats = max(2, probes_per_point * 5 // 8)  # 3000 at the default 4800
    r = summed_vs_independent(
        thetas, emb, batches, layout, n_pert=1, eps=1e-5, repeats=repeats, seed=seed + 11
    )
    for mode in ("independent", "summed"):
        rows.append(
            {
                "experiment": "4 experts",
                "x": mode,
                "x_label": "loss mode",
                "measured": r[mode],
                "predicted": r[f"predicted_{mode}"],
                "repeats": repeats,
            }
        )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_report(rows, out / "variance.csv", out / "variance.png")
    return rows
