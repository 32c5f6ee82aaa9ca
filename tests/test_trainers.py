"""The registries: trainers (what ``trainer: NAME`` means), the per-rank entry point
that runs them, and the CLI's sub-commands and benchmarks.

A toy trainer registered here, from outside the package, must be accepted by the schema exactly
as the shipped ones are: its own section, its own rules, its train entry by import path.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from megatron_ext.config import load_recipe
from megatron_ext.config import trainers as registry
from megatron_ext.config.fields import spec
from megatron_ext.config.schema import Recipe
from megatron_ext.config.trainers import TrainerSpec, get_trainer, register_trainer
from megatron_ext.errors import ConfigError, TrainingDivergedError
from megatron_ext.soma.recipe import SomaConfig

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")


@dataclass
class ToyConfig:
    width: int = spec(2, ge=1)
    diverge: bool = False
    marker: str = ""


@dataclass(kw_only=True)
class ToyRecipe(Recipe):
    """The toy trainer's typed recipe: the core and its own section."""

    trainer: str = "toy"
    toy: ToyConfig = field(default_factory=ToyConfig)


def toy_check(recipe, world_size: int | None) -> None:
    toy = recipe.section(ToyConfig)
    if world_size is not None and toy.width % world_size:
        raise ConfigError(f"toy.width={toy.width} is not divisible by {world_size} ranks")


def toy_train(recipe) -> None:
    """The toy's train entry (imported by path): leaves a marker, or diverges."""
    toy = recipe.section(ToyConfig)
    if toy.diverge:
        raise TrainingDivergedError("toy: the loss is nan; lower toy.width")
    Path(toy.marker).write_text(f"{recipe.trainer} {toy.width}\n")


@pytest.fixture
def toy(monkeypatch):
    """The toy trainer in the registry for one test (the shipped ones discovered first)."""
    monkeypatch.setattr(registry.TRAINERS, "_items", dict(registry.trainers()))
    monkeypatch.setattr(registry.TRAINERS, "_origin", dict(registry.TRAINERS._origin))
    return register_trainer(
        TrainerSpec(
            name="toy",
            train="tests.test_trainers:toy_train",
            check=toy_check,
            recipe=ToyRecipe,
        )
    )


def write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def gpt_recipe(**top: object) -> dict:
    return {"data": {"path": "/data/tokens"}, **top}


# --------------------------------------------------------------------------- registry


def test_the_shipped_trainers_register_themselves() -> None:
    assert {"gpt", "soma"} <= set(registry.trainers())
    soma = get_trainer("soma")
    assert soma.sections == {"soma": SomaConfig} and soma.train == "megatron_ext.soma.trainer:train"
    assert set(get_trainer("gpt").sections) == {
        "model",
        "optimizer",
        "data",
        "training",
        "parallel",
    }


def test_unregistered_trainer_is_one_config_error_naming_the_registered_ones(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"trainer='hivemind' is not a registered trainer; "):
        load_recipe(write(tmp_path, gpt_recipe(trainer="hivemind")))
    with pytest.raises(ConfigError, match=r"\(did you mean 'soma'\?\).*dipaco, gpt, soma"):
        load_recipe(write(tmp_path, gpt_recipe(trainer="smoa")))


