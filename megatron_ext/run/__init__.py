"""The run layer every trainer shares (trainer-neutral).

- :mod:`megatron_ext.run.rank_env`: where this process sits, from torchrun, MPI or SLURM
  variables (torch-free: the launcher reads SLURM's host lists with it);
- :mod:`megatron_ext.run.distributed`: torch.distributed's default group, joined once, and
  teardown;
- :mod:`megatron_ext.run.entry`: ``megatron-ext train``, the per-rank entry point (the trainer
  registry is :mod:`megatron_ext.config.trainers`, the sub-commands' :mod:`megatron_ext.commands`);
- :mod:`megatron_ext.run.metrics`: the one metrics logger (log line, ``metrics.jsonl``,
  TensorBoard, plots).

"Training diverged" is :class:`megatron_ext.errors.TrainingDivergedError`. Nothing is imported
here, so the torch-free modules stay torch-free.

The public API, what a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below, loaded on first use (:func:`megatron_ext.exports.load_export`): importing
the package costs nothing; its modules are internals.
"""

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "dense_bf16_peak_tflops": "peaks",
    "PRECISIONS": "precision",
    "probe_device": "hardware",
    "unmet_requirement": "hardware",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
