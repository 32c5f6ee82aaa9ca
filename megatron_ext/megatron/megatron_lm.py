"""megatron-ext's optimizers on Megatron-LM's command line, in Megatron-LM's own training loop.

Two ways in, both tested with ``megatron.training.pretrain`` itself:

- zero edits: ``torchrun ... -m megatron_ext.megatron.run_pretrain pretrain_gpt.py ARGS
  --megatron-ext-optimizer kl_soap`` (:mod:`.run_pretrain`), which calls
  :func:`add_to_megatron_parser` and :func:`install` and runs the script as ``__main__``;
- two lines in Megatron-LM 0.19's ``pretrain_gpt.py``, whose ``__main__`` parses the command line
  with ``parse_and_validate_args(extra_args_provider=...)`` (``pretrain()`` itself takes a
  parsed ``PretrainConfigContainer`` in 0.19, no ``extra_args_provider``)::

      from megatron_ext.megatron.megatron_lm import megatron_ext_args
      args = parse_and_validate_args(extra_args_provider=megatron_ext_args, ...)

:func:`add_arguments` adds the group ``megatron-ext``: ``--megatron-ext-optimizer
{muon,kl_soap,mop,lion}`` (Megatron-LM's ``--optimizer`` has no ``kl_soap`` or ``mop``) and one
``--megatron-ext-<field>`` per field of the recipe's ``optimizer:`` section that Megatron-LM's
command line cannot spell (``--megatron-ext-kl-soap-factor-eps 1e-10``,
``--megatron-ext-match-update-rms true``, ...; a field megatron-core has under another name,
e.g. ``muon_split_qkv`` for ``split_qkv``, keeps Megatron-LM's flag). :func:`install` points
Megatron-LM's training loop (``megatron.training.training.get_megatron_optimizer``) at
:func:`megatron_lm_optimizer`: with ``--megatron-ext-optimizer`` the drop-in (:mod:`.drop_in`)
builds megatron-ext's layer-wise optimizer from Megatron-LM's ``OptimizerConfig`` (Megatron-LM's
defaults: megatron-core's routing, raw update scale, every ``--muon-*`` flag); without it
Megatron-LM's ``--optimizer`` is megatron-core's own, called unchanged. On a host without CUDA
:func:`install` also applies the CPU compatibility modules (:mod:`.cpu_compat`,
:mod:`.cpu_compat_training`), so the same command runs on gloo.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from megatron_ext.errors import ConfigError

__all__ = [
    "EXT_PREFIX",
    "add_arguments",
    "add_to_megatron_parser",
    "apply_arguments",
    "check_checkpoint_format",
    "install",
    "megatron_ext_args",
    "megatron_lm_optimizer",
]

EXT_PREFIX = "megatron_ext_"


def _ext_fields() -> dict[str, tuple[dataclasses.Field, Any]]:
    """The recipe's optimizer fields Megatron-LM's command line cannot spell: not megatron-core
    ``OptimizerConfig`` fields, nor the fields the drop-in reads from one (``split_qkv`` from
    ``muon_split_qkv``, ``tp_mode`` from ``muon_tp_mode``, ...)."""
    from megatron.core.optimizer import OptimizerConfig as McOptimizerConfig

    from megatron_ext.config.optimizer import section_fields
    from megatron_ext.megatron.drop_in import mapped_fields

    theirs = {f.name for f in dataclasses.fields(McOptimizerConfig)} | mapped_fields()
    return {
        name: found for name, found in section_fields().items() if name not in theirs | {"name"}
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
    from megatron_ext.megatron.drop_in import extension_optimizers

    group = parser.add_argument_group("megatron-ext")
    group.add_argument(
        "--megatron-ext-optimizer",
        choices=extension_optimizers(),
        default=None,
        help="train with megatron-ext's layer-wise optimizer (instead of --optimizer)",
    )
    for name, (f, kind) in _ext_fields().items():
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


def megatron_lm_optimizer(config: Any, model_chunks: Any, **kwargs: Any) -> Any:
    """Megatron-LM's ``get_megatron_optimizer`` call: the drop-in with the ``--megatron-ext-*``
    arguments applied when ``--megatron-ext-optimizer`` is given, else megatron-core's own."""
    from megatron.core.optimizer import get_megatron_optimizer as megatron_core_optimizer
    from megatron.training import get_args

    from megatron_ext.megatron.drop_in import get_megatron_optimizer

    args = get_args()
    if getattr(args, f"{EXT_PREFIX}optimizer", None) is None:
        given = [f for f in _ext_fields() if getattr(args, EXT_PREFIX + f, None) is not None]
        if given:
            raise ConfigError(
                f"--megatron-ext-{given[0].replace('_', '-')} is an option of megatron-ext's "
                f"optimizers, but no --megatron-ext-optimizer was given (--optimizer "
                f"{config.optimizer} is megatron-core's own): add --megatron-ext-optimizer"
            )
        return megatron_core_optimizer(config, model_chunks, **kwargs)
    from megatron.core import parallel_state

    check_checkpoint_format(args, parallel_state.get_data_parallel_world_size())
    return get_megatron_optimizer(apply_arguments(config, args), model_chunks, **kwargs)


