"""Matrix optimizers (Muon, MOP, KL-SOAP) next to AdamW and Lion, in pure PyTorch.

Every optimizer is a ``torch.optim.Optimizer`` described by an :class:`~.spec.OptimizerSpec`
(:mod:`.spec`, registered by name). The per-matrix math is exposed on batches of same-shape
matrices (``newton_schulz``, ``polar_factor``, ``kl_soap_direction``) so that a layer-wise
distributed optimizer can run it on exactly the matrices a rank owns.

Importing the package does not import torch: the specs, option sets and Newton–Schulz schedules
(:mod:`.spec`, :mod:`.options`, :mod:`.ns_schedule`, the ``*_spec`` modules) are torch-free so
that recipes can be validated before any process starts; the names below load their module on
first use.
"""

from __future__ import annotations

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "KLSoap": "kl_soap",
    "KLSoapConfig": "kl_soap_math",
    "KLSoapMatrices": "kl_soap_math",
    "kl_soap_direction": "kl_soap_math",
    "kl_soap_flops": "kl_soap_spec",
    "Lion": "lion",
    "MOP": "mop",
    "polar_factor": "mop",
    "Muon": "muon",
    "newton_schulz": "ns_iteration",
    "COEFFICIENT_SETS": "ns_schedule",
    "newton_schulz_flops": "ns_schedule",
    "resolve_coefficients": "ns_schedule",
    "OrthogonalizedOptimizer": "orthogonalized",
    "update_scale": "orthogonalized",
    "QKVLayout": "qkv",
    "build_optimizer": "registry",
    "hyperparameter_names": "registry",
    "route_parameter": "routing",
    "weight_decay_groups": "routing",
    "OPTIMIZERS": "spec",
    "OptimizerSpec": "spec",
    "recipe_hyperparameters": "spec",
    "Hyperparameter": "spec",
    "optimizer_spec": "spec",
    "register_optimizer": "spec",
    "registered_optimizers": "spec",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
