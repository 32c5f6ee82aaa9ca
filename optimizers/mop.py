"""MOP: Momentum Orthogonalized by Polar decomposition — Muon with the exact polar factor."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import torch

from .ns_iteration import newton_schulz
from .options import PolarPrecision, RMSMatch, ScaleMode, TPMode
from .orthogonalized import OrthogonalizedOptimizer
from .qkv import QKVLayout
from .tensor_parallel import TPShardInfo
from .validation import check_choice

__all__ = ["MOP", "PolarPath", "polar_factor"]

logger = logging.getLogger(__name__)

PolarPath = Literal["svd", "eigh", "newton_schulz"]

# Steps of the last-resort Newton–Schulz fallback: polar_express reaches ~1e-3 by step 6 on
# well-conditioned inputs; 10 steps also resolve singular values down to ~1e-3·σ_max.
FALLBACK_NS_STEPS = 10

_reported: set[str] = set()


def _report_once(path: PolarPath, reason: str) -> None:
    """Log the first time each fallback path is taken (it means the SVD misbehaved)."""
    if path not in _reported:
        _reported.add(path)
        logger.warning("MOP polar factor: using the %s path (%s); logged once", path, reason)


def _rank_tolerance(s: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Singular values below this count as zero (LAPACK's rank tolerance), shape ``(B, 1)``."""
    return s.amax(dim=-1, keepdim=True) * (max(m, n) * torch.finfo(s.dtype).eps)


def polar_factor(
    x: torch.Tensor, *, precision: PolarPrecision = "fp32"
) -> tuple[torch.Tensor, PolarPath]:
    """Exact polar factor ``U Vᵀ`` of each matrix of a ``(B, m, n)`` batch, with fallbacks.

    Singular values below the rank tolerance map to 0 (as Newton–Schulz maps σ = 0 to 0), so a
    zero momentum gives a zero update instead of an arbitrary orthogonal matrix.

    Paths, in order: SVD; if it raises or returns non-finite values, the eigh-based polar
    ``(X Xᵀ)^(−1/2) X`` (on the smaller Gram side); if that fails too, 10 polar_express
    Newton–Schulz steps. Each fallback is logged once per process; none raises.

    Returns:
        The ``(B, m, n)`` float32 polar factors and the path that produced them.
    """
    check_choice("precision", precision, PolarPrecision)
    dtype = torch.float64 if precision == "fp64" else torch.float32
    transpose = x.shape[-2] > x.shape[-1]
    work = (x.mT if transpose else x).to(dtype)
    m, n = work.shape[-2], work.shape[-1]

    def done(out: torch.Tensor, path: PolarPath) -> tuple[torch.Tensor, PolarPath]:
        out = out.to(torch.float32)
        return (out.mT if transpose else out), path

    try:
        u, s, vh = torch.linalg.svd(work, full_matrices=False)
        keep = (s > _rank_tolerance(s, m, n)).to(dtype)
        out = (u * keep.unsqueeze(-2)) @ vh
        if torch.isfinite(out).all():
            return done(out, "svd")
        reason = "SVD returned non-finite values"
    except RuntimeError as err:  # torch.linalg.LinAlgError is a RuntimeError
        reason = f"SVD failed: {err}"
    _report_once("eigh", reason)

    try:
        evals, evecs = torch.linalg.eigh(work @ work.mT)
        # σ² below the rank tolerance (squared) count as zero, as in the SVD path
        floor = evals.amax(dim=-1, keepdim=True).clamp_min(0) * (max(m, n) * torch.finfo(dtype).eps)
        inv_sqrt = torch.where(evals > floor, evals.clamp_min(torch.finfo(dtype).tiny).rsqrt(), 0.0)
        out = (evecs * inv_sqrt.unsqueeze(-2)) @ (evecs.mT @ work)
        if torch.isfinite(out).all():
            return done(out, "eigh")
        reason = "eigh returned non-finite values"
    except RuntimeError as err:
        reason = f"eigh failed: {err}"
    _report_once("newton_schulz", reason)
    out = newton_schulz(
        work.to(torch.float32), coefficients="polar_express", num_steps=FALLBACK_NS_STEPS
    )
    return done(out, "newton_schulz")


class MOP(OrthogonalizedOptimizer):
    """Muon with the exact polar factor from an SVD of the momentum.

    Same update as :class:`~.muon.Muon` (momentum, scale modes and ``rms_match``, decoupled
    weight decay, fused QKV split, batching) with ``X = U Vᵀ`` computed by :func:`polar_factor`
    in ``precision``.

    Tensor parallelism (``tp_shards``): ``tp_mode`` ``duplicated`` (default; the SVD of the
    gathered full matrix, TP=1 update) or ``blockwise`` (each shard alone). There is no
    ``distributed`` mode: an exact SVD does not decompose into per-shard products.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        precision: PolarPrecision = "fp32",
        scale_mode: ScaleMode = "spectral",
        extra_scale_factor: float = 1.0,
        rms_match: RMSMatch = "constant",
        qkv_layout: QKVLayout | None = None,
        tp_mode: TPMode = "duplicated",
        tp_shards: Mapping[torch.Tensor, TPShardInfo] | None = None,
        max_batch_numel: int | None = None,
    ) -> None:
        defaults = dict(
            lr=lr,
            momentum=momentum,
            weight_decay=weight_decay,
            nesterov=nesterov,
            precision=precision,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            rms_match=rms_match,
            qkv_layout=qkv_layout,
            tp_mode=tp_mode,
        )
        super().__init__(params, defaults, max_batch_numel=max_batch_numel, tp_shards=tp_shards)
        self.last_path: PolarPath | None = None

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        check_choice("precision", group["precision"], PolarPrecision)

    def orthogonalize(self, x: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        out, self.last_path = polar_factor(x, precision=group["precision"])
        return out
