"""Newton–Schulz coefficient schedules and flop counts (no torch: recipes and the ownership
plan read them before any tensor exists).

A schedule is one ``(a, b, c)`` triple per step of ``X ← aX + (bA + cA²)X`` (A = XXᵀ); see
:mod:`.newton_schulz` for the iteration itself.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Literal

from .options import CoefficientSet, NSPrecision
from .validation import check_choice, check_range

__all__ = [
    "COEFFICIENT_SETS",
    "CYCLED_SETS",
    "Coefficients",
    "default_gram_restart",
    "gram_is_cheaper",
    "newton_schulz_flops",
    "resolve_coefficients",
]


Coefficients = tuple[float, float, float]


def _polar_express_table() -> tuple[Coefficients, ...]:
    """Per-step coefficients of "The Polar Express" (Amsel et al., 2025, arXiv:2505.16932).

    The published table is for inputs normalised by their Frobenius norm; its Algorithm 1 divides
    every step but the last by the safety factor 1.01 in the variable, i.e. ``p(x/1.01)``, which
    scales ``(a, b, c)`` by ``(1.01⁻¹, 1.01⁻³, 1.01⁻⁵)`` and keeps rounding from pushing singular
    values past the interval the polynomials were optimised on. The last step repeats.
    """
    published = (
        (8.28721201814563, -23.595886519098837, 17.300387312530933),
        (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
        (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
        (3.3184196573706015, -2.488488024314874, 0.51004894012372),
        (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
        (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
        (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
        (1.875, -1.25, 0.375),
    )
    safety = 1.01
    scaled = tuple((a / safety, b / safety**3, c / safety**5) for a, b, c in published[:-1])
    return (*scaled, published[-1])


COEFFICIENT_SETS: dict[str, tuple[Coefficients, ...]] = {
    # Keller Jordan's Muon quintic: maximal slope at 0 while staying in [0.7, 1.2] for σ in (0, 1].
    "quintic": ((3.4445, -4.7750, 2.0315),),
    "polar_express": _polar_express_table(),
    # The classical cubic Newton–Schulz iteration X ← 1.5X − 0.5 X Xᵀ X: converges to exactly 1,
    # but slowly for small σ.
    "cubic": ((1.5, -0.5, 0.0),),
}
# Three quintic steps lift the small singular values (×3.4 per step) into the quintic's band
# [0.7, 1.2]; cubic steps then pull that band towards 1 (0.7 -> 0.88, 1.2 -> 0.94), and a cubic
# step costs one product less (c = 0: no A²). At num_steps = 4 it is closer to the polar factor
# than 5 quintic steps (tests/test_optim_newton_schulz.py) for about 3/4 of their flops.
COEFFICIENT_SETS["quintic_cubic"] = (*COEFFICIENT_SETS["quintic"] * 3, *COEFFICIENT_SETS["cubic"])
# Five quintic triples tuned step by step (You Jiacheng's, as in Keller Jordan's modded-nanogpt):
# Emerging-Optimizers' and so Megatron-LM's default ``quintic`` (``--muon-coefficient-type``).
# Used in turn and, past the fifth step, from the first again (their "cycle" mode).
COEFFICIENT_SETS["quintic_schedule"] = (
    (4.0848, -6.8946, 2.9270),
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
)
#: named sets that start again from their first triple after the last (the others repeat it)
CYCLED_SETS = frozenset({"quintic_schedule"})


def resolve_coefficients(
    coefficients: CoefficientSet | Sequence[Sequence[float]], num_steps: int
) -> list[Coefficients]:
    """The ``num_steps`` coefficient triples to use, one per step.

    A named set or a user list is used step by step; past its end the last triple repeats (a
    single-triple set such as ``quintic`` therefore repeats its triple every step), except for
    the sets of :data:`CYCLED_SETS`, which start again from their first.
    """
    check_range("num_steps", num_steps, low=1)
    if isinstance(coefficients, str):
        check_choice("coefficients", coefficients, CoefficientSet)
        table = COEFFICIENT_SETS[coefficients]
    else:
        table = tuple(tuple(float(v) for v in triple) for triple in coefficients)  # type: ignore[misc]
        if not table or any(len(triple) != 3 for triple in table):
            raise ValueError(
                "coefficients must be one of "
                f"{list(COEFFICIENT_SETS)} or a non-empty list of (a, b, c) triples, "
                f"got {coefficients!r}"
            )
    if isinstance(coefficients, str) and coefficients in CYCLED_SETS:
        steps: Iterator[Coefficients] = itertools.cycle(table)
    else:
        steps = itertools.chain(table, itertools.repeat(table[-1]))
    return list(itertools.islice(steps, num_steps))


def default_gram_restart(num_steps: int, precision: NSPrecision = "fp32") -> tuple[int, ...]:
    """Gram NS restarts by default: none in fp32, after step 2 in bf16 (if there are more steps).

    A restart costs two m×n-sized products (``X_k = P_k X_0`` and its Gram matrix) and saves
    three m×m ones — about 6% more time for 256×512 matrices, 20% for 512×2048. In fp32 the
    rounding it discards moves the result by at most ~2e-3 relative to plain NS (condition
    number 1e6; tests/test_optim_newton_schulz.py), negligible next to NS's own ~0.1 distance
    from the polar factor. bf16, whose rounding is 2¹⁶ times coarser, keeps the restart.
    """
    return (2,) if precision == "bf16" and num_steps > 2 else ()


def newton_schulz_flops(
    m: int,
    n: int,
    num_steps: int,
    method: Literal["plain", "gram"],
    gram_restart: Sequence[int] | None = None,
    precision: NSPrecision = "fp32",
    coefficients: CoefficientSet | Sequence[Sequence[float]] = "quintic",
) -> int:
    """Multiply-add flops (2 per MAC) of one ``m×n`` orthogonalisation (m, n in any order).

    ``gram_restart=None`` means the default for ``precision`` (:func:`default_gram_restart`).
    Steps whose ``c`` is 0 (cubic) need no ``A²`` product.
    """
    m, n = min(m, n), max(m, n)
    quintic = [c != 0.0 for _, _, c in resolve_coefficients(coefficients, num_steps)]
    if method == "plain":
        return sum(4 * m * m * n + (2 * m**3 if q else 0) for q in quintic)
    if gram_restart is None:
        gram_restart = default_gram_restart(num_steps, precision)
    restart = set(gram_restart)
    wide = 2  # m×n-sized products: the first Gram matrix and the final P·X
    square = 0  # m×m products
    p_is_identity = True
    for k in range(num_steps):
        square += int(quintic[k]) + (0 if p_is_identity else 1)  # A², and P ← Q·P unless P = I
        p_is_identity = False
        if k == num_steps - 1:
            break
        if k + 1 in restart:
            wide += 2  # X ← P·X and its Gram matrix
            p_is_identity = True
        else:
            square += 2  # A ← Q·(A·Q)
    return 2 * m * m * n * wide + 2 * m**3 * square


def gram_is_cheaper(
    m: int,
    n: int,
    num_steps: int,
    gram_restart: Sequence[int] | None = None,
    precision: NSPrecision = "fp32",
    coefficients: CoefficientSet | Sequence[Sequence[float]] = "quintic",
) -> bool:
    """Whether Gram NS needs fewer flops than plain NS for an ``m×n`` matrix."""
    gram = newton_schulz_flops(m, n, num_steps, "gram", gram_restart, precision, coefficients)
    plain = newton_schulz_flops(m, n, num_steps, "plain", coefficients=coefficients)
    return gram < plain
