"""``megatron-ext plan`` against measurement: what the GPT trainer really builds, saves and moves.

The runs are the trainer's own (``tests/dist/planner_measure.py``: ``gpt.setup.setup`` and
``gpt.step.train_step`` on CPU gloo, synthetic tokens in place of the dataset). Compared:

- **bytes, exactly** (``==``), on every rank of tiny GPTs at DP 1, 2, 4, TP 2 × DP 2, EP 2 × DP 2
  and EP 2 × DP 4 (the MoE recipe), for each optimizer in fp32 and bf16: the rank's parameter
  bytes, DDP's ``main_grad`` buffer, the fp32 masters and each optimizer's state after one step
  (0-d step counters excluded, as the specs' ``state_bytes`` exclude them), against
  :func:`~megatron_ext.planner.memory.rank_memory` for that rank's data-parallel and
  expert-data-parallel ranks (AdamW's element-sharded ranges included: ZeRO-1), and the
  per-rank owned state and masters of the plan's ``RankLoads``;
  :func:`~megatron_ext.planner.plan.plan_run`'s most loaded rank against the rank it names;
- **communication, exactly**: the layer-wise and the element-sharded AdamW's wire counters
  after one step (gradient reduce-scatter-v, parameter all-gather-v: ``WireStats``) against
  :func:`~megatron_ext.planner.comm.data_parallel_bytes` for each rank, and ``plan_run``'s;
- **activations within 15 %**: the bytes autograd saves for one micro-batch (saved-tensor hooks,
  storages counted once) of the tiny dense GPT (fp32, bf16), the tiny MoE and a ~125M GPT, with
  recompute none / selective / full, against
  :func:`~megatron_ext.planner.stage.stage_activations` (kept, and rebuilt at a time);
- **peak memory within 15 %**: the ~125M GPT's peak resident set over a runtime baseline
  (after imports and process groups) during setup and two AdamW steps, and two Muon steps
  (glibc's mmap threshold fixed, so freed tensors leave the resident set), against the plan's
  ``static + max(activations, transient)`` for the local spec (``transformer_impl=local``).
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from megatron_ext.config.load import load_recipe
from megatron_ext.optimizers.spec import recipe_hyperparameters
from megatron_ext.planner.comm import data_parallel_bytes
from megatron_ext.planner.gpus import GPUS
from megatron_ext.planner.inputs import Cluster, plan_vocab_size, planned_model, run_layout
from megatron_ext.planner.memory import rank_memory
from megatron_ext.planner.ownership import optimizer_layout
from megatron_ext.planner.params import gpt_parameters
from megatron_ext.planner.plan import plan_run
from megatron_ext.planner.stage import stage_activations
from megatron_ext.run.precision import precision_spec
from tests.conftest import DIST, run_torchrun
from tests.dist.planner_measure import (
    ACTIVATION_CASES,
    BIG,
    CASES,
    FULL_FORMS,
    OPTIMIZERS,
    PEAK_FASTER,
    PRECISIONS,
    RECOMPUTE,
    case_overrides,
)

SCRIPT = DIST / "planner_measure.py"
TOLERANCE = 0.15  # issue 26: activations and peak within 15 % of the measurement
RUNS = [
    (case, optimizer, precision)
    for case in CASES
    for optimizer in OPTIMIZERS
    for precision in PRECISIONS
]
WORLDS = sorted({world for world, _, _ in CASES.values()})
#: per world size, the extra tasks its launch runs after ``bytes`` (one launch per world size)
EXTRA_TASKS = {1: [f"activations:{name}" for name in ACTIVATION_CASES if name != "big"]}


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every run's measurement: ``bytes[run id] -> [per rank]``, ``activations[name]``,
    ``peak`` (one launch per world size, one for the peak, whose process runs nothing before)."""
    out = tmp_path_factory.mktemp("planner_measure")
    for world in WORLDS:
        run_torchrun(SCRIPT, world, str(out / str(world)), "bytes", *EXTRA_TASKS.get(world, []))
    run_torchrun(SCRIPT, 1, str(out / "peak"), "peak:adamw", "activations:big")
    # glibc's mmap threshold fixed in that rank (PEAK_MMAP_THRESHOLD: why)
    run_torchrun(SCRIPT, 1, str(out / "peak_muon"), "peak:muon")
    per_run: dict[str, list[dict[str, Any]]] = {}
    for world in WORLDS:
        for rank in range(world):
            got = json.loads(Path(out, str(world), f"bytes.rank{rank}.json").read_text())
            for run_id, figures in got.items():
                per_run.setdefault(run_id, []).append(figures)
    activations = {
        name: json.loads(
            Path(out, "peak" if name == "big" else "1", f"activations.{name}.json").read_text()
        )
        for name in ACTIVATION_CASES
    }
    peak = {
        name: json.loads(Path(out, folder, "peak.json").read_text())
        for name, folder in (("adamw", "peak"), ("muon", "peak_muon"))
    }
    return {"bytes": per_run, "activations": activations, "peak": peak}


