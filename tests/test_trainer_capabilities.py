"""Trainer capabilities (issue 40): the commands that serve several trainers read what a trainer
declares on its :class:`~megatron_ext.config.trainers.TrainerSpec` (``plan``,
``token_schedule``, ``converts_hf``, ``trains_tokenizer``), never its name.

Two trainers registered here read the GPT trainer's sections and run its rules under other
names: ``gpt_reader`` declares the GPT trainer's capabilities, ``plain_reader`` none. The same
recipe under ``gpt_reader`` must be planned, scheduled and checked exactly as under ``gpt``; under
``plain_reader`` every such command refuses it in one line naming the trainer, as it refuses a
SOMA recipe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
from pathlib import Path

import pytest
import yaml

from megatron_ext.config import trainers as registry
from megatron_ext.config.load import read_recipe
from megatron_ext.config.trainers import TrainerSpec, get_trainer, register_trainer
from megatron_ext.errors import ConfigError
from megatron_ext.gpt.recipe import GPTRecipe, check_gpt
from megatron_ext.launch.cli import main
from megatron_ext.launch.dry_run import describe_job
from megatron_ext.launch.fit import job_plan
from megatron_ext.launch.hosts import HostInfo
from megatron_ext.launch.preflight_data import check_tokenizer_and_vocabulary
from megatron_ext.planner.gpus import gpu_spec
from megatron_ext.planner.inputs import Cluster
from megatron_ext.planner.outer import outer_figures
from megatron_ext.planner.plan import plan_run

GPT_SECTIONS = ("model", "optimizer", "data", "training", "parallel")
TINY = Path(__file__).parents[1] / "recipes" / "tiny_cpu_gpt.yaml"


def reader_recipe(name: str) -> type[GPTRecipe]:
    """A trainer ``name``'s typed recipe: the GPT recipe under another ``trainer``."""
    return dataclasses.make_dataclass(
        f"{name}_recipe",
        [("trainer", str, dataclasses.field(default=name))],
        bases=(GPTRecipe,),
        kw_only=True,
    )


@pytest.fixture
def readers(monkeypatch) -> None:
    """``gpt_reader`` (the GPT trainer's capabilities) and ``plain_reader`` (none) for one test."""
    monkeypatch.setattr(registry.TRAINERS, "_items", dict(registry.trainers()))
    monkeypatch.setattr(registry.TRAINERS, "_origin", dict(registry.TRAINERS._origin))
    gpt = get_trainer("gpt")
    for name, capabilities in (
        ("gpt_reader", {"plan": gpt.plan, "token_schedule": True, "converts_hf": True}),
        ("plain_reader", {}),
    ):
        register_trainer(
            TrainerSpec(
                name=name,
                train=gpt.train,
                check=check_gpt,
                recipe=reader_recipe(name),
                reads=dict.fromkeys(GPT_SECTIONS),
                **capabilities,
            )
        )


def tiny_as(tmp_path: Path, trainer: str, **data: str) -> str:
    """tiny_cpu_gpt.yaml as a ``trainer`` recipe (``data`` fields replaced), as a file."""
    raw = yaml.safe_load(TINY.read_text())
    raw["trainer"] = trainer
    raw["data"].update(data)
    raw["run_dir"] = str(tmp_path / "run")
    path = tmp_path / f"{trainer}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    """``megatron-ext ARGV`` in-process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def test_shipped_trainers_declare_what_their_commands_serve() -> None:
    gpt, dipaco, soma = (get_trainer(n) for n in ("gpt", "dipaco", "soma"))
    assert (gpt.plan, gpt.token_schedule, gpt.converts_hf, gpt.trains_tokenizer) == (
        "memory",
        True,
        True,
        False,
    )
    assert (dipaco.plan, dipaco.token_schedule, dipaco.converts_hf) == ("outer", False, False)
    assert dipaco.trains_tokenizer
    assert (soma.plan, soma.token_schedule, soma.converts_hf, soma.trains_tokenizer) == (
        None,
        False,
        False,
        False,
    )
    with pytest.raises(ValueError, match=r"trainer 'x': plan='gpt' is not one of"):
        TrainerSpec(
            name="x",
            train="m:f",
            check=check_gpt,
            recipe=reader_recipe("x"),
            plan="gpt",  # type: ignore[arg-type]
        )


