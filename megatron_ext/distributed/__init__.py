"""The layer-wise distributed optimizer: whole matrices owned by data-parallel ranks."""
