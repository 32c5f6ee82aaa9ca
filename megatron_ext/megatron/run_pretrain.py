"""Run an unmodified Megatron-LM training script with megatron-ext's optimizers available::

    torchrun --nproc-per-node 8 -m megatron_ext.megatron.run_pretrain pretrain_gpt.py \\
        <Megatron-LM arguments> --megatron-ext-optimizer kl_soap

Before the script runs (as ``__main__``, from its own folder, so ``gpt_builders.py`` and
``model_provider.py`` beside it import as they do under ``python pretrain_gpt.py``):

1. every parser Megatron-LM's ``parse_args`` builds gets the ``megatron-ext`` group
   (:func:`~.megatron_lm.add_to_megatron_parser`), whatever ``extra_args_provider`` the script
   passes;
2. Megatron-LM's training loop gets its optimizer from :func:`~.megatron_lm.megatron_lm_optimizer`
   (megatron-ext's with ``--megatron-ext-optimizer``, megatron-core's own without), and on a
   host without CUDA the CPU compatibility modules are applied (:func:`~.megatron_lm.install`);
   pass ``--distributed-backend gloo`` there;
3. megatron-core's dataset index helpers are not recompiled when the installed wheel ships
   them built (:func:`use_built_dataset_helpers`).

So the same command runs on a laptop (gloo) and on a cluster (NCCL).
"""

from __future__ import annotations

import os
import runpy
import sys

from megatron_ext.errors import ConfigError

__all__ = ["main", "use_built_dataset_helpers"]

USAGE = (
    "usage: python -m megatron_ext.megatron.run_pretrain SCRIPT.py [Megatron-LM arguments] "
    "[--megatron-ext-optimizer {muon,kl_soap,mop,lion}] [--megatron-ext-<field> VALUE ...]"
)


def use_built_dataset_helpers() -> bool:
    """Megatron-LM's ``initialize`` runs ``make`` in megatron-core's ``datasets`` folder on rank
    0 (``compile_helpers``); the megatron-core wheel ships ``helpers_cpp`` built and no
    Makefile, so ``make`` fails and the run exits. When ``helpers_cpp`` imports, the compile is
    replaced by nothing (a source checkout without the built module compiles as before).
    Returns whether it was replaced."""
    import megatron.core.datasets.utils as dataset_utils

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError:
        return False
    dataset_utils.compile_helpers = lambda: None
    return True


def main(argv: list[str] | None = None) -> None:
    """Run ``argv[0]`` (a Megatron-LM training script) with ``argv[1:]`` as its arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-") or not os.path.isfile(argv[0]):
        given = f" ({argv[0]!r} is no file)" if argv and not argv[0].startswith("-") else ""
        raise SystemExit(f"{USAGE}\nerror: the first argument must be the script{given}")
    from megatron_ext.megatron.megatron_lm import add_to_megatron_parser, install

    script = os.path.abspath(argv[0])
    add_to_megatron_parser()
    install()
    use_built_dataset_helpers()
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    try:
        runpy.run_path(script, run_name="__main__")
    except ConfigError as err:  # bad input: one line, no traceback
        raise SystemExit(f"megatron-ext: {err}") from None


if __name__ == "__main__":
    main()