# --------------------------------------------------------------------------- the plan's side


@cache
def planned(case: str, optimizer: str, precision: str) -> tuple[Any, ...]:
    """(recipe, run layout, one rank's parameters, optimizer layout, plan_run's plan)."""
    world, source, _ = CASES[case]
    recipe = load_recipe(source, case_overrides(case, optimizer, precision), world_size=world)
    lay = run_layout(recipe, world)
    bf16 = precision_spec(recipe.training.precision).half
    params = gpt_parameters(
        planned_model(recipe),
        recipe.parallel,
        vocab_size=plan_vocab_size(recipe),
        seq_length=lay.seq,
    )
    hp = recipe_hyperparameters(recipe.optimizer)
    layout = optimizer_layout(params, optimizer, hp, dp=lay.dp, edp=lay.edp, bf16=bf16)
    plan = plan_run(recipe, Cluster(GPUS["h100"], 1, world), baselines=False)
    return recipe, lay, params, layout, plan


def _nonzero(figures: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in figures.items() if v}


def _memory(figures: Any) -> dict[str, Any]:
    return {
        "parameters": figures.parameters,
        "gradients": figures.gradients,
        "masters": figures.masters,
        "optimizer_state": _nonzero(figures.optimizer_state),
    }


def _measured_memory(rank: dict[str, Any]) -> dict[str, Any]:
    return {
        "parameters": rank["parameters"],
        "gradients": rank["gradients"],
        "masters": rank["masters"],
        "optimizer_state": _nonzero(rank["optimizer_state"]),
    }


def _rank_plan(case: str, optimizer: str, precision: str, rank: dict[str, Any]) -> tuple:
    """(MemoryFigures, CommFigures) the plan gives this rank's DP / expert-DP ranks."""
    recipe, lay, params, layout, _ = planned(case, optimizer, precision)
    bf16 = precision_spec(precision).half
    d, e = rank["dense_rank"], rank["expert_rank"]
    memory = rank_memory(
        params,
        layout,
        dense_rank=d,
        expert_rank=e,
        bf16=bf16,
        activations=0,
        tp=lay.tp,
        tp_mode=recipe.optimizer.tp_mode,
    )
    comm = data_parallel_bytes(
        params,
        layout,
        dense_rank=d,
        expert_rank=e,
        dp=lay.dp,
        edp=lay.edp,
        param_bytes=2 if bf16 else 4,
    )
    return memory, comm


