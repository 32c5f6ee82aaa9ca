"""Eigenbasis refresh of Kronecker factors: one power-iteration step ``Q ← orth(L·Q)``.

All functions take batches: bases ``(B, k, k)`` with orthonormal columns and, instead of the
symmetric PSD factor ``L`` itself, its product with the basis ``P = L·Q`` (``(B, k, k)``). The
product is what the refresh needs (the power-iteration step is ``orth(P)``), its diagonal in the
basis gives the approximate eigenvalues ``diag(Qᵀ L Q) = diag(Qᵀ P)`` without a ``k³`` product,
and after a Householder QR ``(L + δI)·Q̃ = Q_new·R`` the new product comes from the triangular
factor: ``L·Q_new = Q̃·Rᵀ − δ·Q_new`` (``L + δI = Q̃ Rᵀ Q_newᵀ`` because ``Q̃`` is orthogonal and
``L`` symmetric) — a triangular product, half the flops of forming ``L·Q_new``. The factor itself
is ``L = P·Qᵀ`` (:func:`factor_from_product`), needed only by the ``eigh`` refresh.

Three ways to refresh:

* ``qr``: Householder QR of ``(L + δI)·Q`` (the paper's default, with a tiny shift δ, below):
  LAPACK's ``geqrf`` computes the reflectors, and Q is formed from them in blocked compact-WY
  form (:func:`householder_q`) with large matmuls instead of LAPACK's ``orgqr``, which runs at
  about half the matmul rate on CPUs;
* ``eigh``: a full symmetric eigendecomposition of ``L`` (always used at the first refresh);
  the new product is ``Q_new·Λ``;
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

Layout: bases and products are best stored column-major (:func:`column_major`, the layout LAPACK
works in). Then every column permutation is a contiguous row gather of the underlying storage,
``geqrf`` needs no transposing copy, and the triangular product writes contiguous rows. Any
layout gives the same results.
"""

from __future__ import annotations

import logging

import torch

from .options import RefreshMode
from .validation import check_choice

__all__ = [
    "cholesky_qr2",
    "column_major",
    "diagonal_in_basis",
    "eigh_descending",
    "factor_from_product",
    "householder_q",
    "refresh_eigenbasis",
    "take_rows",
    "times_upper_transposed",
]

logger = logging.getLogger(__name__)


# δ/λ_max of the shift in the power-iteration refresh: well above fp32 rounding of L·Q (~1e-7)
# and far below the eigenvalue gaps that matter for the preconditioner.
REFRESH_SHIFT = 1e-5


def wy_block(k: int) -> int:
    """Reflectors per block when forming a ``k×k`` Q (see :func:`householder_q`).

    Measured on 2 CPU threads (ms, vs LAPACK orgqr): k = 2048: 99 at 128, 111 at 64 (orgqr 130);
    k = 512: 2.2 at 64, 2.7 at 128 (orgqr 3.7); k = 256: 0.43 at 64 (orgqr 0.51).
    """
    return 128 if k >= 1024 else 64


#: Size below which :func:`times_upper_transposed` multiplies the whole (triangular) block: the
#: recursion's smaller products run slower per flop (2 CPU threads: 128 is 8% faster than 64 or
#: 256 at k = 2048; at k = 256 the full product already takes as long as the triangular one).
TRIANGULAR_LEAF = 128


_reported: set[str] = set()


def _report_once(key: str, message: str) -> None:
    if key not in _reported:
        _reported.add(key)
        logger.warning("%s (logged once)", message)