def test_a_capable_trainer_is_served_as_gpt_and_one_without_is_refused(tmp_path, readers) -> None:
    gpt = read_recipe(tiny_as(tmp_path, "gpt"))
    reader_path = tiny_as(tmp_path, "gpt_reader")
    reader = read_recipe(reader_path)
    plain = read_recipe(tiny_as(tmp_path, "plain_reader"))
    cluster = Cluster(gpu_spec("h100"), 1, 2)
    # the memory plan and the dry run's schedule: the same figures and text as the GPT trainer's
    assert plan_run(reader, cluster).as_dict() == plan_run(gpt, cluster).as_dict()

    def schedule(recipe) -> list[str]:  # the dry run's report past its "trainer=... reads" line
        return describe_job(recipe, 2).split("\n")[1:]

    assert schedule(reader) == schedule(gpt) != []
    assert schedule(plain) == []
    with pytest.raises(ConfigError, match=r"plans GPT runs; this recipe is trainer=plain_reader"):
        plan_run(plain, cluster)
    with pytest.raises(ConfigError, match=r"a trainer=gpt_reader recipe has no outer step"):
        outer_figures(reader)
    host = HostInfo(gpus=8, cpus=16, gpu_name="NVIDIA H100 80GB HBM3")
    plan, why = job_plan(reader, reader_path, [], 1, 2, host)  # the launcher's fit check
    assert plan is not None and why == ""
    assert {**plan.as_dict(), "recipe": ""} == plan_run(gpt, cluster).as_dict()
    assert job_plan(plain, "p", [], 1, 2, host) == (
        None,
        "no plan: trainer=plain_reader (megatron-ext plan plans GPT runs)",
    )


def test_commands_refuse_a_trainer_without_the_capability_in_one_line(tmp_path, readers) -> None:
    plain = tiny_as(tmp_path, "plain_reader")
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text("{}")
    for argv, says in (
        (["plan", plain], "plans GPT runs; " + plain + " is trainer=plain_reader"),
        (["bench", "plan", "--recipes", plain, "--out", str(tmp_path / "b")], "trainer=plain_"),
        (["bench", "ramp", plain, "--out", str(tmp_path / "r")], "is trainer plain_reader"),
        (
            ["convert", "mcore-to-hf", str(ckpt), str(tmp_path / "hf"), "--recipe", plain],
            "is a trainer=plain_reader recipe: give the GPT recipe",
        ),
    ):
        code, out, err = run_cli(argv)
        assert (code, out) == (2, ""), (argv, err)
        (line,) = err.splitlines()
        assert line.startswith("megatron-ext") and says in line, (argv, line)
    # nothing written: no output folder, no run_dir
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain_reader.yaml", "step_000001"]


def test_only_a_trainer_that_trains_its_tokenizer_may_lack_the_file(tmp_path, readers) -> None:
    """DiPaCo's prepare task trains ``data.tokenizer_model`` from ``data.source``: the launch
    check lets it be missing for a ``trains_tokenizer`` trainer, and only for one."""
    missing = {"tokenizer": "sentencepiece", "tokenizer_model": str(tmp_path / "no.model")}
    dipaco = read_recipe("dipaco_tiny", [f"data.{k}={v}" for k, v in missing.items()])
    assert get_trainer(dipaco.trainer).trains_tokenizer and dipaco.data.source
    check_tokenizer_and_vocabulary(dipaco)  # nothing to check yet: the run trains it
    for trainer in ("gpt", "gpt_reader"):
        with pytest.raises(ConfigError, match=r"data.tokenizer_model=.*no\.model' does not exist"):
            check_tokenizer_and_vocabulary(read_recipe(tiny_as(tmp_path, trainer, **missing)))
