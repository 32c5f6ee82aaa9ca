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
"""
