"""Muon: MomentUm Orthogonalized by Newton–Schulz (Jordan et al., 2024)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch

from .ns_iteration import GramReduce, newton_schulz, newton_schulz_iterate
from .ns_schedule import (
    default_gram_restart,
    gram_is_cheaper,
    resolve_coefficients,
)
from .options import (
    CoefficientSet,
    FP32MatmulPrecision,
    NSMethod,
    NSPrecision,
    RMSMatch,
    ScaleMode,
    TPMode,
)
from .orthogonalized import OrthogonalizedOptimizer
from .qkv import QKVLayout
from .tensor_parallel import (
    DistributedIteration,
    TPShardInfo,
)
from .validation import check_choice, check_range

__all__ = ["Muon"]


class Muon(OrthogonalizedOptimizer):
    """Muon for 2-D weights and 3-D ``(E, m, n)`` expert stacks.

    Per matrix: ``M ← βM + (1 − β)G`` (Nesterov optional: ``βM + (1 − β)G`` is orthogonalised
    instead of M), ``X_0 = M / max(‖M‖_F, 1e-7)``, ``num_steps`` Newton–Schulz steps (see
    :mod:`.newton_schulz`), then ``W ← (1 − ηλ)W − η·s·X`` with ``s`` from
    :func:`~.orthogonalized.update_scale` (times √((1 − β)/(1 + β)) with ``rms_match="beta"``).
    Matrices of equal shape are orthogonalised together in batched matmuls; the result equals
    the one-by-one computation.

    Args:
        params: parameters (2-D or 3-D) or parameter-group dicts.
        lr: learning rate η.
        momentum: EMA coefficient β.
        weight_decay: decoupled weight decay λ.
        nesterov: orthogonalise the Nesterov look-ahead ``βM + (1 − β)G``.
        coefficients: ``polar_express`` (default), ``quintic``, ``cubic``, ``quintic_cubic``
            or a list of ``(a, b, c)``. At the default 5 steps polar_express is closer to the
            polar factor than quintic (error 0.09 vs 0.15 on random matrices) at the same cost,
            and its singular values have RMS ≈ 1, so ``extra_scale_factor=0.2`` gives an update
            RMS of 0.2 ± 2%; quintic's settle around 0.86 (RMS 0.17 instead).
            ``quintic_cubic`` with ``num_steps=4`` (three quintic steps, one cubic) is closer
            to the polar factor than 5 quintic steps for about 3/4 of their flops.
        num_steps: Newton–Schulz steps.
        ns_method: ``auto`` (Gram NS where it needs fewer flops), ``plain`` or ``gram``.
        precision: matmul precision of the iteration: ``fp32`` (default) or ``bf16`` (GPUs: ~2×
            faster, singular values accurate to ~1e-2 only).
        gram_restart: Gram NS steps after which the iteration restarts from a fresh Gram
            matrix; default none in fp32, after step 2 in bf16 (see :mod:`.newton_schulz`).
        fp32_matmul_prec: ``torch.set_float32_matmul_precision`` while Newton–Schulz runs
            (``highest``, default: true fp32; ``high``/``medium`` let a GPU use TF32 or bf16
            passes, as megatron-core's ``muon_fp32_matmul_prec``, default ``medium`` there).
        scale_mode: ``spectral``, ``shape`` or ``unit_rms``.
        extra_scale_factor: multiplies the scale; 0.2 with ``spectral`` matches AdamW's RMS.
        rms_match: ``constant`` (default): the scale's extra factor is ``extra_scale_factor``;
            ``beta``: ``extra_scale_factor·√((1 − β)/(1 + β))`` with β = ``momentum``, the
            steady-state RMS of the EMA of unit-RMS noise (paper: Sec. 5.2, "≈ 0.2"; 0.160 at
            β = 0.95, 0.229 at 0.9), so that with ``spectral`` and ``extra_scale_factor=1`` the
            update RMS is that factor. It follows the group's momentum at every step.
        qkv_layout: orthogonalise Q, K and V of a fused megatron-core ``linear_qkv.weight``
            separately (put fused weights in their own parameter group with this option). Under
            tensor parallelism: the layout of the shard (``num_query_groups`` per rank).
        tp_mode: for parameters in ``tp_shards``: ``duplicated`` (default; gather, TP=1 update),
            ``distributed`` (NS on shards with all-reduced Gram products; TP=1 update up to
            rounding) or ``blockwise`` (each shard alone; not the TP=1 algorithm). See
            :mod:`.tensor_parallel`.
        tp_shards: tensor-parallel shards among ``params`` and their
            :class:`~megatron_ext.optimizers.tensor_parallel.TPShardInfo`.
        max_batch_numel: largest stacked batch, in elements; default
            :func:`~.orthogonalized.default_max_batch_numel`.
    """

    supported_tp_modes = ("blockwise", "duplicated", "distributed")
    takes_tall_batches = True  # newton_schulz runs Gram NS on the small side of tall batches

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        *,
        lr: float = 0.02,
        momentum: float = 0.95,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        coefficients: CoefficientSet | Sequence[Sequence[float]] = "polar_express",
        num_steps: int = 5,
        ns_method: NSMethod = "auto",
        precision: NSPrecision = "fp32",
        gram_restart: Sequence[int] | None = None,
        fp32_matmul_prec: FP32MatmulPrecision = "highest",
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
            coefficients=coefficients,
            num_steps=num_steps,
            ns_method=ns_method,
            precision=precision,
            gram_restart=None if gram_restart is None else tuple(gram_restart),
            fp32_matmul_prec=fp32_matmul_prec,
            scale_mode=scale_mode,
            extra_scale_factor=extra_scale_factor,
            rms_match=rms_match,
            qkv_layout=qkv_layout,
            tp_mode=tp_mode,
        )
        super().__init__(params, defaults, max_batch_numel=max_batch_numel, tp_shards=tp_shards)

    def _validate_group(self, group: dict[str, Any]) -> None:
        super()._validate_group(group)
        resolve_coefficients(group["coefficients"], group["num_steps"])
        check_choice("ns_method", group["ns_method"], NSMethod)
        check_choice("precision", group["precision"], NSPrecision)
        check_choice("fp32_matmul_prec", group["fp32_matmul_prec"], FP32MatmulPrecision)
        for k in group["gram_restart"] or ():
            check_range("gram_restart step", k, low=1, high=group["num_steps"] - 1)

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)  # groups saved before the option: true fp32, as then
        for group in self.param_groups:
            group.setdefault("fp32_matmul_prec", "highest")

    def orthogonalize(self, x: torch.Tensor, group: dict[str, Any]) -> torch.Tensor:
        with fp32_matmul_precision(group["fp32_matmul_prec"]):
            return newton_schulz(
                x,
                coefficients=group["coefficients"],
                num_steps=group["num_steps"],
                method=group["ns_method"],
                precision=group["precision"],
                gram_restart=group["gram_restart"],
                inplace=True,
            )

    def distributed_iteration(self, group: dict[str, Any]) -> DistributedIteration:
        """NS steps on column blocks of full ``(m, N)`` matrices, Gram products reduced.

        Plain or Gram NS is chosen from the *full* shape, as a TP=1 run would choose it; when
        the blocks split the short side (m > N, the N×N Gram is reduced) plain NS is used
        (Gram NS would then work on N×N matrices throughout).
        """
        steps = resolve_coefficients(group["coefficients"], group["num_steps"])
        restart = group["gram_restart"]
        if restart is None:
            restart = default_gram_restart(group["num_steps"], group["precision"])
        dtype = torch.bfloat16 if group["precision"] == "bf16" else torch.float32
        method = group["ns_method"]

        def iterate(
            work: torch.Tensor, gram_reduce: GramReduce, full_shape: tuple[int, int]
        ) -> torch.Tensor:
            m, n = full_shape
            use_gram = m <= n and (
                method == "gram"
                or (method == "auto" and gram_is_cheaper(m, n, len(steps), restart))
            )
            with fp32_matmul_precision(group["fp32_matmul_prec"]):
                return newton_schulz_iterate(
                    work.to(dtype),
                    steps,
                    gram=use_gram,
                    gram_restart=restart,
                    gram_reduce=gram_reduce,
                )

        return iterate


@contextlib.contextmanager
def fp32_matmul_precision(precision: FP32MatmulPrecision) -> Iterator[None]:
    """torch's float32 matmul precision set to ``precision`` inside, restored after."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)