def check_checkpoint_format(args: argparse.Namespace, data_parallel_size: int) -> None:
    """Refuse Megatron-LM's legacy ``--ckpt-format torch`` for megatron-ext's optimizer at
    data-parallel size > 1 when the run saves or loads: that format writes the optimizer state
    of data-parallel rank 0 only, and megatron-ext's state is sharded over the data-parallel
    ranks (AdamW element-sharded as ZeRO-1, each matrix's state on the rank that owns it), so
    the other ranks' state would be lost. Raised before anything is written."""
    if args.ckpt_format != "torch" or data_parallel_size <= 1 or not (args.save or args.load):
        return
    raise ConfigError(
        f"--ckpt-format torch saves data-parallel rank 0's optimizer state only, but "
        f"megatron-ext's optimizer keeps its state sharded over the {data_parallel_size} "
        f"data-parallel ranks (AdamW as ZeRO-1, each matrix on its owner): use --ckpt-format "
        f"torch_dist (Megatron-LM's default)"
    )


def _training_module() -> Any:
    try:
        import megatron.training.training as training
    except ImportError as err:  # a megatron-core without its training package
        raise ConfigError(
            f"Megatron-LM's megatron.training is not importable here ({err}): install "
            "megatron-core>=0.19 (its wheel ships it), or use "
            "megatron_ext.megatron.drop_in.get_megatron_optimizer in your own loop"
        ) from None
    return training


def install() -> bool:
    """Point Megatron-LM's training loop at :func:`megatron_lm_optimizer`, and on a host
    without CUDA apply the CPU compatibility modules. Returns whether they were applied."""
    from megatron_ext.megatron.cpu_compat import apply_cpu_compat
    from megatron_ext.megatron.cpu_compat_training import apply_training_cpu_compat

    training = _training_module()
    training.get_megatron_optimizer = megatron_lm_optimizer
    return apply_cpu_compat() and apply_training_cpu_compat()


def add_to_megatron_parser() -> None:
    """Add the ``megatron-ext`` group to every parser Megatron-LM's ``parse_args`` builds (its
    ``add_megatron_arguments``), whatever ``extra_args_provider`` the script passes."""
    import megatron.training.arguments as arguments

    megatron_arguments = arguments.add_megatron_arguments
    if getattr(megatron_arguments, "adds_megatron_ext", False):
        return

    def with_megatron_ext(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        return add_arguments(megatron_arguments(parser))

    with_megatron_ext.adds_megatron_ext = True  # type: ignore[attr-defined]
    arguments.add_megatron_arguments = with_megatron_ext


def megatron_ext_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``parse_and_validate_args(extra_args_provider=megatron_ext_args)``: the arguments, and
    :func:`install`."""
    install()
    return add_arguments(parser)
