"""megatron-ext: matrix optimizers, a layer-wise distributed optimizer, recipes and alternate
trainers for megatron-core.  See DESIGN.md for the layout."""

__version__ = "0.1.0"