def _named_rank(plan: Any, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The measured rank ``plan_run`` reports: its most loaded (dense, expert) ranks."""
    stage = plan.stages[0]
    named = [
        r
        for r in ranks
        if (r["dense_rank"], r["expert_rank"]) == (stage.dense_rank, stage.expert_rank)
    ]
    assert named, f"no rank is the plan's most loaded {stage.dense_rank, stage.expert_rank}"
    return named[0]


# --------------------------------------------------------------------------- bytes


@pytest.mark.parametrize(("case", "optimizer", "precision"), RUNS)
def test_memory_bytes_equal_the_plan_on_every_rank(
    measured: dict[str, Any], case: str, optimizer: str, precision: str
) -> None:
    ranks = measured["bytes"][f"{case}/{optimizer}/{precision}"]
    assert len(ranks) == CASES[case][0]
    _, _, _, layout, plan = planned(case, optimizer, precision)
    for rank in ranks:
        memory, _ = _rank_plan(case, optimizer, precision, rank)
        assert _measured_memory(rank) == _memory(memory), rank
    assert _measured_memory(_named_rank(plan, ranks)) == _memory(plan.stages[0].memory)
    # the layer-wise plan's per-rank owned state and masters (RankLoads), domain by domain
    stage = plan.stages[0]
    for domain, loads in (("dense", stage.dense), ("expert", stage.expert)):
        if loads is None:
            assert all(r["owned_state"][domain] == 0 for r in ranks)
            continue
        key = f"{domain}_rank"
        for rank in ranks:
            assert rank["owned_state"][domain] == loads.state_bytes[rank[key]], (domain, rank)
            assert rank["owned_masters"][domain] == loads.master_bytes[rank[key]], (domain, rank)
        assert {r[key] for r in ranks} == set(range(loads.ranks))  # every planned rank measured
    if optimizer != "adamw":
        assert layout.dense is not None and plan.stages[0].dense is not None


@pytest.mark.parametrize(("case", "optimizer", "precision"), RUNS)
def test_wire_bytes_equal_the_plan_on_every_rank(
    measured: dict[str, Any], case: str, optimizer: str, precision: str
) -> None:
    ranks = measured["bytes"][f"{case}/{optimizer}/{precision}"]
    _, lay, _, _, plan = planned(case, optimizer, precision)
    stage = plan.stages[0]
    # every optimizer reduce-scatters and all-gathers (AdamW: its element-sharded buckets)
    assert stage.comm.ddp_all_reduce == (0, 0)
    for rank in ranks:
        _, comm = _rank_plan(case, optimizer, precision, rank)
        wire = rank["wire"]
        assert tuple(wire["grad_reduce_scatter"]) == comm.grad_reduce_scatter, rank
        assert tuple(wire["param_all_gather"]) == comm.param_all_gather, rank
    wire = _named_rank(plan, ranks)["wire"]
    assert tuple(wire["grad_reduce_scatter"]) == stage.comm.grad_reduce_scatter
    assert tuple(wire["param_all_gather"]) == stage.comm.param_all_gather
    if lay.dp > 1:  # something crossed the wire on every rank
        assert all(r["wire"]["grad_reduce_scatter"][0] > 0 for r in ranks)
        assert all(r["wire"]["param_all_gather"][1] > 0 for r in ranks)


# --------------------------------------------------------------------------- activations


def _planned_activations(name: str, recompute: str) -> tuple[int, int]:
    source, overrides, _ = ACTIVATION_CASES[name]
    overrides = [*overrides, f"parallel.recompute_granularity={recompute}"]
    recipe = load_recipe(source, overrides, world_size=1)
    assert recipe.model.transformer_impl == "local"  # the spec a CPU runs: SDPA, torch norms
    (chunk,) = stage_activations(recipe, run_layout(recipe, 1), 0, plan_vocab_size(recipe))
    return chunk


def _layers(name: str) -> int:
    source, overrides, _ = ACTIVATION_CASES[name]
    return load_recipe(source, overrides, world_size=1).model.num_layers


def _within(predicted: float, measured: float) -> bool:
    return abs(predicted - measured) <= TOLERANCE * measured


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("name", list(ACTIVATION_CASES))
def test_activations_within_15_percent_of_what_autograd_saves(
    measured: dict[str, Any], name: str, recompute: str
) -> None:
    got = measured["activations"][name][recompute]
    kept, rebuild = _planned_activations(name, recompute)
    assert _within(kept, got["kept"]), (kept, got)
    if not ACTIVATION_CASES[name][2]:
        return  # forward only (the ~125M GPT)
    if recompute == "none":
        assert rebuild == got["rebuild"] == got["segments"] == 0
    else:  # one segment per layer (full) or per core attention (selective), each rebuilt alone
        assert got["segments"] == _layers(name)
        assert _within(rebuild, got["rebuild"]), (rebuild, got)


@pytest.mark.parametrize("form", list(FULL_FORMS))
def test_full_recomputation_forms_within_15_percent(measured: dict[str, Any], form: str) -> None:
    """Full recomputation over chunks of 2 layers (uniform) and of the first layer only
    (block): what is kept, what one segment rebuilds, and how many segments there are."""
    name = next(iter(ACTIVATION_CASES))
    got = measured["activations"][name][form]
    overrides, starts = FULL_FORMS[form]
    source, case, _ = ACTIVATION_CASES[name]
    recipe = load_recipe(source, [*case, *overrides], world_size=1)
    ((kept, rebuild),) = stage_activations(
        recipe, run_layout(recipe, 1), 0, plan_vocab_size(recipe)
    )
    assert got["segments"] == len(starts)
    assert _within(kept, got["kept"]), (kept, got)
    assert _within(rebuild, got["rebuild"]), (rebuild, got)
    assert got["kept"] < measured["activations"][name]["none"]["kept"]


def test_recomputation_lowers_what_is_kept(measured: dict[str, Any]) -> None:
    for name, by_recompute in measured["activations"].items():
        kept = {r: by_recompute[r]["kept"] for r in RECOMPUTE}
        assert kept["full"] < kept["none"], name
        assert _planned_activations(name, "full")[0] < _planned_activations(name, "none")[0]


# --------------------------------------------------------------------------- peak


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_peak_within_15_percent_of_the_measured_peak_resident_set(
    measured: dict[str, Any], optimizer: str
) -> None:
    peak = measured["peak"][optimizer]
    assert peak["optimizer"] == optimizer
    # the high-water mark was reset to the baseline: nothing before it counts
    assert peak["hwm_after_reset_bytes"] <= peak["baseline_bytes"] + 2**20
    recipe = load_recipe(  # the run measured: PEAK_FASTER changes its time, not its memory
        "tiny_cpu_gpt",
        [*BIG, f"optimizer.name={optimizer}", *PEAK_FASTER.get(optimizer, [])],
        world_size=1,
    )
    plan = plan_run(recipe, Cluster(GPUS["h100"], 1, 1), baselines=False)
    assert plan.assumptions["attention"] == "local"
    assert peak["params"] == plan.total_params  # the model measured is the model planned
    predicted = plan.worst.memory.peak
    got = peak["peak_bytes"] - peak["baseline_bytes"]
    assert _within(predicted, got), (plan.worst.memory.as_dict(), got)
