"""Checkpoint integrity, for every trainer: manifests, verification, choosing what to resume from
and what to prune (torch-free; ``megatron-ext ckpt verify`` runs the same checks offline)."""
