"""The layer-wise distributed optimizer: whole matrices owned by data-parallel ranks.

The public API, what a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below, loaded on first use (:func:`megatron_ext.exports.load_export`): importing
the package costs nothing; its modules are internals.
"""

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "LayerwiseOptimizer": "layerwise",
    "make_allgather_v": "allgather_v",
    "OwnershipPlan": "plan",
    "WireStats": "allgather_v",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
