"""Virtual pipeline stages in the GPT trainer (``parallel.virtual_pipeline_model_parallel_size``,
Megatron-LM's ``--num-layers-per-virtual-pipeline-stage``): several model chunks per pipeline
rank through megatron-core's interleaved 1F1B schedule.

The reference is the same model without pipelining: a run with virtual stages writes its
initial weights (``checkpoint.save_initial``), a run with one stage starts from them, and the
two must give the same losses, gradient norms and validation losses (the layer-wise Muon and
its gradient sync, one per chunk, included); a checkpoint with optimizer state then moves
between the two layouts in both directions. The recipe rules megatron-core and Megatron-LM
apply are checked before any rank starts.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_ext.config.load import recipe_from_dict
from megatron_ext.errors import ConfigError
from tests.test_training import _losses, _metric, _train, recipe_file  # noqa: F401

#: PP=2 needs overlap_p2p_comm (Megatron-LM's default with virtual stages): batched sends
#: and receives between the same two ranks mix up (test_two_pipeline_ranks_need_overlapped_p2p)
OVERLAP = "model.transformer_config={overlap_p2p_comm: true, batch_p2p_comm: false}"
VIRTUAL = (
    "parallel.pipeline_model_parallel_size=2",
    "parallel.virtual_pipeline_model_parallel_size=2",
    OVERLAP,
)
COMMON = (
    "model.num_layers=4",
    "optimizer.name=muon",
    "training.steps=4",
    "training.eval_iters=1",
    "training.eval_interval=2",
    "checkpoint.save_interval=2",
)


def _validation(run_dir: Path) -> list[float]:
    return _metric(run_dir, "val_loss")


def test_virtual_stages_train_the_unpipelined_model(recipe_file, tmp_path):  # noqa: F811
    """PP=2 x VP=2 (chunk v of rank r: layer 2v + r) equals PP=1 from the same weights, step
    by step; its checkpoints load without virtual stages and the other way round."""
    virtual, flat = tmp_path / "virtual", tmp_path / "flat"
    _train(recipe_file, virtual, *COMMON, *VIRTUAL, "checkpoint.save_initial=true")
    step0 = virtual / "checkpoints" / "step_000000"
    _train(recipe_file, flat, *COMMON, f"checkpoint.load={step0}")
    losses = _losses(virtual)
    assert losses[-1] < losses[0] - 0.3, losses  # it trains
    assert _losses(flat) == pytest.approx(losses, rel=1e-5)
    assert _metric(flat, "grad_norm") == pytest.approx(_metric(virtual, "grad_norm"), rel=1e-4)
    assert len(_validation(virtual)) == 2
    assert _validation(flat) == pytest.approx(_validation(virtual), rel=1e-5)

    # optimizer state too: the virtual run's step 2 continued without virtual stages ...
    step2 = virtual / "checkpoints" / "step_000002"
    onward = tmp_path / "onward"
    _train(recipe_file, onward, *COMMON, f"checkpoint.load={step2}")
    assert _losses(onward) == pytest.approx(losses[2:], rel=1e-5)
    # ... and the unpipelined run's step 2 continued with them
    back = tmp_path / "back"
    _train(recipe_file, back, *COMMON, *VIRTUAL, f"checkpoint.load={flat}/checkpoints/step_000002")
    assert _losses(back) == pytest.approx(losses[2:], rel=1e-5)
    # resuming its own checkpoint is exact
    shutil.rmtree(virtual / "checkpoints" / "step_000004")
    (virtual / "checkpoints" / "latest").write_text("step_000002\n")
    _train(recipe_file, virtual, *COMMON, *VIRTUAL)
    assert _losses(virtual) == losses[2:]


def _recipe(**parallel) -> dict:
    return {
        "trainer": "gpt",
        "model": {"num_layers": 4},
        "parallel": {"pipeline_model_parallel_size": 2, **parallel},
        "data": {"path": "unused/prefix"},  # the check reads no data
        "training": {"steps": 10, "micro_batch_size": 1, "global_batch_size": 4},
    }


def _check(raw: dict, world: int = 2) -> None:
    recipe_from_dict(raw).check(world)


def test_two_pipeline_ranks_need_overlapped_p2p() -> None:
    """Measured here: PP=2 x VP=2 with megatron-core's default batched p2p gave a first-step
    gradient norm of 36.8 where PP=1 from the same weights gives 5.9 (sends and receives
    between the same two ranks in one batch); Megatron-LM's validate_args refuses it too."""
    with pytest.raises(ConfigError, match="overlap_p2p_comm: true, batch_p2p_comm: false"):
        _check(_recipe(virtual_pipeline_model_parallel_size=2))
    raw = _recipe(virtual_pipeline_model_parallel_size=2)
    raw["model"]["transformer_config"] = {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    _check(raw)
    raw["parallel"]["pipeline_model_parallel_size"] = 4  # 3+ ranks: megatron-core's default
    raw["model"] = {"num_layers": 8}
    _check(raw, world=4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"pipeline_model_parallel_size": 1}, "needs parallel.pipeline_model_parallel_size >= 2"),
        ({"virtual_pipeline_model_parallel_size": 3}, "not divisible by 6 model chunks"),
    ],
)
def test_virtual_stages_need_pipeline_ranks_and_whole_chunks(change, message) -> None:
    raw = _recipe(**{"virtual_pipeline_model_parallel_size": 2, **change})
    raw["model"]["transformer_config"] = {"overlap_p2p_comm": True, "batch_p2p_comm": False}
    with pytest.raises(ConfigError, match=message):
        _check(raw, world=raw["parallel"]["pipeline_model_parallel_size"])


