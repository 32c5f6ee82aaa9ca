"""Glue to megatron-core: model builder and layer specs, DDP, optimizer adapter, process groups,
CPU compatibility.

The public API, what a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below, loaded on first use (:func:`megatron_ext.exports.load_export`): importing
the package costs nothing; its modules are internals.
"""

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "apply_cpu_compat_layerwise": "cpu_compat_layerwise",
    "build_gpt_model": "model",
    "DistributedDataParallel": "ddp",
    "get_megatron_optimizer": "drop_in",
    "half_precision_module": "model",
    "init_distributed": "parallel",
    "ModelConfig": "sections",
    "ParallelConfig": "sections",
    "wrap_fp32_inner_optimizers": "cpu_compat_layerwise",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