def column_major(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its last two dimensions stored column-major (same values)."""
    return x.mT.contiguous().mT


def factor_from_product(product: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """The symmetric factor ``L = P·Qᵀ`` from ``P = L·Q`` (symmetrised: ``(P Qᵀ + Q Pᵀ)/2``)."""
    factor = torch.bmm(product, basis.mT)
    return factor.add_(factor.mT.clone()).mul_(0.5)


def eigh_descending(factor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``(B, k)`` and eigenvectors ``(B, k, k)`` of symmetric matrices, by decreasing
    eigenvalue.

    If the fp32 solver fails to converge the batch is solved in float64 (logged once).
    """
    try:
        values, vectors = torch.linalg.eigh(factor)
    except RuntimeError as err:  # torch.linalg.LinAlgError
        _report_once("eigh64", f"eigh failed in {factor.dtype} ({err}); solving in float64")
        values, vectors = torch.linalg.eigh(factor.to(torch.float64))
        values, vectors = values.to(factor.dtype), vectors.to(factor.dtype)
    return values.flip(-1), vectors.flip(-1)


def cholesky_qr2(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(Q, R)`` with ``Z = Q·R``, Q orthonormal, R upper triangular with positive diagonal; or
    None.

    Two passes of Cholesky-QR on column-normalised Z (``Z = Q₀ D``, ``Q₀ᵀQ₀ = C₁C₁ᵀ``,
    ``Q₁ = Q₀ C₁⁻ᵀ``, ``Q₁ᵀQ₁ = C₂C₂ᵀ``, ``Q = Q₁ C₂⁻ᵀ``, so ``R = (C₁C₂)ᵀ D``). Returns None if a
    Cholesky fails for any matrix in the batch (the caller then falls back to Householder QR).
    """
    norms = torch.linalg.vector_norm(z, dim=-2, keepdim=True)
    if not bool((norms > 0).all()):
        return None
    q = z / norms
    triangles = []
    for _ in range(2):
        chol, info = torch.linalg.cholesky_ex(q.mT @ q)  # QᵀQ = C Cᵀ, so R = Cᵀ
        if bool((info != 0).any()):
            return None
        # Q ← Q R⁻¹ = Q C⁻ᵀ: solve X·Cᵀ = Q for X
        q = torch.linalg.solve_triangular(chol.mT, q, upper=True, left=False)
        triangles.append(chol)
    r = torch.bmm(triangles[0], triangles[1]).mT.mul_(norms)
    return q, r


def householder_q(
    a: torch.Tensor, tau: torch.Tensor, block: int | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Orthogonal factor ``Q = H_1 H_2 ⋯ H_k`` of a Householder QR, from ``torch.geqrf`` output.

    Same result as ``torch.linalg.householder_product(a, tau)`` (LAPACK ``orgqr``), computed the
    way ``orgqr`` does — blocks of reflectors applied from the last block to the first in compact
    WY form — but with the block's triangular factor from the UT transform of Joffrain et al.
    (2006), ``H_j ⋯ H_l = I − V S⁻¹ Vᵀ`` with ``S = striu(VᵀV) + diag(1/τ)``, so that all the
    work is in batched matmuls (plus a ``block × block`` triangular solve per block).

    Args:
        a: ``(B, k, k)`` reflectors below the diagonal (``geqrf``'s first output).
        tau: ``(B, k)`` reflector scales (``geqrf``'s second output).
        block: reflectors per block; default :func:`wy_block`.
        out: ``(B, k, k)`` tensor to write Q into (it must not overlap ``a``).

    Returns:
        ``(B, k, k)`` orthogonal Q (``out`` if given).
    """
    k = a.shape[-1]
    block = block or wy_block(k)
    # τ = 0 means H = I (LAPACK returns it e.g. for the last column): drop that reflector.
    active = tau != 0
    inv_tau = torch.where(active, tau, torch.ones_like(tau)).reciprocal_()
    q = torch.zeros_like(a, memory_format=torch.contiguous_format) if out is None else out
    q.zero_().diagonal(dim1=-2, dim2=-1).fill_(1.0)
    for start in reversed(range(0, k, block)):
        stop = min(start + block, k)
        v = a[:, start:, start:stop].tril(-1)  # unit lower trapezoidal block of reflectors
        v.diagonal(dim1=-2, dim2=-1).fill_(1.0)
        v.mul_(active[:, None, start:stop])
        s = torch.bmm(v.mT, v).triu_(1)
        s.diagonal(dim1=-2, dim2=-1).copy_(inv_tau[:, start:stop])
        eye = torch.eye(stop - start, dtype=a.dtype, device=a.device).expand_as(s)
        vt = torch.bmm(v, torch.linalg.solve_triangular(s, eye, upper=True))  # V S⁻¹
        # Blocks after this one only touched rows and columns ≥ stop, so Q[start:, start:] is
        # all that changes: Q ← (I − V S⁻¹ Vᵀ) Q. The update is accumulated in place, one
        # matmul per batch entry (a strided view is a plain BLAS operand with leading dimension
        # k; a batched call would copy it): no temporary and no separate subtraction pass, 13%
        # faster at k = 2048 and the same at k ≤ 512 (2 CPU threads), same bits.
        trailing = q[:, start:, start:]
        w = torch.bmm(v.mT, trailing)
        for i in range(q.shape[0]):
            trailing[i].addmm_(vt[i], w[i], alpha=-1.0)
    return q


def times_upper_transposed(
    left: torch.Tensor, upper: torch.Tensor, out: torch.Tensor, leaf: int = TRIANGULAR_LEAF
) -> torch.Tensor:
    """``out = left · triu(upper)ᵀ`` for ``(B, k, k)`` batches, at half the flops of a product.

    Only the upper triangle of ``upper`` is read (``geqrf`` output may be passed as is).
    Recursively, with ``U = [[U₁₁, U₁₂], [0, U₂₂]]`` split at ``h = k/2``:
    ``out[:, :h] = left[:, :h]·U₁₁ᵀ + left[:, h:]·U₁₂ᵀ`` and ``out[:, h:] = left[:, h:]·U₂₂ᵀ`` —
    one large rectangular product per level, down to ``leaf``-sized diagonal blocks multiplied
    whole (from a small triangular copy). ``out`` must not overlap the inputs; column-major
    ``out`` makes every column block a contiguous write.
    """
    k = upper.shape[-1]
    if k <= leaf:
        return torch.bmm(left, upper.triu().mT, out=out)
    h = k // 2
    times_upper_transposed(left[:, :, :h], upper[:, :h, :h], out[:, :, :h], leaf)
    out[:, :, :h].baddbmm_(left[:, :, h:], upper[:, :h, h:].mT)
    times_upper_transposed(left[:, :, h:], upper[:, h:, h:], out[:, :, h:], leaf)
    return out


def take_rows(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """``x[b, order[b], :]`` for every batch entry ``b`` (``x`` ``(B, k, n)``, ``order``
    ``(B, k)``): indexing copies whole rows, ~4× faster here than ``take_along_dim``."""
    batch = torch.arange(x.shape[0], device=x.device).unsqueeze(-1)
    return x[batch, order]


def _sorted_columns(x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Column-major copy of ``x`` with columns in ``order`` (``(B, k)``): the rows of ``xᵀ``."""
    return take_rows(x.mT, order).mT


def diagonal_in_basis(product: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``diag(Qᵀ·P)`` ``(B, k)``: with ``P = L·Q`` the Rayleigh quotients ``q_jᵀ L q_j``."""
    return torch.linalg.vecdot(basis, product, dim=-2)


def refresh_eigenbasis(
    product: torch.Tensor, basis: torch.Tensor, mode: RefreshMode
) -> torch.Tensor:
    """Refresh a batch in place: ``basis`` ← new eigenbasis, ``product`` ← ``L·basis``.

    Args:
        product: ``(B, k, k)`` ``P = L·Q`` of the symmetric PSD factor L (already including this
            step) and the current basis.
        basis: ``(B, k, k)`` current orthonormal basis Q.
        mode: ``qr``, ``eigh`` or ``cholesky_qr2``.

    Returns:
        ``order`` ``(B, k)``: the old columns sorted by decreasing ``diag(Qᵀ L Q)``. Column j of
        the new basis continues old column ``order[j]``: state indexed by basis columns (Adam's
        second moment) must be permuted with it.
    """
    check_choice("refresh_mode", mode, RefreshMode)
    approx = diagonal_in_basis(product, basis)
    order = torch.argsort(approx, dim=-1, descending=True)
    if mode == "eigh":
        values, vectors = eigh_descending(factor_from_product(product, basis))
        basis.copy_(vectors)
        product.copy_(vectors * values.unsqueeze(-2))  # L·Q = Q·Λ
        return order
    # Power iteration with L + δI (same eigenvectors, δ = 1e-5·λ_max): directions in L's null
    # space (a factor built from a few gradients is rank-deficient) keep their old basis column
    # instead of an arbitrary completion that changes every step, and Cholesky-QR stays well
    # conditioned.
    shift = (REFRESH_SHIFT * approx.abs().amax(dim=-1, keepdim=True)).unsqueeze(-2)
    sorted_basis = _sorted_columns(basis, order)  # Q̃
    z = _sorted_columns(product, order).addcmul_(sorted_basis, shift)  # (L + δI)·Q̃
    qr = cholesky_qr2(z) if mode == "cholesky_qr2" else None
    if qr is not None:
        basis.copy_(qr[0])
        upper = qr[1]
    else:
        if mode == "cholesky_qr2":
            _report_once("cholqr2", "cholesky_qr2 eigenbasis refresh: Cholesky failed; using qr")
        upper, tau = torch.geqrf(z)  # R above the diagonal, reflectors below
        householder_q(upper, tau, out=basis)
    # L·Q_new = (L + δI)·Q_new − δ·Q_new = Q̃·Rᵀ − δ·Q_new
    times_upper_transposed(sorted_basis, upper, out=product)
    product.addcmul_(basis, shift, value=-1.0)
    return order
