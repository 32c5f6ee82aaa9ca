"""Eigenbasis refresh of Kronecker factors: one power-iteration step ``Q ← orth(L·Q)``.

All functions take batches: factors ``(B, k, k)`` (symmetric PSD), bases ``(B, k, k)`` with
orthonormal columns. Three ways to refresh:

* ``qr``: Householder QR of ``(L + δI)·Q`` (the paper's default, with a tiny shift δ, below);
* ``eigh``: a full symmetric eigendecomposition of ``L`` (always used at the first refresh);
* ``cholesky_qr2``: QR through two Cholesky factorisations of the Gram matrix ``ZᵀZ`` — only
  matmuls, a Cholesky and triangular solves, which GPUs run far faster than Householder QR. The
  columns of ``Z = L·Q`` are scaled to unit norm first: QR is invariant to positive column
  scaling (``Z D = Q (R D)``), and for a nearly converged basis the scaled Z is nearly
  orthonormal, so the squared condition number that Cholesky-QR suffers from stays small. If a
  Cholesky fails anyway (e.g. a rank-deficient factor gives a zero column) the batch is redone
  with ``qr`` and the fallback is logged once.

Columns are kept sorted by decreasing approximate eigenvalue ``diag(Qᵀ L Q)`` before each
refresh: orthogonal iteration converges to eigenvectors in decreasing order, so an unsorted
basis would be rotated away from a fixed point it already holds.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch

from .validation import check_choice

__all__ = [
    "RefreshMode",
    "approximate_eigenvalues",
    "cholesky_qr2",
    "eigh_descending",
    "refresh_eigenbasis",
]

logger = logging.getLogger(__name__)

RefreshMode = Literal["qr", "eigh", "cholesky_qr2"]

# δ/λ_max of the shift in the power-iteration refresh: well above fp32 rounding of L·Q (~1e-7)
# and far below the eigenvalue gaps that matter for the preconditioner.
REFRESH_SHIFT = 1e-5

_reported: set[str] = set()


def _report_once(key: str, message: str) -> None:
    if key not in _reported:
        _reported.add(key)
        logger.warning("%s (logged once)", message)


def approximate_eigenvalues(factor: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``diag(Qᵀ L Q)`` of a batch, shape ``(B, k)``, without forming ``Qᵀ L Q``."""
    return (basis * torch.bmm(factor, basis)).sum(dim=-2)


def eigh_descending(factor: torch.Tensor) -> torch.Tensor:
    """Eigenvectors of symmetric ``(B, k, k)`` matrices, columns by decreasing eigenvalue.

    If the fp32 solver fails to converge the batch is solved in float64 (logged once).
    """
    try:
        _, vectors = torch.linalg.eigh(factor)
    except RuntimeError as err:  # torch.linalg.LinAlgError
        _report_once("eigh64", f"eigh failed in {factor.dtype} ({err}); solving in float64")
        _, vectors = torch.linalg.eigh(factor.to(torch.float64))
        vectors = vectors.to(factor.dtype)
    return vectors.flip(-1)


def cholesky_qr2(z: torch.Tensor) -> torch.Tensor | None:
    """Orthonormal Q with ``Z = Q·R`` (R upper triangular, positive diagonal), or None.

    Two passes of Cholesky-QR on column-normalised Z; returns None if a Cholesky fails for any
    matrix in the batch (the caller then falls back to Householder QR).
    """
    norms = torch.linalg.vector_norm(z, dim=-2, keepdim=True)
    if not bool((norms > 0).all()):
        return None
    q = z / norms
    for _ in range(2):
        chol, info = torch.linalg.cholesky_ex(q.mT @ q)  # QᵀQ = C Cᵀ, so R = Cᵀ
        if bool((info != 0).any()):
            return None
        # Q ← Q R⁻¹ = Q C⁻ᵀ: solve X·Cᵀ = Q for X
        q = torch.linalg.solve_triangular(chol.mT, q, upper=True, left=False)
    return q


def refresh_eigenbasis(
    factor: torch.Tensor, basis: torch.Tensor, mode: RefreshMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """New eigenbasis of ``factor`` starting from ``basis``, and the column order used.

    Args:
        factor: ``(B, k, k)`` symmetric PSD Kronecker factor (already including this step).
        basis: ``(B, k, k)`` current orthonormal basis.
        mode: ``qr``, ``eigh`` or ``cholesky_qr2``.

    Returns:
        ``(new_basis, order)`` where ``order`` ``(B, k)`` sorts the old columns by decreasing
        ``diag(Qᵀ L Q)``. Column j of the new basis continues old column ``order[j]``: state
        indexed by basis columns (Adam's second moment) must be permuted with ``order``.
    """
    if mode == "eigh":
        order = torch.argsort(approximate_eigenvalues(factor, basis), dim=-1, descending=True)
        return eigh_descending(factor), order
    z = torch.bmm(factor, basis)
    approx = (basis * z).sum(dim=-2)
    order = torch.argsort(approx, dim=-1, descending=True)
    # Power iteration with L + δI (same eigenvectors, δ = 1e-5·λ_max): directions in L's null
    # space (a factor built from a few gradients is rank-deficient) keep their old basis column
    # instead of an arbitrary completion that changes every step, and Cholesky-QR stays well
    # conditioned.
    shift = REFRESH_SHIFT * approx.abs().amax(dim=-1, keepdim=True)
    z = torch.take_along_dim(z.add_(basis * shift.unsqueeze(-2)), order.unsqueeze(-2), dim=-1)
    if mode == "cholesky_qr2":
        q = cholesky_qr2(z)
        if q is not None:
            return q, order
        _report_once("cholqr2", "cholesky_qr2 eigenbasis refresh: Cholesky failed; using qr")
    else:
        check_choice("refresh_mode", mode, RefreshMode)
    return torch.linalg.qr(z).Q, order
