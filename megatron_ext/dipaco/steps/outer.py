"""The outer step of one module: DiLoCo's Nesterov SGD on the token-weighted path deltas.

For module (l, e), used by the paths i in paths(l, e) (P_{l,e} of them), each of which trained
its copy θ_i of the module for τ inner steps from the global θ::

    α_i = |D_i| / Σ_j |D_j|              (shard tokens; 1 / P_{l,e} without alpha_weighting)
    Δ   = s · Σ_i α_i (θ − θ_i)          (s = √P_{l,e} with sqrt_p_scaling, else 1)
    b   ← μ b + Δ                        (b = 0 before the first step)
    θ   ← θ − η (Δ + μ b)  (Nesterov)     or  θ − η b  (heavy ball)

The sum runs in ascending path order and in float64, whatever order the paths finished in, so
the new module is bit-identical however many workers trained the paths. A module used by one
path takes the step too (the paper finds it helps), and so do a path's path-specific parts: the
path's own train task applies it to them (P = 1, weight 1), and their momentum stays with the path
(:func:`megatron_ext.dipaco.run.tasks.train`); they never come to an executor.

:func:`accumulate_delta` adds one path at a time, so an executor holds the global module, the
running Δ and one path's copy at once, never the whole mixture.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["OuterConfig", "accumulate_delta", "apply_outer_step", "outer_step", "path_weights"]

Params = dict[str, torch.Tensor]


@dataclass(frozen=True)
class OuterConfig:
    """``lr`` η, ``momentum`` μ, ``nesterov``; ``sqrt_p_scaling`` and ``alpha_weighting``
    are the paper's two switches (on by default there)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    sqrt_p_scaling: bool = True
    alpha_weighting: bool = True


def path_weights(tokens: Sequence[int], cfg: OuterConfig) -> list[float]:
    """s · α_i for each path (in the order given): token shares, or uniform, times √P."""
    if not tokens or any(t < 0 for t in tokens) or (cfg.alpha_weighting and sum(tokens) == 0):
        raise ValueError(f"shard tokens {list(tokens)} cannot weigh an outer step")
    p = len(tokens)
    total = sum(tokens)
    alphas = [t / total for t in tokens] if cfg.alpha_weighting else [1.0 / p] * p
    scale = math.sqrt(p) if cfg.sqrt_p_scaling else 1.0
    return [scale * a for a in alphas]


def accumulate_delta(
    delta: Params | None, global_params: Params, path_params: Params, weight: float
) -> Params:
    """``delta + weight · (θ − θ_i)`` in float64 (``delta`` None: start from zero). Call it
    for the paths in ascending order."""
    if set(path_params) != set(global_params):
        missing = sorted(set(global_params) ^ set(path_params))
        raise ValueError(f"a path's module and the global module differ in {missing[:3]}")
    out = {} if delta is None else delta
    for name, theta in global_params.items():
        diff = theta.double() - path_params[name].double()
        if name in out:
            out[name].add_(diff, alpha=weight)
        else:
            out[name] = diff.mul_(weight)
    return out


def apply_outer_step(
    global_params: Params, momentum: Params | None, delta: Params, cfg: OuterConfig
) -> tuple[Params, Params]:
    """One Nesterov (or heavy-ball) SGD step of the global module along ``delta``.

    Returns (new parameters in the module's dtype, new momentum in the module's dtype);
    ``momentum`` None is the zero buffer of the first step. The arithmetic is float64."""
    new_params, new_momentum = {}, {}
    for name, theta in global_params.items():
        d = delta[name]
        buf = d.clone() if momentum is None else momentum[name].double().mul(cfg.momentum).add_(d)
        update = d + cfg.momentum * buf if cfg.nesterov else buf
        new_params[name] = (theta.double() - cfg.lr * update).to(theta.dtype)
        new_momentum[name] = buf.to(theta.dtype)
    return new_params, new_momentum


def outer_step(
    global_params: Params,
    momentum: Params | None,
    tokens: Mapping[int, int],
    load_path: Callable[[int], Params],
    cfg: OuterConfig,
) -> tuple[Params, Params]:
    """The whole outer step of one module: ``tokens`` maps each path using it to its shard
    tokens |D_i|; ``load_path(i)`` returns path i's trained copy of the module. Paths are loaded
    one at a time in ascending order (whatever order ``tokens`` lists them in)."""
    order = sorted(tokens)
    weights = path_weights([tokens[i] for i in order], cfg)
    delta = None
    for path, weight in zip(order, weights, strict=True):
        delta = accumulate_delta(delta, global_params, load_path(path), weight)
    assert delta is not None
    return apply_outer_step(global_params, momentum, delta, cfg)
