"""Sign descent as a megatron-ext optimizer: only its spec (torch-free), the class by path."""

from megatron_ext.optimizers.spec import Hyperparameter, OptimizerSpec

SPEC = OptimizerSpec(
    name="sign_descent",
    target="mx_plugin.sign_descent:SignDescent",
    summary="p -= lr * (sign(g) + shrink * p): the plugin's optimizer",
    couples_matrix_entries=False,
    hyperparameters=(Hyperparameter(key="shrink", default=0.0, ge=0.0, help="decay on p"),),
    flops=lambda rows, cols, kwargs: 2.0 * rows * cols,
    state_bytes=lambda rows, cols: 0,
)
