"""megatron-ext: matrix optimizers, a layer-wise distributed optimizer, recipes and alternate
trainers for megatron-core.  See docs/architecture.md for the layout and the layer order."""

__version__ = "0.1.0"
