"""The GPT trainer's recipe sections: ``model``, ``data``, ``training`` and ``parallel`` (its
``optimizer`` section is :mod:`megatron_ext.config.optimizer`'s, built from the optimizer
registry). All four are defined in megatron-core's names beside the builder that reads them
and the converter of Megatron-LM's flags that writes them (:mod:`megatron_ext.megatron.sections`)
and exported here.

The GPT trainer owns them (:mod:`megatron_ext.gpt.recipe` registers them); SOMA and DiPaCo
read some of their fields and say which (``TrainerSpec.reads``). Field names follow
megatron-core where a counterpart exists (``TransformerConfig``, ``OptimizerConfig``,
``DistributedDataParallelConfig``, ``OptimizerParamScheduler``); each field may carry
validation metadata (:func:`megatron_ext.config.fields.spec`), and a closed set of values is
its ``Literal`` type, owned by the module that implements it.

No torch import: the launcher validates recipes before any process starts.
"""

from __future__ import annotations

from megatron_ext.megatron.sections import (
    BatchRampConfig,
    DataConfig,
    ModelConfig,
    ParallelConfig,
    TrainingConfig,
)

__all__ = ["BatchRampConfig", "DataConfig", "ModelConfig", "ParallelConfig", "TrainingConfig"]
