"""Inverse p-th roots of SPD matrices by a coupled Newton–Schulz iteration (matmuls only).

For ``A`` SPD and integer ``r ≥ 1`` the coupled iteration (Guo & Higham, 2006)

    X_0 = I,  M_0 = A/c;   T_k = ((r + 1)I − M_k)/r;   X_{k+1} = X_k T_k;   M_{k+1} = T_kʳ M_k

keeps ``M_k = X_kʳ A / c`` and drives ``M_k → I``, hence ``X_k → (A/c)^(−1/r)``. With ``c = ‖A‖_F``
all eigenvalues of ``M_0`` lie in (0, 1], where the iteration converges. Each iteration
multiplies a small eigenvalue μ by about ``((r + 1)/r)ʳ`` (2 for r = 1), so it needs roughly
``log(κ)/log(((r + 1)/r)ʳ)`` iterations to reach the quadratic phase plus a few more. Measured
(tests/test_optim_kl_soap.py, relative error vs float64 eigh): r = 1, κ = 1e3: 4e-1 after 10
iterations, 7e-12 after 15; κ = 1e5: 7e-5 after 20, 3e-12 after 25. In fp32 the error floor is
about κ·u (1e-5 at κ = 1e3, 5e-4 at κ = 1e5). Each iteration costs ``r + 1`` matmuls.

For r = 1 (the inverse) :func:`inverse_newton_schulz` starts closer: it scales ``A`` to unit
diagonal, ``C = D^(1/2) A D^(1/2)`` with ``D = diag(A)^(−1)``, inverts C by the same iteration
(Newton–Schulz for the inverse, ``X ← X(2I − C X)``) and returns ``D^(1/2) C⁻¹ D^(1/2)``, which
is ``A⁻¹`` exactly. For a matrix that an orthogonal basis nearly diagonalises — a Kronecker
factor in its held eigenbasis, ``Qᵀ(L + δI)Q`` — C is close to I, so its condition number is far
below A's and a few iterations suffice; the iteration stops as soon as its residual says so
(a diagonal scaling commutes with nothing, so for r > 1 it gives no root: those keep the plain
start).
"""

from __future__ import annotations

import torch

from .validation import check_range

__all__ = ["inverse_newton_schulz", "inverse_root_newton_schulz"]


def inverse_root_newton_schulz(
    a: torch.Tensor, root: int, *, eps: float | torch.Tensor = 0.0, num_iters: int = 25
) -> torch.Tensor:
    """``(A + eps·I)^(−1/root)`` for a batch ``(B, k, k)`` of symmetric PSD matrices.

    Args:
        a: ``(..., k, k)`` symmetric positive semi-definite matrices.
        root: integer r ≥ 1 of the inverse root (1 gives the inverse).
        eps: damping added to the diagonal (a float, or a tensor broadcasting against
            ``(..., 1, 1)``: one per matrix); must make ``A + eps·I`` positive definite.
        num_iters: iterations (see the module docstring for the count κ requires).

    Returns:
        Tensor of the shape and dtype of ``a``.
    """
    check_range("root", root, low=1)
    check_range("num_iters", num_iters, low=1)
    k = a.shape[-1]
    eye = torch.eye(k, dtype=a.dtype, device=a.device).expand_as(a)
    damped = a + eps * eye
    scale = torch.linalg.matrix_norm(damped, ord="fro", keepdim=True).clamp_min(
        torch.finfo(a.dtype).tiny
    )
    m = damped / scale
    x = eye.clone()
    for _ in range(num_iters):
        t = (eye * (root + 1) - m) / root
        x = x @ t
        t_pow = t
        for _ in range(root - 1):
            t_pow = t_pow @ t
        m = t_pow @ m
    return x * scale.pow(-1.0 / root)


def inverse_newton_schulz(
    a: torch.Tensor, *, eps: float | torch.Tensor = 0.0, max_iters: int = 25
) -> tuple[torch.Tensor, int]:
    """``(A + eps·I)⁻¹`` for a batch of symmetric PSD matrices, Jacobi-scaled, until converged.

    Newton–Schulz for the inverse of ``C = D^(1/2)(A + eps·I)D^(1/2)`` (unit diagonal, ``D`` the
    inverse diagonal) from ``X_0 = I/‖C‖_∞``: C is symmetric, so its eigenvalues lie in
    ``(0, ‖C‖_∞]`` (Gershgorin) and those of ``C X_0`` in (0, 1], where ``X ← X + X(I − C X)``
    converges; every iterate is a polynomial in C, so symmetric and commuting with it. The
    residual ``E = I − C X`` squares each iteration (``E_{k+1} = E_k²``), and ``X`` is within
    ``‖E‖₂ ≤ ‖E‖_F`` of C⁻¹ relative to it, so the loop stops once every matrix of the batch has
    ``‖E‖_F ≤ √k·u`` (u the dtype's unit roundoff: fp32 cannot do better) or has stopped
    shrinking — ``‖E_k‖_F > ‖E_{k−1}‖_F/2`` although ``‖E_{k−1}‖_F < 1/2``, which exact
    arithmetic rules out (``‖E²‖_F ≤ ‖E‖₂‖E‖_F``), so rounding has the last word.

    Args:
        a: ``(B, k, k)`` symmetric PSD matrices with positive diagonal after damping.
        eps: damping added to the diagonal (float or ``(B, 1, 1)`` tensor); ``A + eps·I`` must be
            positive definite.
        max_iters: most iterations: the first needs no product, each further one two
            (the residual that decides whether to go on, and the update).

    Returns:
        ``((B, k, k)`` inverse, symmetrised; iterations done).
    """
    check_range("max_iters", max_iters, low=1)
    k = a.shape[-1]
    eye = torch.eye(k, dtype=a.dtype, device=a.device).expand_as(a)
    damped = a + eps * eye
    scale = damped.diagonal(dim1=-2, dim2=-1).clamp_min(torch.finfo(a.dtype).tiny).rsqrt()
    outer = scale.unsqueeze(-1) * scale.unsqueeze(-2)  # D^(1/2) · D^(1/2), entrywise
    c = damped.mul_(outer)
    bound = c.abs().sum(dim=-1).amax(dim=-1)  # ‖C‖_∞ ≥ λ_max(C)
    alpha = bound.reciprocal()[:, None, None]
    # The first iteration from X_0 = αI needs no product: E_0 = I − αC, X_1 = α(2I − αC).
    residual = eye - alpha * c
    previous = torch.linalg.matrix_norm(residual)
    x = residual.add(eye).mul_(alpha)
    done = 1
    tol = k**0.5 * torch.finfo(a.dtype).eps
    while done < max_iters:
        torch.baddbmm(eye, c, x, alpha=-1.0, out=residual)  # E = I − C X
        err = torch.linalg.matrix_norm(residual)
        finished = (err <= tol) | ((previous < 0.5) & (err > 0.5 * previous))
        if bool(finished.all()):
            break
        x = torch.baddbmm(x, x, residual)  # X(2I − C X)
        previous = err
        done += 1
    x = x.add(x.mT).mul_(0.5)
    return x.mul_(outer), done
