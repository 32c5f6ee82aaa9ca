"""Float64 reference implementations of the optimizers, written from their definitions.

One matrix at a time, explicit formulas, no batching, no shortcuts: these are what the fast code
in ``megatron_ext.optimizers`` is checked against. Nothing here imports the package under test
except the published coefficient tables, which are data.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

F64 = torch.float64


# ----------------------------------------------------------------------------- Newton–Schulz
def ns_reference(x: torch.Tensor, steps: Sequence[tuple[float, float, float]]) -> torch.Tensor:
    """Plain Newton–Schulz of one matrix in float64: ``X ← aX + (bA + cA²)X``, A = XXᵀ."""
    x = x.to(F64)
    transpose = x.shape[0] > x.shape[1]
    if transpose:
        x = x.T
    x = x / max(torch.linalg.norm(x).item(), 1e-7)
    for a, b, c in steps:
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transpose else x


def polar_reference(x: torch.Tensor) -> torch.Tensor:
    """Exact polar factor ``U Vᵀ`` in float64 (singular values ≤ 1e-12·σ_max dropped)."""
    u, s, vh = torch.linalg.svd(x.to(F64), full_matrices=False)
    keep = (s > 1e-12 * s.max()).to(F64)
    return (u * keep) @ vh


def orthogonality_error(o: torch.Tensor, x: torch.Tensor) -> tuple[float, float, float]:
    """``‖O − UVᵀ‖_F/‖UVᵀ‖_F`` and the (min, max) singular values of O."""
    polar = polar_reference(x)
    o = o.to(F64)
    s = torch.linalg.svdvals(o)
    return (
        (torch.linalg.norm(o - polar) / torch.linalg.norm(polar)).item(),
        s.min().item(),
        s.max().item(),
    )


# ----------------------------------------------------------------------------- Muon / MOP
def muon_scale_reference(rows: int, cols: int, mode: str, extra: float) -> float:
    base = {
        "spectral": math.sqrt(max(rows, cols)),
        "shape": math.sqrt(max(1.0, rows / cols)),
        "unit_rms": math.sqrt(rows / cols),
    }[mode]
    return base * extra


@dataclass
class MuonReference:
    """Muon (or MOP with ``polar=True``) on one matrix, float64."""

    lr: float
    momentum: float = 0.95
    weight_decay: float = 0.0
    nesterov: bool = False
    steps: Sequence[tuple[float, float, float]] = ((3.4445, -4.7750, 2.0315),) * 5
    scale_mode: str = "spectral"
    extra: float = 1.0
    polar: bool = False
    buf: torch.Tensor | None = None

    def orth(self, m: torch.Tensor) -> torch.Tensor:
        return polar_reference(m) if self.polar else ns_reference(m, self.steps)

    def step(
        self, w: torch.Tensor, g: torch.Tensor, split_rows: Sequence[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """New W. ``split_rows``: row-index tensors of sub-matrices orthogonalised separately."""
        w, g = w.to(F64), g.to(F64)
        self.buf = (
            g.clone() * (1 - self.momentum)
            if self.buf is None
            else self.momentum * self.buf + (1 - self.momentum) * g
        )
        src = self.momentum * self.buf + (1 - self.momentum) * g if self.nesterov else self.buf
        update = torch.zeros_like(w)
        for rows in split_rows or [torch.arange(w.shape[0])]:
            block = src[rows]
            scale = muon_scale_reference(
                block.shape[0], block.shape[1], self.scale_mode, self.extra
            )
            update[rows] = scale * self.orth(block)
        return (1 - self.lr * self.weight_decay) * w - self.lr * update


# ----------------------------------------------------------------------------- KL-SOAP
@dataclass
class KLSoapReference:
    """KL-SOAP on one (m, n) matrix in float64, from the published algorithms.

    Conventions, each checked against the papers and Emerging-Optimizers' ``SOAP``:

    * factor EMA (Shampoo, SOAP Alg. 1, KL-Shampoo Alg. 2): ``shampoo_beta`` weighs the *old*
      factor, ``L ← β·L + (1 − β)·G S_R^(−p) Gᵀ/n``; with ``correct_shampoo_beta_bias`` step t uses
      ``β_t = 1 − (1 − β)/(1 − βᵗ)`` (Emerging-Optimizers' ``correct_shampoo_beta_bias``);
    * KL-Shampoo's 1/n (for L) and 1/m (for R) scales, and λ of the *other* factor in the
      eigenbasis before this step's refresh;
    * ``factor_update="shampoo"``: SOAP's plain factors (SOAP Alg. 1),
      ``L ← β·L + (1 − β)·G Gᵀ``, ``R ← β·R + (1 − β)·Gᵀ G``, same β_t, accumulated before the
      refresh like the KL ones (Emerging-Optimizers' ``SOAP(use_kl_shampoo=False)``);
    * Adam in the eigenbasis: ``m ← β1·m + (1 − β1)·G'`` (β1 weighs the old moment; the KL-SOAP
      paper's listing swaps them), bias-corrected, ``ε`` added to ``√v̂`` (absolute).

    Unlike the fast code it stores the first moment in the eigenbasis and rotates it out with the
    old basis and into the new one at every refresh, and it forms S^(−p) explicitly.
    """

    lr: float
    betas: tuple[float, float] = (0.9, 0.95)
    factor_update: str = "kl"  # or "shampoo"
    shampoo_beta: float = 0.95
    correct_shampoo_beta_bias: bool = True
    eps: float = 1e-8
    factor_eps: float = 1e-8
    p: float = 1.0
    weight_decay: float = 0.0
    refresh_every: int = 1
    stale: bool = False
    # S^(−p) = (factor + δI)^(−p), δ = ε + root_damping·‖factor‖_F, instead of from the
    # eigenbasis diagonal
    exact_root: bool = False
    root_damping: float = 1e-4
    mode: str = "qr"  # refresh: "qr" (one power-iteration step) or "eigh"
    t: int = 0
    state: dict[str, torch.Tensor] = field(default_factory=dict)

    def _init(self, m: int, n: int) -> None:
        self.state = {
            "L": torch.zeros(m, m, dtype=F64),
            "R": torch.zeros(n, n, dtype=F64),
            "QL": torch.eye(m, dtype=F64),
            "QR": torch.eye(n, dtype=F64),
            "m": torch.zeros(m, n, dtype=F64),
            "v": torch.zeros(m, n, dtype=F64),
        }

    def _inv_root(self, factor: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
        if self.exact_root:
            damping = self.factor_eps + self.root_damping * torch.linalg.norm(factor).item()
            return inverse_root_eigh(factor, round(1 / self.p), damping)
        lam = torch.diag(basis.T @ factor @ basis).clamp_min(0)
        return basis @ torch.diag((lam + self.factor_eps) ** (-self.p)) @ basis.T

    def _accumulate(self, g: torch.Tensor) -> None:
        s = self.state
        m, n = g.shape
        beta = self.shampoo_beta
        if self.correct_shampoo_beta_bias:
            beta = 1 - (1 - beta) / (1 - beta**self.t)
        if self.factor_update == "shampoo":
            s["L"] = beta * s["L"] + (1 - beta) * g @ g.T
            s["R"] = beta * s["R"] + (1 - beta) * g.T @ g
            return
        assert self.factor_update == "kl", self.factor_update
        s_r = self._inv_root(s["R"], s["QR"])
        s_l = self._inv_root(s["L"], s["QL"])
        s["L"] = beta * s["L"] + (1 - beta) / n * g @ s_r @ g.T
        s["R"] = beta * s["R"] + (1 - beta) / m * g.T @ s_l @ g

    def _refresh(self, first: bool) -> None:
        s = self.state
        m_orig = s["QL"] @ s["m"] @ s["QR"].T  # rotate out with the old basis
        for fkey, qkey, dim in (("L", "QL", 0), ("R", "QR", 1)):
            factor, basis = s[fkey], s[qkey]
            if first:
                evals, evecs = torch.linalg.eigh(factor)
                s[qkey] = evecs[:, torch.argsort(evals, descending=True)]
                continue
            approx = torch.diag(basis.T @ factor @ basis)
            order = torch.argsort(approx, descending=True)
            if self.mode == "eigh":
                evals, evecs = torch.linalg.eigh(factor)
                s[qkey] = evecs[:, torch.argsort(evals, descending=True)]
            else:
                s[qkey] = torch.linalg.qr(factor @ basis[:, order]).Q
            s["v"] = s["v"][order] if dim == 0 else s["v"][:, order]
        s["m"] = s["QL"].T @ m_orig @ s["QR"]  # and into the new one

    def step(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        w, g = w.to(F64), g.to(F64)
        if not self.state:
            self._init(*g.shape)
        self.t += 1
        s = self.state
        refresh = (self.t - 1) % self.refresh_every == 0
        if self.stale and self.t > 1:
            if refresh:
                self._refresh(first=False)
            self._accumulate(g)
        else:
            self._accumulate(g)
            if refresh:
                self._refresh(first=self.t == 1)
        b1, b2 = self.betas
        gp = s["QL"].T @ g @ s["QR"]
        s["m"] = b1 * s["m"] + (1 - b1) * gp
        s["v"] = b2 * s["v"] + (1 - b2) * gp**2
        m_hat = s["m"] / (1 - b1**self.t)
        v_hat = s["v"] / (1 - b2**self.t)
        n_mat = m_hat / (v_hat.sqrt() + self.eps)
        delta = s["QL"] @ n_mat @ s["QR"].T
        return (1 - self.lr * self.weight_decay) * w - self.lr * delta


# ----------------------------------------------------------------------------- Lion
@dataclass
class LionReference:
    lr: float
    betas: tuple[float, float] = (0.95, 0.98)
    weight_decay: float = 0.0
    m: torch.Tensor | None = None

    def step(self, w: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        w, g = w.to(F64), g.to(F64)
        if self.m is None:
            self.m = torch.zeros_like(g)
        b1, b2 = self.betas
        u = torch.sign(b1 * self.m + (1 - b1) * g)
        self.m = b2 * self.m + (1 - b2) * g
        return (1 - self.lr * self.weight_decay) * w - self.lr * u


def inverse_root_eigh(a: torch.Tensor, root: int, eps: float) -> torch.Tensor:
    """``(A + eps I)^(−1/root)`` by a float64 eigendecomposition."""
    evals, evecs = torch.linalg.eigh(a.to(F64) + eps * torch.eye(a.shape[-1], dtype=F64))
    return evecs @ torch.diag_embed(evals ** (-1.0 / root)) @ evecs.mT
