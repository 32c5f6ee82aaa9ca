"""Planning a cluster run before it starts: memory, communication and step time per rank,
torch-free.

The public API, what a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below, loaded on first use (:func:`megatron_ext.exports.load_export`): importing
the package costs nothing; its modules are internals.
"""

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "Cluster": "inputs",
    "default_bucket_size": "mcore_layout",
    "gpt_parameters": "params",
    "gpu_spec": "gpus",
    "GPUS": "gpus",
    "matrix_routed": "baselines",
    "plan_recipe": "plan",
    "routed_specs": "baselines",
    "scheme_loads": "baselines",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