def test_the_interleaved_schedules_microbatch_groups_are_checked_before_launch() -> None:
    """megatron-core's interleaved schedule refuses a step whose last group of micro-batches
    (``microbatch_group_size_per_vp_stage``, default the pipeline size) is shorter than the
    pipeline: 6 micro-batches per rank on 4 pipeline ranks leave 2."""
    raw = _recipe(pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=2)
    raw["model"] = {"num_layers": 8}
    raw["training"]["global_batch_size"] = 6
    with pytest.raises(ConfigError, match="6 micro-batches per pipeline rank in groups of 4"):
        _check(raw, world=4)
    raw["model"]["transformer_config"] = {"microbatch_group_size_per_vp_stage": 3}
    _check(raw, world=4)  # groups of 3: no remainder
    raw["training"]["global_batch_size"] = 8
    del raw["model"]["transformer_config"]
    _check(raw, world=4)


#: a Megatron-LM launch line (tied embeddings, Megatron-LM's default), pipelined 2 ways
SCRIPT = """torchrun --nproc_per_node 2 pretrain_gpt.py \\
  --num-layers {layers} --hidden-size 64 --num-attention-heads 4 --seq-length 32 \\
  --max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 \\
  --train-iters 6 --lr-warmup-iters 1 --data-path data/x --tokenizer-type NullTokenizer \\
  --vocab-size 257 --pipeline-model-parallel-size 2 {virtual} \\
  --save-interval 3 --eval-interval 3 --eval-iters 1 --save ckpt \\
  --hidden-dropout 0 --attention-dropout 0
"""
#: (layers, the virtual-stage flags, the virtual stages Megatron-LM derives)
SCRIPTS = {
    # (a layer count per virtual stage alone: test_virtual_stages_train_the_unpipelined_model)
    # uneven chunks: the embedding and a layer, two layers, a layer, the loss alone
    "layout": (4, "--pipeline-model-parallel-layout 'Et|tt|t|L'", 2),
    # 6 layers + the embedding + the loss over 2 x 4 chunks (one holds only the embedding)
    "embedding_and_loss_counted": (
        6,
        "--num-layers-per-virtual-pipeline-stage 1 --account-for-embedding-in-pipeline-split "
        "--account-for-loss-in-pipeline-split",
        4,
    ),
}


