"""Up-front validation of optimizer hyperparameters: one readable ``ValueError`` per bad value."""

from __future__ import annotations

from typing import Any, get_args


def check_choice(name: str, value: Any, options: Any) -> None:
    """Raise ``ValueError`` unless ``value`` is one of the ``typing.Literal`` alias ``options``."""
    choices = get_args(options)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {list(choices)}")


def check_range(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> None:
    """Raise ``ValueError`` unless ``low (<|<=) value (<|<=) high``; bounds may be ``None``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        lo = "-inf" if low is None else f"{low}"
        hi = "inf" if high is None else f"{high}"
        left = "(" if low_open or low is None else "["
        right = ")" if high_open or high is None else "]"
        interval = f"{left}{lo}, {hi}{right}"
        raise ValueError(f"{name}={value!r} is out of range; it must lie in {interval}")


def check_betas(name: str, betas: tuple[float, float]) -> None:
    """Raise ``ValueError`` unless ``betas`` is a pair in [0, 1)."""
    if not isinstance(betas, tuple | list) or len(betas) != 2:
        raise ValueError(f"{name} must be a pair (beta1, beta2), got {betas!r}")
    for i, beta in enumerate(betas):
        check_range(f"{name}[{i}]", beta, low=0.0, high=1.0, high_open=True)
