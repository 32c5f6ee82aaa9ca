"""DiPaCo's recipe section: levels x modules against the model, the queue URL, the rules, the
shipped recipes; bad input is one line, exit code 2, and nothing written (torch-free)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_ext.config import load_recipe
from megatron_ext.config.trainers import get_trainer
from megatron_ext.dipaco.model.layout import ModuleId, PathLayout, parse_parts, part_of
from megatron_ext.dipaco.queue.url import parse_queue_url
from megatron_ext.dipaco.recipe import DipacoConfig, path_layout, queue_url
from megatron_ext.errors import ConfigError

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")


def tiny(tmp_path: Path, *overrides: str):
    """dipaco_tiny with overrides, its run folder under ``tmp_path``."""
    return load_recipe("dipaco_tiny", [f"run_dir={tmp_path / 'run'}", *overrides])


def test_dipaco_is_a_registered_trainer_with_its_own_section() -> None:
    spec = get_trainer("dipaco")
    assert spec.sections == {"dipaco": DipacoConfig}
    assert spec.train == "megatron_ext.dipaco.trainer:train"


def test_the_shipped_recipes_validate(tmp_path: Path) -> None:
    r = tiny(tmp_path)
    layout = path_layout(r)
    assert layout.num_paths == 4 and layout.modules_per_level == (2, 2)
    paper = load_recipe("dipaco_paper")
    big = path_layout(paper)
    assert big.num_paths == 256 and big.modules_per_level == (16, 16)
    assert big.path_specific == ("embedding", "block0", "block5", "block6", "block11")
    assert queue_url(paper).backend == "postgresql"
    assert queue_url(r).backend == "sqlite"
    assert queue_url(r).path == tmp_path / "run" / "queue.db"
    # the paper's path: 12 blocks of 12·h² + norms and a tied 32k embedding, ~150M parameters
    m = paper.model
    h, f = m.hidden_size, m.ffn_hidden_size
    per_block = 4 * h * h + 3 * h * f + 2 * h
    total = m.num_layers * per_block + 32000 * h + h
    assert 140e6 < total < 155e6


def test_paths_are_mixed_radix_digits_and_modules_know_their_paths() -> None:
    layout = PathLayout((2, 3), (("embedding", "block0"), ("block1", "final_layernorm")))
    assert layout.num_paths == 6
    assert layout.path_modules(4) == (ModuleId(0, 1), ModuleId(1, 1))
    assert layout.path_modules(2) == (ModuleId(0, 0), ModuleId(1, 2))
    assert layout.paths_of(ModuleId(1, 0)) == (0, 3)
    assert layout.paths_of(ModuleId(0, 1)) == (3, 4, 5)
    # every path uses exactly one module per level, every module P / K_l paths
    for module in layout.modules:
        assert len(layout.paths_of(module)) == 6 // layout.modules_per_level[module.level]
    assert layout.param_level("decoder.layers.1.mlp.linear_fc1.weight") == 1
    assert layout.param_level("embedding.word_embeddings.weight") == 0


def test_parts_and_parameter_names() -> None:
    assert parse_parts("embedding, 0-2 5", 6, "x") == (
        "embedding",
        "block0",
        "block1",
        "block2",
        "block5",
    )
    assert part_of("decoder.layers.11.self_attention.linear_qkv.weight") == "block11"
    assert part_of("decoder.final_layernorm.weight") == "final_layernorm"
    assert part_of("output_layer.weight") == "output_layer"
    with pytest.raises(KeyError):
        part_of("something.else")


def test_even_split_when_level_parts_are_not_given(tmp_path: Path) -> None:
    r = tiny(
        tmp_path,
        "dipaco.level_parts=[]",
        "dipaco.modules_per_level=[2,2,2]",
        "dipaco.path_specific=3",
    )
    layout = path_layout(r)
    assert layout.level_parts == (
        ("embedding", "block0"),
        ("block1",),
        ("block2", "final_layernorm", "output_layer"),
    )
    assert layout.path_specific == ("block3",)
    assert layout.num_paths == 8


def test_flat_moe_and_dense_diloco_are_layouts_too(tmp_path: Path) -> None:
    flat = path_layout(tiny(tmp_path, "dipaco.modules_per_level=[4]", "dipaco.level_parts=[]"))
    assert flat.num_paths == 4 and all(len(flat.paths_of(m)) == 1 for m in flat.modules)
    dense = path_layout(
        tiny(
            tmp_path,
            "dipaco.modules_per_level=[1]",
            "dipaco.level_parts=[]",
            "dipaco.train_overlap=1",
        )
    )
    assert dense.num_paths == 1 and dense.paths_of(ModuleId(0, 0)) == (0,)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["dipaco.level_parts=['embedding 0-1']"], "has 1 entries but"),
        (["dipaco.level_parts=['embedding 0-1', '2 final_layernorm output_layer']"], "block3"),
        (["dipaco.level_parts=['embedding 0-1', '1-3 final_layernorm output_layer']"], "both"),
        (["dipaco.level_parts=['embedding 0-1', '2-4 final_layernorm output_layer']"], "block 4"),
        (["dipaco.level_parts=['embedding 0-1', '2-3 head']"], "'head' is not"),
        (["dipaco.level_parts=['embedding 0-1', '3-2']"], "empty"),
        (["dipaco.path_specific=0"], "both"),
        (["dipaco.modules_per_level=[2,0]"], "at least one module"),
        (["dipaco.modules_per_level=[]"], "is empty"),
        (["model.untie_embeddings_and_output_weights=false"], "tied"),
        (["dipaco.train_overlap=5"], "exceeds the 4 paths"),
        (["dipaco.route_tokens=96"], "route_tokens"),
        (["dipaco.heartbeat_seconds=60"], "heartbeat"),
        (["dipaco.eval_every_tokens=[]"], "eval_every_tokens"),
        (["parallel.tensor_model_parallel_size=2"], "one rank"),
        (["model.num_moe_experts=4"], "dense"),
        (["training.exit_interval=5"], "stop workers with a stop signal"),
        (["dipaco.queue=mysql://host/db"], "unknown scheme"),
        (["dipaco.queue=sqlite://host/queue.db"], "three slashes"),
        (["dipaco.queue=postgresql://host:99999/db"], "not a valid URL"),
        (["dipaco.queue=postgresql://host:5432/"], "names no database"),
        (["dipaco.queue=postgresql:///db"], "names no server"),
        (["dipaco.routing=discrimnative"], "did you mean 'discriminative'"),
        (["dipaco.outer_lr=0"], "out of range"),
        (["dipaco.inner_warmup_steps=1000"], "inner_warmup_steps"),
        (["dipaco.ranks_per_worker=2"], "divide the 8 // 8 micro-batches"),
        (
            ["dipaco.ranks_per_worker=2", "training.micro_batch_size=4", "dipaco.inner=spsa"],
            "has none",
        ),
    ],
)
def test_bad_dipaco_input_is_one_config_error(tmp_path: Path, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny(tmp_path, *overrides)


def test_queue_urls() -> None:
    rel = parse_queue_url("sqlite:///runs/x/q.db")
    assert rel.backend == "sqlite" and rel.path == Path("runs/x/q.db")
    assert parse_queue_url("sqlite:////tmp/q.db").path == Path("/tmp/q.db")
    assert parse_queue_url("", "/abs/run").path == Path("/abs/run/queue.db")
    pg = parse_queue_url("postgresql://me:secret@db:5433/dipaco")
    assert pg.backend == "postgresql" and pg.conninfo.endswith("/dipaco")
    assert "secret" not in pg.display and pg.display == "postgresql://me@db:5433/dipaco"
    sock = parse_queue_url("postgresql:///dipaco?host=/tmp/pg")
    assert sock.backend == "postgresql"


def test_bad_recipe_stops_the_cli_with_one_line_exit_2_and_writes_nothing(tmp_path: Path) -> None:
    raw = yaml.safe_load((Path(__file__).parents[1] / "recipes" / "dipaco_tiny.yaml").read_text())
    raw["run_dir"] = str(tmp_path / "run")
    raw["dipaco"]["level_parts"] = ["embedding 0-1", "2-5 final_layernorm output_layer"]
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    for command in (["launch", str(bad)], ["train", str(bad)], ["dipaco", "worker", str(bad)]):
        proc = subprocess.run(
            [str(MEGATRON_EXT), *command], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 2, (command, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and "block 5 does not exist" in lines[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_ranks_per_worker_must_divide_the_job(tmp_path: Path) -> None:
    """The launcher checks the recipe at its world size: R-rank workers need a multiple of R."""
    recipe = tiny(tmp_path, "dipaco.ranks_per_worker=2", "training.micro_batch_size=4")
    recipe.check(world_size=4)
    with pytest.raises(ConfigError, match="does not divide the job's 3 ranks"):
        recipe.check(world_size=3)


def test_the_run_fingerprint_covers_the_model_and_not_the_queue_timing(tmp_path: Path) -> None:
    """Workers of another model or optimizer are refused; workers that only differ in lease
    timing, logging or launching agree (megatron_ext.dipaco.run.plan.run_fingerprint)."""
    from megatron_ext.dipaco.run.plan import run_fingerprint

    base = run_fingerprint(tiny(tmp_path))
    for same in ("dipaco.lease_seconds=90", "logging.log_interval=7", "launch.master_port=29999"):
        assert run_fingerprint(tiny(tmp_path, same)) == base, same
    for other in ("model.hidden_size=96", "optimizer.lr=1e-3", "seed=5", "dipaco.tau=8"):
        assert run_fingerprint(tiny(tmp_path, other)) != base, other
