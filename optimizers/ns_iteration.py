"""Newton–Schulz orthogonalisation of batches of matrices: plain and Gram form.

Every routine here works on a batch ``x`` of shape ``(B, m, n)`` (any leading dims are flattened)
and returns an approximation of the polar factor ``U Vᵀ`` of each matrix, where ``x = U Σ Vᵀ``.

The quintic iteration, with one coefficient triple ``(a, b, c)`` per step, is

    A = X Xᵀ;   B = b·A + c·A²;   X ← a·X + B·X          (X: m×n with m ≤ n)

Each step maps every singular value σ of X to ``σ·(a + bσ² + cσ⁴)``.

**Gram–Newton–Schulz.** All iterates are ``X_k = P_k X_0`` with ``P_k`` a polynomial in the m×m
Gram matrix ``R = X_0 X_0ᵀ``, so the iteration can run entirely on m×m matrices:

    A_0 = R;   Q_k = a_k I + b_k A_k + c_k A_k²;   P_{k+1} = Q_k P_k;   A_{k+1} = Q_k A_k Q_k

and ``X_K = P_K X_0`` is formed once at the end. Plain NS costs ``K(4m²n + 2m³)`` flops, Gram NS
``4m²n + (8K − 6)m³`` (first step has ``P = Q``, last step needs no new A), so the Gram form wins
for wide matrices, roughly when ``n > 1.5 m`` at K = 5. In exact arithmetic both give the same X_K.
In floating point the Gram form squares the condition number (it works with σ², not σ), which
costs accuracy on singular values below ~sqrt(machine eps); ``gram_restart`` re-forms ``X_k`` and
``R`` after the given steps to bound that drift (see tests/test_optim_newton_schulz.py for figures).
In fp32 the drift is at most ~2e-3 relative to plain NS even at condition number 1e6 — two orders
below the distance of 5-step NS from the polar factor (~0.1) — so fp32 runs without a restart by
default; bf16 (8-bit mantissa) keeps a restart after step 2 (:func:`default_gram_restart`).

Products whose result is symmetric — ``X Xᵀ``, ``A²`` and, in the Gram form, every m×m product
(all are polynomials in R, so they commute) — are formed by :func:`~.symmetric.symmetric_bmm`
at 3/4 of the flops where that pays. The flop counts here are those of full products.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .ns_schedule import (
    Coefficients,
    default_gram_restart,
    gram_is_cheaper,
    resolve_coefficients,
)
from .options import CoefficientSet, NSMethod, NSPrecision
from .symmetric import symmetric_bmm
from .validation import check_choice

__all__ = ["GramReduce", "newton_schulz", "newton_schulz_iterate", "normalize_frobenius"]

#: In-place sum over ranks of a freshly formed ``(B, m, m)`` Gram matrix ``X Xᵀ`` (tensor-parallel
#: Muon: each rank holds a column block of X, so ``X Xᵀ`` is the sum of the blocks' products).
GramReduce = Callable[[torch.Tensor], None]


def normalize_frobenius(x: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """``x / max(‖x‖_F, eps)`` per matrix of a ``(B, m, n)`` batch, in place; returns ``x``.

    Dividing by the Frobenius norm bounds the spectral norm by 1, the interval on which the NS
    polynomials are designed.
    """
    norms = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True)
    return x.div_(norms.clamp_min_(eps))


def newton_schulz(
    x: torch.Tensor,
    *,
    coefficients: CoefficientSet | Sequence[Sequence[float]] = "quintic",
    num_steps: int = 5,
    method: NSMethod = "auto",
    precision: NSPrecision = "fp32",
    gram_restart: Sequence[int] | None = None,
    eps: float = 1e-7,
    normalize: bool = True,
    inplace: bool = False,
) -> torch.Tensor:
    """Approximate polar factor of every matrix in ``x``.

    Args:
        x: ``(..., m, n)`` batch of matrices (any float dtype). Matrices are processed in the
            orientation with rows ≤ columns and returned in the input orientation.
        coefficients: a named set (``quintic``, ``polar_express``, ``cubic``) or a list of
            ``(a, b, c)`` triples; see :func:`resolve_coefficients`.
        num_steps: number of NS steps.
        method: ``plain``, ``gram`` or ``auto`` (Gram when it needs fewer flops for this shape).
        precision: ``fp32`` (default) or ``bf16``, which runs the matmuls in bfloat16 — about 2×
            faster on tensor-core GPUs, with singular values only accurate to ~1e-2.
        gram_restart: Gram NS only: after each listed step k (1-based, < num_steps) form
            ``X_k = P_k X_0`` and restart from its Gram matrix (about ``4m²n − 6m³`` extra
            flops per restart). Default (:func:`default_gram_restart`): none in fp32, where
            Gram NS stays within ~2e-3 of plain NS anyway; after step 2 in bf16 (if
            num_steps > 2), which brings Gram NS to plain-NS accuracy on ill-conditioned inputs.
        eps: floor of the Frobenius norm in the normalisation ``X_0 = x / max(‖x‖_F, eps)``.
        normalize: divide by the Frobenius norm first; pass False if ``x`` is already scaled so
            that its spectral norm is at most 1.
        inplace: the normalisation may overwrite ``x`` (saves one copy of the batch).

    Returns:
        Tensor of the shape of ``x``, dtype float32 (bfloat16 for ``precision="bf16"``).
    """
    check_choice("method", method, NSMethod)
    check_choice("precision", precision, NSPrecision)
    steps = resolve_coefficients(coefficients, num_steps)
    if gram_restart is None:
        gram_restart = default_gram_restart(num_steps, precision)
    for k in gram_restart:
        if not 1 <= k < num_steps:
            raise ValueError(f"gram_restart steps must lie in [1, {num_steps - 1}], got {k}")
    if x.ndim < 2:
        raise ValueError(f"newton_schulz needs matrices, got shape {tuple(x.shape)}")

    shape = x.shape
    batch = x.reshape(-1, shape[-2], shape[-1])
    tall = batch.shape[-2] > batch.shape[-1]
    m, n = min(batch.shape[-2:]), max(batch.shape[-2:])
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    use_gram = method == "gram" or (
        method == "auto" and gram_is_cheaper(m, n, num_steps, gram_restart, coefficients=steps)
    )
    # Gram NS on a tall batch runs on its n×n side (XᵀX, and X·P at the end), in the batch's own
    # layout; plain NS works on the m ≤ n orientation. Either way every matmul is a plain bmm.
    right = tall and use_gram
    if tall and not right:
        batch = batch.mT
    if inplace and batch.dtype == dtype and batch.is_contiguous():
        work = batch
    else:
        work = torch.empty(batch.shape, dtype=dtype, device=x.device)
        if normalize and batch.dtype.itemsize > dtype.itemsize:
            # normalise at the input's precision, then round once (as Emerging-Optimizers'
            # bf16 iteration does): rounding first would put the bf16 error into the norm too
            norms = torch.linalg.vector_norm(batch, dim=(-2, -1), keepdim=True)
            batch = batch / norms.clamp_min_(eps)
            normalize = False
        work.copy_(batch)
    if normalize:
        normalize_frobenius(work, eps)

    if right:
        out = _gram_ns(work, steps, set(gram_restart), right=True)
    else:
        out = newton_schulz_iterate(work, steps, gram=use_gram, gram_restart=gram_restart)
        if tall:
            out = out.mT
    return out.reshape(shape)


def newton_schulz_iterate(
    work: torch.Tensor,
    steps: list[Coefficients],
    *,
    gram: bool,
    gram_restart: Sequence[int],
    gram_reduce: GramReduce | None = None,
) -> torch.Tensor:
    """The NS steps on an already normalised, contiguous ``(B, m, n)`` batch, as given.

    No orientation logic: the iteration runs on ``work`` as laid out (normally m ≤ n; m > n is
    valid too, just costlier, since every m×m product grows). ``steps`` come from
    :func:`resolve_coefficients`. ``gram`` selects Gram NS (``work`` is read, not overwritten)
    over plain NS (``work`` is used as workspace). ``gram_reduce``, if given, is applied to
    every ``X Xᵀ`` right after it is formed — plain NS: once per step; Gram NS: for ``R`` and
    after each restart — and all other products are left-multiplications by m×m matrices
    computed from reduced Grams. So if ``work`` holds column blocks of larger matrices and
    ``gram_reduce`` sums over the blocks, every block follows the iteration of the full
    matrices (tensor-parallel Muon, :mod:`.tensor_parallel`).

    Returns:
        ``(B, m, n)`` tensor in the dtype of ``work``.
    """
    if gram:
        return _gram_ns(work, steps, set(gram_restart), gram_reduce)
    return _plain_ns(work, steps, gram_reduce)


def _polynomial(a_mat: torch.Tensor, b: float, c: float, out: torch.Tensor) -> torch.Tensor:
    """``out = b·A + c·A²`` for symmetric ``A``; a cubic step (c = 0) needs no product."""
    if c == 0.0:
        return torch.mul(a_mat, b, out=out)
    return symmetric_bmm(a_mat, a_mat, out, add=a_mat, beta=b, alpha=c)


def _plain_ns(
    x: torch.Tensor, steps: list[Coefficients], gram_reduce: GramReduce | None = None
) -> torch.Tensor:
    """Plain NS on a contiguous ``(B, m, n)`` batch; ``x`` is used as workspace."""
    other = torch.empty_like(x)
    gram = torch.empty(x.shape[0], x.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    poly = torch.empty_like(gram)
    for a, b, c in steps:
        symmetric_bmm(x, x.mT, gram)  # A = XXᵀ
        if gram_reduce is not None:
            gram_reduce(gram)
        _polynomial(gram, b, c, poly)  # B = bA + cA²
        torch.baddbmm(x, poly, x, beta=a, alpha=1.0, out=other)  # X ← aX + BX
        x, other = other, x
    return x


def _gram_ns(
    x: torch.Tensor,
    steps: list[Coefficients],
    restart: set[int],
    gram_reduce: GramReduce | None = None,
    right: bool = False,
) -> torch.Tensor:
    """Gram NS on a contiguous ``(B, m, n)`` batch; ``x`` is read, not overwritten.

    Every m×m product here is of two commuting symmetric matrices (all are polynomials in R),
    so each is formed by :func:`symmetric_bmm`. ``right``: iterate on the n×n side instead
    (``R = XᵀX``, ``X_K = X_0 P_K``) -- the same iteration for the transpose, used for tall
    batches so that they are never transposed in memory.
    """
    gram_side = x.mT if right else x  # the factor whose rows span the Gram side
    batch, m = gram_side.shape[0], gram_side.shape[1]
    a_mat = torch.empty(batch, m, m, dtype=x.dtype, device=x.device)
    symmetric_bmm(gram_side, gram_side.mT, a_mat)  # A_0 = R = X_0 X_0ᵀ (right: X_0ᵀ X_0)
    if gram_reduce is not None:
        gram_reduce(a_mat)
    q_mat = torch.empty_like(a_mat)
    tmp = torch.empty_like(a_mat)
    p_mat: torch.Tensor | None = None  # P = I, kept implicit until the first step
    identity_diag = torch.ones(batch, m, dtype=x.dtype, device=x.device)
    last = len(steps) - 1
    for k, (a, b, c) in enumerate(steps):
        # Q = aI + bA + cA²
        q = _polynomial(a_mat, b, c, q_mat)
        q.diagonal(dim1=-2, dim2=-1).add_(identity_diag, alpha=a)
        if p_mat is None:
            p_mat = q  # P = Q·I; P now owns this buffer, so Q gets a fresh one next step
            q_mat = torch.empty_like(q)
        else:
            symmetric_bmm(q, p_mat, tmp)
            p_mat, tmp = tmp, p_mat
        if k == last:
            break
        if k + 1 in restart:
            # X_{k+1} = P X_0 and R = X_{k+1} X_{k+1}ᵀ: the same numbers the plain iteration
            # would hold here, so the rounding that crept into A and P is discarded.
            x = torch.bmm(x, p_mat) if right else torch.bmm(p_mat, x)
            gram_side = x.mT if right else x
            symmetric_bmm(gram_side, gram_side.mT, a_mat)
            if gram_reduce is not None:
                gram_reduce(a_mat)
            p_mat = None
            continue
        # A ← Q A Q. Q and A commute in exact arithmetic; the symmetric form keeps A symmetric.
        symmetric_bmm(a_mat, q, tmp)
        symmetric_bmm(q, tmp, a_mat)
    assert p_mat is not None
    return torch.bmm(x, p_mat) if right else torch.bmm(p_mat, x)
