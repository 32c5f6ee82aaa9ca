"""A recipe sets only what its trainer reads (megatron_ext.config.reads): a field of another
trainer's section the trainer does not read, or a section it does not read at all, is refused
before launch; the recipe holds its trainer's sections and no other."""

from __future__ import annotations

import pytest

from megatron_ext.config import load_recipe
from megatron_ext.config.reads import check_reads, describe_reads
from megatron_ext.config.trainers import get_trainer, recipe_sections, trainer_sections, trainers
from megatron_ext.errors import ConfigError
from megatron_ext.launch.cli import main

SOMA_READS = (
    "soma, data.source, training.{exit_interval, exit_duration_in_mins, exit_signals}, "
    "and run_dir, seed, logging, checkpoint, launch"
)


def test_soma_refuses_the_optimizer_it_does_not_read() -> None:
    with pytest.raises(ConfigError) as caught:
        load_recipe("soma_tiny", ["optimizer.name=muon"])
    assert str(caught.value) == (
        f"trainer=soma does not read optimizer; it reads {SOMA_READS}: remove the key, "
        "or choose trainer=dipaco or trainer=gpt"
    )


def test_every_unread_field_is_counted_and_the_first_named() -> None:
    overrides = ["training.precision=bf16", "optimizer.name=muon", "model.num_layers=48"]
    with pytest.raises(
        ConfigError,
        match=r"^trainer=soma does not read training\.precision \(and 2 more: optimizer, model\)",
    ):
        load_recipe("soma_tiny", overrides)


def test_the_fields_soma_reads_are_accepted_and_reach_the_recipe() -> None:
    recipe = load_recipe("soma_tiny", ["seed=7", "training.exit_interval=3"])
    assert (recipe.seed, recipe.training.exit_interval) == (7, 3)
    assert list(recipe.sections) == ["soma", "data", "training"]  # what runs, nothing else
    assert not hasattr(recipe, "optimizer")  # its type has no such field: a checker says so


def test_gpt_owns_its_sections_and_the_others_borrow_them() -> None:
    owned = trainer_sections()
    for name in ("model", "optimizer", "data", "training", "parallel"):
        assert (
            name in get_trainer("gpt").sections and owned[name] is get_trainer("gpt").sections[name]
        )
    assert recipe_sections(get_trainer("dipaco"))["model"] is owned["model"]
    assert list(load_recipe("tiny_cpu_gpt").sections) == [
        "model",
        "optimizer",
        "data",
        "training",
        "parallel",
    ]


def test_gpt_refuses_another_trainers_section() -> None:
    with pytest.raises(ConfigError) as caught:
        load_recipe("tiny_cpu_gpt", ["soma.lr=3"])
    assert str(caught.value).startswith("trainer=gpt does not read soma; it reads model, ")
    assert str(caught.value).endswith("remove the key, or choose trainer=soma")


def test_a_misspelt_key_is_named_as_misspelt_first() -> None:
    with pytest.raises(ConfigError, match=r"^unknown key optimizer\.'nmae'; did you mean"):
        load_recipe("soma_tiny", ["optimizer.nmae=muon"])


@pytest.mark.parametrize("name", sorted(trainers()))
def test_each_trainer_declares_only_shared_sections_and_reads_its_own(name: str) -> None:
    spec = get_trainer(name)
    assert not set(spec.reads) & set(spec.sections)
    check_reads({key: {} for key in spec.sections}, spec)  # its own sections: read
    for section, fields in spec.reads.items():
        check_reads({section: dict.fromkeys(fields or ())}, spec)  # what it declares: read


def test_the_dry_run_says_what_the_trainer_reads(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "soma_tiny", "--dry-run"]) == 0
    assert f"trainer=soma reads {SOMA_READS}\n" in capsys.readouterr().err
    assert describe_reads(get_trainer("soma")) == SOMA_READS


def test_the_refusal_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "soma_tiny", "optimizer.name=muon", "--dry-run"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("megatron-ext: error: trainer=")


@pytest.mark.parametrize("recipe", ["tiny_cpu_gpt", "soma_tiny", "dipaco_tiny"])
def test_the_seed_is_the_recipes_own_and_the_old_place_names_the_new(recipe: str) -> None:
    """One seed for every trainer, in the core: ``training.seed`` (before) says where it went."""
    assert load_recipe(recipe, ["seed=7"]).seed == 7
    with pytest.raises(ConfigError) as caught:
        load_recipe(recipe, ["training.seed=7"])
    assert str(caught.value) == (
        "training.seed moved to the recipe's 'seed': write it there (seed: 7 in the YAML, "
        "seed=7 on the command line)"
    )
