"""megatron-ext's optimizers from a Megatron-LM command line: one line in ``pretrain_gpt.py``::

    from megatron_ext.megatron.megatron_lm import megatron_ext_args

    pretrain(..., extra_args_provider=megatron_ext_args)

then ``--megatron-ext-optimizer kl_soap`` (or ``muon``, ``mop``, ``lion``) on the command line.
Megatron-LM's own ``--optimizer`` choices hold no ``kl_soap`` or ``mop``, and its argument list
none of megatron-ext's options, so the hook its ``pretrain()`` takes for a script's own
arguments (``extra_args_provider``) adds them: :func:`add_arguments` adds the group
``megatron-ext`` with ``--megatron-ext-optimizer`` and one ``--megatron-ext-<field>`` per field
of the recipe's ``optimizer:`` section that megatron-core's ``OptimizerConfig`` lacks
(``--megatron-ext-kl-soap-factor-eps 1e-10``, ``--megatron-ext-match-update-rms false``, ...),
typed and bounded as the recipe's. :func:`install` points Megatron-LM's training loop
(``megatron.training.training.get_megatron_optimizer``) at the drop-in
(:mod:`.drop_in`), which builds the optimizer from Megatron-LM's ``OptimizerConfig`` with these
arguments applied (:func:`apply_arguments`). Without ``--megatron-ext-optimizer`` Megatron-LM's
``--optimizer`` is used as the drop-in reads it (``adam``/``sgd``: megatron-core's own; ``muon``,
``lion``, ``soap``: megatron-ext's).
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any

from megatron_ext.errors import ConfigError

__all__ = ["EXT_PREFIX", "add_arguments", "apply_arguments", "install", "megatron_ext_args"]

EXT_PREFIX = "megatron_ext_"


def _ext_fields() -> dict[str, dataclasses.Field]:
    """The recipe's optimizer fields megatron-core's OptimizerConfig does not have."""
    from megatron.core.optimizer import OptimizerConfig as McOptimizerConfig

    from megatron_ext.config.optimizer import OptimizerConfig

    theirs = {f.name for f in dataclasses.fields(McOptimizerConfig)}
    return {
        f.name: f
        for f in dataclasses.fields(OptimizerConfig)
        if f.name not in theirs and f.name != "name"
    }


def _boolean(text: str) -> bool:
    if text.lower() in ("true", "1", "yes"):
        return True
    if text.lower() in ("false", "0", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``megatron-ext`` group to Megatron-LM's parser; returns the parser."""
    from megatron_ext.config.fields import literal_options
    from megatron_ext.config.optimizer import OptimizerConfig
    from megatron_ext.megatron.drop_in import EXTENSION_OPTIMIZERS

    group = parser.add_argument_group("megatron-ext")
    group.add_argument(
        "--megatron-ext-optimizer",
        choices=EXTENSION_OPTIMIZERS,
        default=None,
        help="train with megatron-ext's layer-wise optimizer (overrides --optimizer)",
    )
    hints = typing.get_type_hints(OptimizerConfig)
    for name, f in _ext_fields().items():
        kind = hints[name]
        options = literal_options(kind) or f.metadata.get("choices")
        convert = _boolean if kind is bool else (str if options and kind is not int else kind)
        group.add_argument(
            f"--megatron-ext-{name.replace('_', '-')}",
            type=convert,
            choices=options,
            default=None,
            help=f"optimizer.{name} of a megatron-ext recipe: {f.metadata.get('help', '')}",
        )
    return parser


def apply_arguments(config: Any, args: argparse.Namespace) -> Any:
    """Megatron-LM's ``OptimizerConfig`` with the ``--megatron-ext-*`` arguments given set on it
    (the optimizer's name, and each field as the extra attribute the drop-in reads)."""
    name = getattr(args, f"{EXT_PREFIX}optimizer", None)
    if name is not None:
        config.optimizer = name
    for field_name in _ext_fields():
        value = getattr(args, EXT_PREFIX + field_name, None)
        if value is not None:
            setattr(config, field_name, value)
    return config


def _from_megatron_lm(config: Any, model_chunks: Any, **kwargs: Any) -> Any:
    """Megatron-LM's ``get_megatron_optimizer`` call, answered by the drop-in with the
    ``--megatron-ext-*`` arguments of Megatron-LM's parsed command line applied."""
    from megatron.training import get_args

    from megatron_ext.megatron.drop_in import get_megatron_optimizer

    return get_megatron_optimizer(apply_arguments(config, get_args()), model_chunks, **kwargs)


def install() -> None:
    """Point Megatron-LM's training loop at the drop-in (``megatron.training.training``)."""
    try:
        import megatron.training.training as training
    except ImportError as err:
        raise ConfigError(
            "megatron_ext_args is Megatron-LM's extra_args_provider, but Megatron-LM's "
            f"megatron.training is not importable here ({err}): run it from a Megatron-LM "
            "checkout, or use megatron_ext.megatron.drop_in.get_megatron_optimizer directly"
        ) from None
    training.get_megatron_optimizer = _from_megatron_lm


def megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``pretrain(..., extra_args_provider=megatron_ext_args)``: the arguments, and the hook."""
    install()
    return add_arguments(parser)
