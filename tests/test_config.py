"""Recipe validation and overrides: each mistake is one ConfigError naming the key and the fix;
the CLI turns it into one line on stderr and exit code 2; every shipped recipe validates.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ext.config import ConfigError, Recipe, load_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")

# The world size each cluster recipe is sized for; any other shipped recipe is a CPU recipe and
# must validate at its own launch.nproc_per_node_cpu (what `megatron-ext launch` uses on CPU).
CLUSTER_WORLD_SIZES = {"gpt_8b": 64, "gpt_1b": 8, "olmoe_1b_7b": 64, "qwen3_30b_a3b": 128}


def base_recipe() -> dict:
    return {
        "trainer": "gpt",
        "data": {"path": "/data/tokens"},
        "model": {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4},
        "training": {"micro_batch_size": 2, "global_batch_size": 8},
    }


def write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def load(
    tmp_path: Path, overrides: tuple[str, ...] = (), world_size: int | None = None, **sections: dict
) -> Recipe:
    raw = base_recipe()
    for name, values in sections.items():
        if isinstance(values, dict) and isinstance(raw.get(name), dict):
            raw[name].update(values)
        else:
            raw[name] = values
    return load_recipe(write(tmp_path, raw), overrides, world_size)


def test_base_recipe_is_valid(tmp_path: Path) -> None:
    recipe = load(tmp_path, world_size=2)
    assert recipe.model.hidden_size == 64 and recipe.training.global_batch_size == 8


# --------------------------------------------------------------------------- field checks


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (
            {"model": {"hiden_size": 64}},
            r"unknown key model\.'hiden_size'; did you mean "
            r"model\.'hidden_size'\?",
        ),
        ({"optimiser": {"lr": 1.0}}, r"unknown key 'optimiser'; did you mean 'optimizer'\?"),
        ({"training": {"zzz": 1}}, r"unknown key training\.'zzz'; valid keys: steps, "),
    ],
)
def test_unknown_key_suggests_the_closest(tmp_path: Path, sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, **sections)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"model": {"num_layers": "four"}}, "model.num_layers must be an integer, got 'four'"),
        ({"model": {"num_layers": 2.5}}, "model.num_layers must be an integer, got 2.5"),
        ({"model": {"num_layers": True}}, "model.num_layers must be an integer, got True"),
        ({"optimizer": {"lr": "fast"}}, "optimizer.lr must be a number, got 'fast'"),
        (
            {"parallel": {"sequence_parallel": 1}},
            "parallel.sequence_parallel must be true or false",
        ),
        ({"model": 3}, "model must be a mapping, got int 3"),
    ],
)
def test_wrong_type(tmp_path: Path, sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load(tmp_path, **sections)


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"model": {"num_layers": 0}}, "model.num_layers=0 is out of range: it must be >= 1"),
        (
            {"optimizer": {"adam_eps": 0.0}},
            "optimizer.adam_eps=0.0 is out of range: it must be > 0",
        ),
        (
            {"model": {"hidden_dropout": 1.5}},
            "model.hidden_dropout=1.5 is out of range: it must be <= 1.0",
        ),
        ({"launch": {"master_port": 70000}}, "launch.master_port=70000 is out of range"),
    ],
)
def test_out_of_range(tmp_path: Path, sections: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        load(tmp_path, **sections)


def test_bad_choice_lists_the_choices_and_suggests_one(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"training\.precision='bf61' is not one of fp32, "
        r"bf16.* \(did you mean 'bf16'\?\)",
    ):
        load(tmp_path, training={"precision": "bf61"})


# --------------------------------------------------------------------------- layout checks


@pytest.mark.parametrize(
    ("world_size", "parallel", "message"),
    [
        (
            6,
            {"tensor_model_parallel_size": 4},
            r"world size 6 is not divisible by tp\*pp\*cp = "
            r"4\*1\*1 = 4",
        ),
        (
            4,
            {"pipeline_model_parallel_size": 2, "context_parallel_size": 3},
            r"world size 4 is not divisible by tp\*pp\*cp = 1\*2\*3 = 6",
        ),
    ],
)
def test_parallel_sizes_must_divide_the_world(
    tmp_path: Path, world_size: int, parallel: dict, message: str
) -> None:
    # model and batch fit tp=4 / pp=2 themselves: only the world size is wrong
    model = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
    load(tmp_path, world_size=None, parallel=parallel, model=model)
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, world_size=world_size, parallel=parallel, model=model)


def test_global_batch_must_divide_by_micro_batch_times_dp(tmp_path: Path) -> None:
    load(tmp_path, world_size=4)  # 8 = 2 x 4
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size=8 is not divisible by "
        r"micro_batch_size\*dp = 2\*3 = 6: use a multiple of 6",
    ):
        load(tmp_path, world_size=3)
    # dp counts only data-parallel ranks: tp=2 on 8 ranks leaves dp=4, so 2*4 = 8 fits
    load(tmp_path, world_size=8, parallel={"tensor_model_parallel_size": 2})


# --------------------------------------------------------------------------- overrides


def test_overrides_nested_keys_and_scalar_types(tmp_path: Path) -> None:
    recipe = load(
        tmp_path,
        overrides=(
            "optimizer.lr=3e-4",  # YAML 1.1 reads this as a string
            "model.num_layers=6",
            "parallel.sequence_parallel=true",
            "logging.tensorboard=False",
            "training.lr_decay_steps=null",
            "data.source=[a.txt, b.txt]",
            "run_dir=runs/lr=3e-4",  # only the first '=' splits
        ),
    )
    assert recipe.optimizer.lr == 3e-4 and isinstance(recipe.optimizer.lr, float)
    assert recipe.model.num_layers == 6
    assert recipe.parallel.sequence_parallel is True
    assert recipe.logging.tensorboard is False
    assert recipe.training.lr_decay_steps is None
    assert recipe.data.source == ["a.txt", "b.txt"]
    assert recipe.run_dir == "runs/lr=3e-4"


def test_override_creates_a_missing_section(tmp_path: Path) -> None:
    assert load(tmp_path, overrides=("checkpoint.keep_last=5",)).checkpoint.keep_last == 5


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.lr", r"override 'optimizer\.lr' is not key=value"),
        ("=3", "has an empty key"),
        ("model.num_layers.x=1", r"'num_layers' is a value, not a section"),
        ("optimizer.lrr=1e-3", r"unknown key optimizer\.'lrr'; did you mean optimizer\.'lr'\?"),
        ("model.num_layers=0", r"model\.num_layers=0 is out of range"),
    ],
)
def test_bad_override(tmp_path: Path, override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(tmp_path, overrides=(override,))


# --------------------------------------------------------------------------- the CLI


def run_launch(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.run(
        [str(MEGATRON_EXT), "launch", *args, "--dry-run"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**env, "CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("unknown_key", "unknown key model.'hiden_size'; did you mean model.'hidden_size'?"),
        ("not_key_value", "override 'optimizer.lr' is not key=value"),
        ("layout", "world size 2 is not divisible by tp*pp*cp = 4*1*1 = 4"),
        ("missing_file", "recipe file 'no/such/recipe.yaml' not found"),
        (
            "wsd_window",
            "training.lr_decay_style=WSD: the final decay window (training.lr_wsd_decay_steps=15) "
            "must fit between the warmup's end (training.lr_warmup_steps=10) and the decay's end "
            "(20: training.lr_decay_steps; training.steps when unset), which leaves 10: shorten "
            "either, or run at least 25 steps",
        ),
    ],
)
def test_cli_prints_one_line_and_exits_2(tmp_path: Path, case: str, message: str) -> None:
    raw = base_recipe()
    args: list[str] = []
    if case == "unknown_key":
        raw["model"]["hiden_size"] = 64
    elif case == "not_key_value":
        args = ["optimizer.lr"]
    elif case == "layout":
        args = ["parallel.tensor_model_parallel_size=4"]  # 2 CPU ranks by default
    elif case == "wsd_window":  # the decay window does not fit after the warmup
        args = [
            "training.steps=20",
            "training.lr_warmup_steps=10",
            "training.lr_decay_style=WSD",
            "training.lr_wsd_decay_steps=15",
        ]
    path = "no/such/recipe.yaml" if case == "missing_file" else str(write(tmp_path, raw))
    proc = run_launch(path, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()  # one line: no traceback, no usage text
    assert line.startswith(f"megatron-ext: error: {message}")


# --------------------------------------------------------------------------- shipped recipes


def shipped_recipes() -> list[Path]:
    return sorted(RECIPES.glob("*.yaml"))


def test_the_cluster_recipes_are_shipped() -> None:
    assert {p.stem for p in shipped_recipes()} >= set(CLUSTER_WORLD_SIZES)


@pytest.mark.parametrize("path", shipped_recipes(), ids=lambda p: p.stem)
def test_shipped_recipe_validates_at_its_world_size(path: Path) -> None:
    recipe = load_recipe(path)
    world = CLUSTER_WORLD_SIZES.get(path.stem, recipe.launch.nproc_per_node_cpu)
    load_recipe(path, world_size=world)


def test_closed_sets_are_typed_once_by_the_module_that_implements_them() -> None:
    """The schema's decay styles and precisions are the Literal aliases of schedules.lr and
    run.precision (one edit adds one), and a value outside them is refused by name."""
    import typing

    from megatron_ext.config.fields import literal_options
    from megatron_ext.gpt.sections import TrainingConfig
    from megatron_ext.run.precision import PRECISIONS
    from megatron_ext.schedules.lr import DecayStyle, WsdDecayStyle

    hints = typing.get_type_hints(TrainingConfig)
    assert literal_options(hints["lr_decay_style"]) == typing.get_args(DecayStyle)
    assert literal_options(hints["lr_wsd_decay_style"]) == typing.get_args(WsdDecayStyle)
    assert literal_options(hints["precision"]) == PRECISIONS
    with pytest.raises(ConfigError) as caught:
        load_recipe("tiny_cpu_gpt", ["training.lr_decay_style=cosin"])
    assert str(caught.value) == (
        "training.lr_decay_style='cosin' is not one of constant, linear, cosine, WSD "
        "(did you mean 'cosine'?)"
    )
