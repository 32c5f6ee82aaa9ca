"""Sign descent as a megatron-ext optimizer: only its spec (torch-free), the class by path.

Its options are a dataclass (``optimizer.sign_descent_<field>`` in a recipe,
``--megatron-ext-sign-descent-<field>`` on Megatron-LM's command line); nothing in
megatron-ext names it."""

from dataclasses import dataclass

from megatron_ext.optimizers.spec import OptimizerSpec, option


@dataclass(kw_only=True)
class SignDescentOptions:
    shrink: float = option(0.0, ge=0.0, help="decay on p")
    beta: float = option(0.0, ge=0.0, lt=1.0, help="weight of the old momentum m")


SPEC = OptimizerSpec(
    name="sign_descent",
    target="mx_plugin.sign_descent:SignDescent",
    summary="m <- beta m + (1 - beta) g; p -= lr * (sign(m) + shrink * p): the plugin's optimizer",
    couples_matrix_entries=False,
    options=SignDescentOptions,
    label="Sign descent",
    flops=lambda rows, cols, kwargs: 4.0 * rows * cols,
    state_bytes=lambda rows, cols: 4 * rows * cols,  # the momentum m (fp32)
)