@pytest.mark.parametrize("case", list(SCRIPTS))
def test_a_converted_script_with_virtual_stages_trains(recipe_file, tmp_path, case):  # noqa: F811
    """``recipe from-megatron-args`` on a script with virtual stages (a layer count per stage,
    a pipeline layout, the embedding and loss counted as layers): the recipe is Megatron-LM's
    run field by field (virtual stages and ``overlap_p2p_comm`` included), and it trains on 2
    ranks -- word embeddings tied over the pipeline stages -- as the same model does without
    pipelining from the same weights."""
    import yaml

    from megatron_ext.megatron.from_megatron import convert
    from megatron_ext.megatron.megatron_args import read_megatron_args
    from megatron_ext.megatron.megatron_compare import compare

    layers, flags, stages = SCRIPTS[case]
    conversion = convert(read_megatron_args(SCRIPT.format(layers=layers, virtual=flags)))
    recipe = recipe_from_dict(conversion.recipe)
    assert recipe.parallel.virtual_pipeline_model_parallel_size == stages
    assert conversion.unmapped == []
    assert compare(recipe, conversion.megatron, 2) == {}
    assert not recipe.model.untie_embeddings_and_output_weights
    path = tmp_path / "converted.yaml"
    path.write_text(yaml.safe_dump(conversion.recipe), encoding="utf-8")
    data = yaml.safe_load(recipe_file.read_text())["data"]  # this suite's corpus, bytes
    local = (
        f"data.path={data['path']}",
        f"data.source=[{data['source'][0]}]",
        "data.tokenizer=byte",
        "data.split=98,2,0",
        "checkpoint.keep_last=5",
    )
    virtual, flat = tmp_path / "virtual", tmp_path / "flat"
    _train(path, virtual, *local, "checkpoint.save_initial=true")
    step0 = virtual / "checkpoints" / "step_000000"
    _train(
        path,
        flat,
        *local,
        "parallel.pipeline_model_parallel_size=1",
        "parallel.virtual_pipeline_model_parallel_size=null",
        "model.transformer_config={}",
        f"checkpoint.load={step0}",
    )
    losses = _losses(virtual)
    assert losses[-1] < losses[0] - 0.3, losses
    assert _losses(flat) == pytest.approx(losses, rel=1e-5)
    assert _validation(flat) == pytest.approx(_validation(virtual), rel=1e-5)


def test_moe_with_expert_parallelism_in_virtual_stages(recipe_file, tmp_path):  # noqa: F811
    """The MoE recipe (EP=2: each chunk's expert weights a layer-wise domain over the expert
    data-parallel group) with PP=2 x V=2 on 4 ranks against PP=1 from the same weights: losses,
    gradient norms and the per-layer expert loads agree."""
    import yaml

    from tests.conftest import run_torchrun

    data = yaml.safe_load(recipe_file.read_text())["data"]
    common = (
        "recipes/moe_tiny_cpu.yaml",
        f"data.path={data['path']}",
        f"data.source=[{data['source'][0]}]",
        "model.num_layers=4",
        "training.steps=3",
        "training.micro_batch_size=1",
        "training.global_batch_size=8",
        "training.lr_warmup_steps=1",
        "training.lr_wsd_decay_steps=1",
        "training.seq_length=32",
        "logging.log_interval=1",
        "checkpoint.keep_last=5",
        "checkpoint.save_interval=0",
    )
    virtual, flat = tmp_path / "virtual", tmp_path / "flat"

    def train(run_dir: Path, *overrides: str) -> None:
        run_torchrun(
            "megatron_ext.launch.cli",
            4,
            "train",
            *common,
            f"run_dir={run_dir}",
            *overrides,
            module=True,
        )

    train(virtual, *VIRTUAL, "checkpoint.save_initial=true")
    train(flat, f"checkpoint.load={virtual}/checkpoints/step_000000")
    assert _losses(flat) == pytest.approx(_losses(virtual), rel=1e-5)
    assert _metric(flat, "grad_norm") == pytest.approx(_metric(virtual, "grad_norm"), rel=1e-4)
    loads = [_metric(r, "moe_tokens_per_expert_max") for r in (virtual, flat)]
    assert loads[0] == loads[1] and len(loads[0][0]) == 4  # every layer, from every chunk


def test_the_planners_schedule_is_megatron_cores() -> None:
    """The planner's warmup counts and forward order (megatron_ext.planner.schedule) against
    megatron-core's own ``get_pp_rank_microbatches`` / ``get_schedule_table``, with and without
    virtual stages, for every rank of 2-8 pipeline stages and 1-19 micro-batches."""
    from types import SimpleNamespace

    from megatron.core.pipeline_parallel.schedules import (
        get_pp_rank_microbatches,
        get_schedule_table,
    )

    from megatron_ext.planner.schedule import schedule_table, warmup

    for pp in (2, 3, 4, 8):
        for chunks in (1, 2, 3, 4):
            for micro in range(1, 20):
                for group in {pp, 2, 3}:
                    if chunks > 1:
                        theirs = get_schedule_table(micro, chunks, group)
                        assert schedule_table(micro, chunks, group) == theirs
                    for rank in range(pp):
                        comm = SimpleNamespace(
                            pp_group=SimpleNamespace(size=lambda pp=pp: pp, rank=lambda r=rank: r),
                            virtual_pipeline_model_parallel_size=chunks if chunks > 1 else None,
                        )
                        _, _, want, _ = get_pp_rank_microbatches(
                            micro, chunks, group, p2p_communicator=comm
                        )
                        assert warmup(pp, rank, micro, chunks, group) == want


