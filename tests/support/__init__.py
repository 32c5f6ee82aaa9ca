"""Test harness shared by several test modules (not shipped: the wheel holds megatron_ext only)."""
