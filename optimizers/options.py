"""The optimizers' option sets, typed once (no torch).

The optimizers validate against these aliases, and the recipe schema takes its choices from
them (through each optimizer's :mod:`spec <.spec>`), so a value is spelt in one place.
"""

from __future__ import annotations

from typing import Literal

__all__ = [
    "CoefficientSet",
    "FP32MatmulPrecision",
    "FactorUpdate",
    "InverseRoot",
    "MatrixRouting",
    "NSMethod",
    "NSPrecision",
    "PolarPrecision",
    "RMSMatch",
    "RefreshMode",
    "ScaleMode",
    "TPMode",
]

#: How a matrix optimizer treats tensor-parallel shards (:mod:`.tensor_parallel`).
TPMode = Literal["blockwise", "duplicated", "distributed"]
#: Newton–Schulz coefficient schedules (:mod:`.ns_schedule`).
CoefficientSet = Literal["quintic", "quintic_schedule", "polar_express", "cubic", "quintic_cubic"]
#: Plain NS, Gram NS, or whichever needs fewer flops for the shape.
NSMethod = Literal["auto", "plain", "gram"]
#: Precision of the Newton–Schulz products.
NSPrecision = Literal["fp32", "bf16"]
#: torch's float32 matmul precision while Muon's Newton–Schulz runs (megatron-core's
#: ``muon_fp32_matmul_prec``; ``highest`` = true fp32, ``high``/``medium`` allow TF32/bf16 on GPUs).
FP32MatmulPrecision = Literal["highest", "high", "medium"]
#: Which parameters the matrix optimizer takes (:func:`~.routing.route_parameter`).
MatrixRouting = Literal["megatron_ext", "megatron_core"]
#: Update scale of Muon/MOP: √max(m, n) (``spectral``), √max(1, m/n), or √(m/n).
ScaleMode = Literal["spectral", "shape", "unit_rms"]
#: Muon/MOP's update-RMS factor: ``extra_scale_factor`` alone (a constant), or times
#: √((1 − β)/(1 + β)) from the momentum β.
RMSMatch = Literal["constant", "beta"]
#: Precision of MOP's SVD.
PolarPrecision = Literal["fp32", "fp64"]
#: KL-SOAP's eigenbasis refresh (:mod:`.eigenbasis`).
RefreshMode = Literal["qr", "eigh", "cholesky_qr2"]
#: KL-SOAP's S^(−p): from the eigenbasis diagonal, or coupled Newton–Schulz on the factor.
InverseRoot = Literal["eigenbasis", "newton_schulz"]
#: KL-SOAP's Kronecker factor update: KL-Shampoo's ``G S_R^(−p) Gᵀ/n`` or Shampoo's ``G Gᵀ``.
FactorUpdate = Literal["kl", "shampoo"]
