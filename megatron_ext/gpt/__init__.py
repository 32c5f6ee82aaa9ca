"""The GPT trainer (``trainer: gpt``): megatron-core's GPTModel, DDP and the layer-wise optimizer.

- :mod:`megatron_ext.gpt.recipe`: its cross-field rules and its registration (torch-free);
- :mod:`megatron_ext.gpt.trainer`: ``train(recipe)``, the loop;
- :mod:`megatron_ext.gpt.setup`: process groups, data, model + DDP, optimizer, schedule;
- :mod:`megatron_ext.gpt.step`: one optimizer step through megatron-core's schedule;
- :mod:`megatron_ext.gpt.checkpoint`: dist_checkpointing checkpoints and when to write them;
- :mod:`megatron_ext.gpt.report`: the step record, the log line and ``summary.json``;
- :mod:`megatron_ext.gpt.flops`: the FLOP model.

The public API, what a user's script (and ``megatron-ext bench``) may call, is
``__all__`` below, loaded on first use (:func:`megatron_ext.exports.load_export`): importing
the package costs nothing; its modules are internals.
"""

from megatron_ext.exports import lazy_exports

#: public name -> the submodule that defines it
_EXPORTS = {
    "BatchRampConfig": "sections",
    "DataConfig": "sections",
    "gpt_train_flops_per_token": "flops",
    "load_model_weights": "checkpoint",
    "ModelConfig": "sections",
    "ParallelConfig": "sections",
    "train": "trainer",
    "TrainingConfig": "sections",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
