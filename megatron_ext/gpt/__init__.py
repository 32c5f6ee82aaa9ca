"""The GPT trainer (``trainer: gpt``): megatron-core's GPTModel, DDP and the layer-wise optimizer.

- :mod:`megatron_ext.gpt.recipe`: its cross-field rules and its registration (torch-free);
- :mod:`megatron_ext.gpt.trainer`: ``train(recipe)``, the loop;
- :mod:`megatron_ext.gpt.setup`: process groups, data, model + DDP, optimizer, schedule;
- :mod:`megatron_ext.gpt.step`: one optimizer step through megatron-core's schedule;
- :mod:`megatron_ext.gpt.checkpoint`: dist_checkpointing checkpoints and when to write them;
- :mod:`megatron_ext.gpt.report`: the step record, the log line and ``summary.json``;
- :mod:`megatron_ext.gpt.flops`: the FLOP model.

Nothing is imported here, so the registration does not pay for torch.
"""
