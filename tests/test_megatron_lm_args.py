"""``extra_args_provider=megatron_ext_args``: a Megatron-LM command line selects megatron-ext's
optimizers and their options (megatron_ext/megatron/megatron_lm.py).

Megatron-LM's training package is not installable here: its parser is stood in for by one with
its ``--optimizer`` (0.19's choices) and the fields it copies into megatron-core's
``OptimizerConfig`` as its ``get_megatron_optimizer_config`` does (every OptimizerConfig field
the parsed arguments hold); ``install`` is checked on a stand-in ``megatron.training`` module.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types

import pytest
from megatron.core.optimizer import OptimizerConfig

from megatron_ext.megatron import drop_in
from megatron_ext.megatron.megatron_lm import add_arguments, apply_arguments, install

MEGATRON_LM_OPTIMIZERS = ["adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"]


def megatron_lm_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_argument("--optimizer", default="adam", choices=MEGATRON_LM_OPTIMIZERS)
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--muon-momentum", type=float, default=0.9)
    return add_arguments(parser)


def optimizer_config(args: argparse.Namespace) -> OptimizerConfig:
    """As Megatron-LM's get_megatron_optimizer_config builds it."""
    fields = {f.name for f in dataclasses.fields(OptimizerConfig)}
    return OptimizerConfig(**{k: v for k, v in vars(args).items() if k in fields})


def test_kl_soap_and_its_options_from_a_megatron_lm_command_line() -> None:
    argv = [
        *("--optimizer", "adam", "--lr", "1e-3", "--megatron-ext-optimizer", "kl_soap"),
        *("--megatron-ext-kl-soap-factor-eps", "1e-10", "--megatron-ext-match-update-rms", "false"),
        *("--megatron-ext-kl-soap-refresh-every", "10"),
    ]
    args = megatron_lm_parser().parse_args(argv)
    ext = drop_in.extension_config(apply_arguments(optimizer_config(args), args))
    assert (ext.name, ext.lr, ext.kl_soap_factor_eps, ext.match_update_rms) == (
        "kl_soap",
        1e-3,
        1e-10,
        False,
    )
    assert ext.kl_soap_refresh_every == 10


def test_without_the_ext_optimizer_megatron_lms_own_choice_stands() -> None:
    args = megatron_lm_parser().parse_args(["--optimizer", "muon", "--lr", "2e-3"])
    config = apply_arguments(optimizer_config(args), args)
    ext = drop_in.extension_config(config)
    assert (ext.name, ext.muon_momentum, ext.muon_coefficient_type) == (
        "muon",
        0.9,
        "quintic_schedule",
    )
    args = megatron_lm_parser().parse_args(["--optimizer", "adam", "--lr", "2e-3"])
    assert drop_in.extension_name(apply_arguments(optimizer_config(args), args).optimizer) is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--megatron-ext-optimizer", "shampoo"],
        ["--megatron-ext-muon-ns-method", "newton"],
        ["--megatron-ext-match-update-rms", "maybe"],
    ],
)
def test_a_bad_value_is_argparses_error(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        megatron_lm_parser().parse_args(argv)
    assert stop.value.code == 2 and "megatron-ext" in capsys.readouterr().err


def test_install_points_megatron_lms_loop_at_the_drop_in(monkeypatch) -> None:
    """The training loop's get_megatron_optimizer becomes the drop-in, reading get_args()."""
    training_pkg = types.ModuleType("megatron.training")
    training_mod = types.ModuleType("megatron.training.training")
    training_mod.get_megatron_optimizer = None
    args = megatron_lm_parser().parse_args(["--megatron-ext-optimizer", "mop", "--lr", "1e-3"])
    training_pkg.get_args = lambda: args
    training_pkg.training = training_mod
    monkeypatch.setitem(sys.modules, "megatron.training", training_pkg)
    monkeypatch.setitem(sys.modules, "megatron.training.training", training_mod)
    # `import megatron.training.training as x` reads the attribute of the package `megatron`,
    # set once the real package was imported (the converter imports it in this process)
    monkeypatch.setattr(sys.modules["megatron"], "training", training_pkg, raising=False)
    seen = {}
    monkeypatch.setattr(
        drop_in,
        "get_megatron_optimizer",
        lambda config, chunks, **kw: seen.update(name=config.optimizer),
    )
    install()
    training_mod.get_megatron_optimizer(optimizer_config(args), [], config_overrides=None)
    assert seen == {"name": "mop"}


def test_install_without_megatron_lm_says_so(monkeypatch) -> None:
    from megatron_ext.errors import ConfigError

    monkeypatch.setitem(sys.modules, "megatron.training", None)
    monkeypatch.setitem(sys.modules, "megatron.training.training", None)  # if imported before
    with pytest.raises(ConfigError, match=r"megatron\.training is not importable"):
        install()