def test_unregistered_trainer_fails_at_launch_validation_with_exit_2(tmp_path) -> None:
    """Not a dry run: had validation passed, torchrun would start two ranks that fail later
    (exit 1, their tracebacks); the launcher must stop first with one line and exit 2."""
    recipe = write(tmp_path, gpt_recipe(trainer="hivemind", run_dir=str(tmp_path / "run")))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    start = time.perf_counter()
    proc = subprocess.run(
        [str(MEGATRON_EXT), "launch", str(recipe)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("megatron-ext: error: trainer='hivemind' is not a registered trainer")
    assert line.endswith("registered trainers: dipaco, gpt, soma"), line
    assert not (tmp_path / "run").exists()
    # no rendezvous was waited for (its timeout: 600 s); the bound leaves room for a loaded host
    assert time.perf_counter() - start < 300


def test_a_trainer_registered_from_a_test_is_accepted(tmp_path, toy) -> None:
    recipe = load_recipe(write(tmp_path, {"trainer": "toy", "toy": {"width": 4}}), world_size=2)
    assert recipe.section(ToyConfig).width == 4
    # its rules are the ones that run: no GPT rule (data.path is empty here), the toy's rule does
    with pytest.raises(ConfigError, match=r"toy\.width=4 is not divisible by 3 ranks"):
        load_recipe(write(tmp_path, {"trainer": "toy", "toy": {"width": 4}}), world_size=3)
    # its section is parsed like any other: typos, types and ranges
    with pytest.raises(ConfigError, match=r"unknown key toy\.'widht'; did you mean toy\.'width'"):
        load_recipe(write(tmp_path, {"trainer": "toy", "toy": {"widht": 4}}))
    with pytest.raises(ConfigError, match=r"toy\.width=0 is out of range"):
        load_recipe(write(tmp_path, {"trainer": "toy"}), ["toy.width=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'toyy'; did you mean 'toy'"):
        load_recipe(write(tmp_path, {"trainer": "toy", "toyy": {}}))
    # a recipe of another trainer holds its own trainer's sections only
    assert "toy" not in load_recipe(write(tmp_path, gpt_recipe())).sections


def test_a_second_trainer_of_the_same_name_is_refused(toy) -> None:
    with pytest.raises(ValueError, match="two trainers are named 'toy'"):
        register_trainer(
            TrainerSpec(name="toy", train="tests.x:other", check=toy_check, recipe=ToyRecipe)
        )
    register_trainer(toy)  # the same object again is not a second registration


# --------------------------------------------------------------------------- entry point


def test_train_entry_runs_the_registered_trainer_by_its_import_path(tmp_path, toy) -> None:
    from megatron_ext.run.entry import train_main

    marker = tmp_path / "ran"
    recipe = write(tmp_path, {"trainer": "toy", "toy": {"marker": str(marker)}})
    assert train_main(str(recipe), ["toy.width=3"]) == 0
    assert marker.read_text() == "toy 3\n"


def test_a_diverged_run_is_one_line_and_exit_1(tmp_path, toy, capsys) -> None:
    from megatron_ext.run.entry import train_main

    recipe = write(tmp_path, {"trainer": "toy"})
    assert train_main(str(recipe), ["toy.diverge=true"]) == 1
    assert capsys.readouterr().err == "megatron-ext: error: toy: the loss is nan; lower toy.width\n"


# --------------------------------------------------------------------------- commands


def test_every_sub_command_is_declared_in_its_own_package() -> None:
    from megatron_ext.commands import commands

    owners = {name: c.run.__module__ for name, c in commands().items()}
    assert owners["launch"] == "megatron_ext.launch.cli"
    assert owners["train"] == "megatron_ext.run.cli"
    assert owners["data"] == "megatron_ext.data.cli"
    assert owners["bench"] == "megatron_ext.bench.cli"
    assert owners["soma"] == "megatron_ext.soma.cli"


def test_a_second_command_of_the_same_name_is_refused() -> None:
    from megatron_ext.commands import Command, commands, register_command

    data = commands()["data"]
    register_command(data)  # the same object again is not a second registration
    with pytest.raises(ValueError, match="two commands are named 'data'"):
        register_command(
            Command(name="data", usage="", help="", add_arguments=lambda p: None, run=lambda a: 0)
        )


def test_benchmarks_are_modules_of_the_bench_package() -> None:
    from megatron_ext.bench import benchmarks

    found = benchmarks()
    assert {"optimizers", "layerwise", "soma"} <= set(found)
    assert "common" not in found and "cli" not in found  # helpers
    for module in found.values():
        assert module.DESCRIPTION and callable(module.add_arguments) and callable(module.run)