def test_the_planner_holds_what_the_interleaved_schedule_holds() -> None:
    """Worked by hand, PP=2 x 2 chunks, 4 micro-batches, rank 0: 4 warmup forwards (chunk 0 of
    micro-batches 0, 1, then chunk 1 of them), then forward / backward pairs, the backward
    running the chunks in reverse: 5 passes held at most, two of them chunk 1's at the peak.
    Rank 1: 2 warmup forwards, then at most 3 passes.
    Without virtual stages the count is 1F1B's, min(pp - rank, M)."""
    from megatron_ext.planner.schedule import peak_held

    assert peak_held([1, 10], pp=2, rank=0, micro_batches=4) == (23, 5)
    # rank 1: 2 warmup forwards, then at most 3 passes (chunk 1's one of them, or none)
    assert peak_held([1, 10], pp=2, rank=1, micro_batches=4) == (12, 3)
    for pp, rank, micro in ((4, 0, 8), (4, 3, 8), (4, 0, 2), (8, 2, 16)):
        assert peak_held([7], pp, rank, micro) == (7 * min(pp - rank, micro), min(pp - rank, micro))


def test_the_planner_plans_virtual_stages() -> None:
    """`megatron-ext plan` with virtual stages: every rank's chunks (their parameters are
    compared with megatron-core's built chunks in tests/test_planner_params.py), the whole
    model counted once, the interleaved schedule's held passes, a bubble 1/V of 1F1B's; first
    and last stage layer counts with virtual stages are refused by name."""
    from megatron_ext.config import load_recipe
    from megatron_ext.planner.gpus import GPUS
    from megatron_ext.planner.inputs import Cluster
    from megatron_ext.planner.params import NotModelled
    from megatron_ext.planner.plan import plan_run

    base = ["training.global_batch_size=128", "parallel.pipeline_model_parallel_size=2"]
    flat = plan_run(load_recipe("tiny_cpu_gpt", base, world_size=8), Cluster(GPUS["h100"], 1, 8))
    virtual = [*base, "parallel.virtual_pipeline_model_parallel_size=2", OVERLAP]
    plan = plan_run(load_recipe("tiny_cpu_gpt", virtual, world_size=8), Cluster(GPUS["h100"], 1, 8))
    assert plan.total_params == flat.total_params
    assert [s.params for s in plan.stages] == [s.params for s in flat.stages]  # 2 of 4 layers
    # 4 micro-batches of 8 per rank (DP 4): 1F1B holds 2 on rank 0; interleaved (1·2 + 1·2) + 1
    assert (flat.stages[0].in_flight, plan.stages[0].in_flight) == (2, 5)
    assert plan.step.bubble_s == pytest.approx(flat.step.bubble_s / 2)
    uneven = [*virtual[:-1], "model.transformer_config={overlap_p2p_comm: true, "
              "batch_p2p_comm: false, num_layers_in_first_pipeline_stage: 2}"]  # fmt: skip
    with pytest.raises(NotModelled, match="num_layers_in_first_pipeline_stage"):
        plan_run(load_recipe("tiny_cpu_gpt", uneven, world_size=8), Cluster(GPUS["h100"], 1, 8))


def test_the_held_passes_are_what_megatron_cores_schedule_holds(tmp_path) -> None:
    """Measured: megatron-core's interleaved schedule running a GPT-trainer step (PP=2 x 2
    chunks, 2, 4 and 6 micro-batches) holds at most as many forward passes on each rank as
    the planner's replay says (tests/dist/interleaved_held.py counts them)."""
    import json

    from megatron_ext.planner.schedule import peak_held
    from tests.conftest import DIST, run_torchrun
    from tests.dist.interleaved_held import MICRO_BATCHES

    run_torchrun(DIST / "interleaved_held.py", 2, str(tmp_path))
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        want = {str(m): peak_held([1, 1], 2, rank, m)[1] for m in MICRO_BATCHES}
        assert got == want, (rank, got, want)
