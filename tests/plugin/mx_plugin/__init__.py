"""A plugin of megatron-ext: an optimizer (sign descent) and a trainer (countdown)."""
