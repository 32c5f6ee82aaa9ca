"""Matrix optimizers (Muon, MOP, KL-SOAP) next to AdamW and Lion, in pure PyTorch.

Every optimizer is a ``torch.optim.Optimizer``. The per-matrix math is exposed on batches of
same-shape matrices (``newton_schulz``, ``polar_factor``, ``kl_soap_direction``) so that a
layer-wise distributed optimizer can run it on exactly the matrices a rank owns.
"""

from .combined import CombinedOptimizer, build_model_optimizer
from .eigenbasis import (
    RefreshMode,
    cholesky_qr2,
    eigh_descending,
    factor_from_product,
    refresh_eigenbasis,
)
from .kl_soap import KLSoap
from .kl_soap_math import (
    InverseRoot,
    KLSoapConfig,
    KLSoapMatrices,
    accumulate_kl_factors,
    adam_in_eigenbasis,
    explicit_factors,
    kl_soap_direction,
    kl_soap_flops,
)
from .lion import Lion
from .matrix_roots import inverse_root_newton_schulz
from .mop import MOP, PolarPrecision, polar_factor
from .muon import Muon
from .newton_schulz import (
    COEFFICIENT_SETS,
    CoefficientSet,
    NSMethod,
    NSPrecision,
    gram_is_cheaper,
    newton_schulz,
    newton_schulz_flops,
    resolve_coefficients,
)
from .orthogonalized import OrthogonalizedOptimizer, ScaleMode, matrix_slots, update_scale
from .qkv import QKVLayout, qkv_views
from .registry import OPTIMIZERS, OptimizerName, build_optimizer, hyperparameter_names
from .routing import MATRIX_OPTIMIZERS, route_parameter, split_parameters, weight_decay_groups

__all__ = [
    "COEFFICIENT_SETS",
    "MATRIX_OPTIMIZERS",
    "MOP",
    "OPTIMIZERS",
    "CoefficientSet",
    "CombinedOptimizer",
    "InverseRoot",
    "KLSoap",
    "KLSoapConfig",
    "KLSoapMatrices",
    "Lion",
    "Muon",
    "NSMethod",
    "NSPrecision",
    "OptimizerName",
    "OrthogonalizedOptimizer",
    "PolarPrecision",
    "QKVLayout",
    "RefreshMode",
    "ScaleMode",
    "accumulate_kl_factors",
    "adam_in_eigenbasis",
    "build_model_optimizer",
    "build_optimizer",
    "cholesky_qr2",
    "eigh_descending",
    "explicit_factors",
    "factor_from_product",
    "gram_is_cheaper",
    "hyperparameter_names",
    "inverse_root_newton_schulz",
    "kl_soap_direction",
    "kl_soap_flops",
    "matrix_slots",
    "newton_schulz",
    "newton_schulz_flops",
    "polar_factor",
    "qkv_views",
    "refresh_eigenbasis",
    "resolve_coefficients",
    "route_parameter",
    "split_parameters",
    "update_scale",
    "weight_decay_groups",
]
