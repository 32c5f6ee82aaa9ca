"""Glue to megatron-core: model builder and layer specs, DDP, optimizer adapter, process groups,
CPU compatibility."""
