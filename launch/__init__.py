"""The launcher and the ``megatron-ext`` command line.

Installed as ``megatron_ext.launch``.  Nothing here imports torch: the launcher only validates
recipes and builds/runs commands; the per-rank ``train`` entry point imports the trainers lazily.
"""
