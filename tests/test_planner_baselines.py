"""The planner's reference schemes (megatron_ext.planner.mcore_layout, .baselines) against
megatron-core 0.19's own layouts.

megatron-core's ``LayerWiseDistributedOptimizer._compute_per_buffer_param_layout`` and
``DistributedOptimizer._compute_per_buffer_param_layout`` run on real ``torch.nn.Parameter``s on
the meta device (they read only ``nelement()`` and ``shared_embedding``), with a real
``DistributedDataParallelConfig``, for the parameter lists of a tiny GPT, the MoE tiny recipe,
gpt_1b and tied embeddings over two pipeline stages, at several data-parallel and bucket sizes;
the torch-free re-implementations must give the identical ``param_index_map`` (start, end,
bucket), bucket boundaries, unpadded bucket sizes, the layer-wise owner of every parameter
(megatron-core's rule from ``_shard_params_from_layout``) and, for ZeRO-1, every rank's
element range of every parameter (megatron-core's ``_build_model_gbuf_range``).
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from megatron_ext.config.load import read_recipe
from megatron_ext.distributed.plan import ParamSpec, compute_cost, plan_ownership, state_bytes
from megatron_ext.gpt.sections import ModelConfig, ParallelConfig
from megatron_ext.planner.baselines import (
    PerRank,
    matrix_routed,
    megatron_layerwise_load,
    ours_load,
    routed_specs,
    scheme_loads,
    zero1_load,
)
from megatron_ext.planner.mcore_layout import (
    BufferLayout,
    distributed_optimizer_layout,
    layerwise_layout,
)
from megatron_ext.planner.params import PlannedParam, gpt_parameters

VOCAB, LLAMA_VOCAB = 100, 128256
DP_SIZES = (1, 2, 3, 8, 64)
BUCKET_SIZES = (None, 10_000, 4_000_000)  # elements: one bucket, one parameter or so, the default
TINY: dict[str, Any] = {
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_query_groups": 2,
    "transformer_impl": "local",
}


def _recipe_params(name: str, **parallel: int) -> list[PlannedParam]:
    recipe = read_recipe(name)
    model, base = recipe.sections["model"], recipe.sections["parallel"]
    sizes = {"tensor_model_parallel_size": 1, "expert_model_parallel_size": 1, **parallel}
    layout = ParallelConfig(**{**vars(base), **sizes})
    return gpt_parameters(model, layout, vocab_size=LLAMA_VOCAB)


def _tied_stage(pp_rank: int) -> list[PlannedParam]:
    model = ModelConfig(**TINY, untie_embeddings_and_output_weights=False)
    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    return gpt_parameters(model, parallel, vocab_size=VOCAB, pp_rank=pp_rank)


def _matrix(params: list[PlannedParam]) -> list[PlannedParam]:
    names = {s.name for s in matrix_routed(routed_specs(params, matrix_optimizer="muon"))}
    return [p for p in params if p.name in names]


def _cases() -> dict[str, tuple[list[PlannedParam], tuple[str, ...]]]:
    tiny = gpt_parameters(ModelConfig(**TINY), ParallelConfig(), vocab_size=VOCAB)
    gpt_1b = _recipe_params("gpt_1b")
    return {  # case -> (parameters in forward order, the ones marked shared_embedding)
        "tiny": (tiny, ()),
        "tiny_matrix": (_matrix(tiny), ()),
        "moe_tiny": (_recipe_params("moe_tiny_cpu"), ()),
        "gpt_1b": (gpt_1b, ()),
        "gpt_1b_matrix": (_matrix(gpt_1b), ()),
        # tied over two stages: the first stage's embedding closes a non-empty chunk (it comes
        # last in backprop order), the last stage's output layer comes first
        "tied_pp2_first_stage": (_tied_stage(0), ("embedding.word_embeddings.weight",)),
        "tied_pp2_last_stage": (_tied_stage(1), ("output_layer.weight",)),
    }


CASES = _cases()


def _ddp_config(pad: bool) -> Any:
    from megatron.core.distributed import DistributedDataParallelConfig

    return DistributedDataParallelConfig(pad_buckets_for_high_nccl_busbw=pad)


def _tensors(params: list[PlannedParam], shared: tuple[str, ...]) -> dict[str, Any]:
    import torch

    tensors = {p.name: torch.nn.Parameter(torch.empty(p.shape, device="meta")) for p in params}
    for name in shared:
        tensors[name].shared_embedding = True
    return tensors


def _mcore_layout(scheme: str, tensors: dict[str, Any], bucket: int | None, dp: int, pad: bool):
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.optimizer.layer_wise_optimizer import LayerWiseDistributedOptimizer

    cls = LayerWiseDistributedOptimizer if scheme == "layerwise" else DistributedOptimizer
    return cls._compute_per_buffer_param_layout(
        list(tensors.values()), bucket, dp, _ddp_config(pad)
    )


def _ours(scheme: str, params: list[PlannedParam], shared: tuple[str, ...], **kw: Any):
    fn = layerwise_layout if scheme == "layerwise" else distributed_optimizer_layout
    return fn([(p.name, p.numel) for p in params], shared_embeddings=shared, **kw)


def _mcore_layerwise_owner(mcore: Any, index: tuple[int, int, int]) -> int:
    """megatron-core's ``_shard_params_from_layout``: the shard a parameter's start lies in
    (and the parameter must end inside it)."""
    start, end, bucket = index
    bucket_start, bucket_end = mcore.bucket_indices[bucket]
    shard = (bucket_end - bucket_start) // mcore.num_optimizer_shards
    owner = (start - bucket_start) // shard
    assert end <= bucket_start + (owner + 1) * shard  # megatron-core asserts this too
    return owner


def _mcore_rank_ranges(mcore: Any, names: dict[Any, str], dp: int) -> list[dict[str, tuple]]:
    """Per rank, each parameter's ``[start, end)`` in the buffer that rank holds, from
    megatron-core's ``DistributedOptimizer._build_model_gbuf_range``. The buffer and its group
    are stand-ins carrying what that method reads (bucket sizes and offsets from the layout,
    rank and size); the bucket's parameters are the only ones that can overlap its range."""
    import torch
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    ranges: list[dict[str, tuple]] = [{} for _ in range(dp)]
    for b, (start, end) in enumerate(mcore.bucket_indices):
        members = {p: i for p, i in mcore.param_index_map.items() if i[2] == b}
        bucket = SimpleNamespace(grad_data=torch.empty(end - start, device="meta"), offset=start)
        for r in range(dp):
            group = SimpleNamespace(rank=lambda r=r: r, size=lambda: dp)
            buffer = SimpleNamespace(
                data_parallel_group=group,
                num_optimizer_shards=mcore.num_optimizer_shards,
                buckets={b: bucket},
                param_index_map=members,
            )
            got = DistributedOptimizer._build_model_gbuf_range(buffer, b)["param_map"]
            for p, rng in got.items():
                world = rng["gbuf_world"]
                ranges[r][names[p]] = (world.start, world.end)
    return ranges


def _our_rank_ranges(layout: BufferLayout) -> list[dict[str, tuple]]:
    ranges: list[dict[str, tuple]] = [{} for _ in range(layout.dp_size)]
    for name, (start, end, bucket) in layout.index.items():
        for r in range(layout.dp_size):
            lo, hi = layout.shard_range(bucket, r)
            if min(end, hi) > max(start, lo):
                ranges[r][name] = (max(start, lo), min(end, hi))
    return ranges


@pytest.mark.parametrize("scheme", ["layerwise", "distributed_optimizer"])
@pytest.mark.parametrize("case", list(CASES))
def test_layout_equals_megatron_cores(case: str, scheme: str) -> None:
    params, shared = CASES[case]
    tensors = _tensors(params, shared)
    names = {t: n for n, t in tensors.items()}
    for dp in DP_SIZES:
        for bucket in BUCKET_SIZES:
            for pad in (False, True):
                mcore = _mcore_layout(scheme, tensors, bucket, dp, pad)
                ours = _ours(
                    scheme,
                    params,
                    shared,
                    dp_size=dp,
                    bucket_size=bucket,
                    pad_buckets_for_high_nccl_busbw=pad,
                )
                where = f"{case} {scheme} dp={dp} bucket_size={bucket} pad={pad}"
                expected = {names[p]: tuple(i) for p, i in mcore.param_index_map.items()}
                assert dict(ours.index) == expected, where
                assert list(ours.bucket_indices) == [tuple(b) for b in mcore.bucket_indices]
                assert list(ours.bucket_numel_unpadded) == mcore.per_bucket_numel_unpadded
                total = sum(t.nelement() for t in tensors.values())
                assert ours.padding == mcore.bucket_indices[-1][1] - total, where
                if scheme == "layerwise":
                    owners = {n: _mcore_layerwise_owner(mcore, i) for n, i in expected.items()}
                    assert {n: ours.shard_of(n) for n in expected} == owners, where
                elif not pad:  # the range split does not depend on how the end was padded
                    assert _our_rank_ranges(ours) == _mcore_rank_ranges(mcore, names, dp), where


def test_the_cases_exercise_what_can_differ() -> None:
    """Several buckets, padding, ties in LPT, a shared embedding after a non-empty chunk: a
    layout that got any of them wrong would not match."""
    params, _ = CASES["gpt_1b_matrix"]
    layout = _ours("layerwise", params, (), dp_size=3, bucket_size=4_000_000)
    assert len(layout.bucket_indices) > 4 and layout.padding > 0
    assert len({layout.shard_of(n) for n in layout.index}) == 3
    sizes = [p.numel for p in params]
    assert len(set(sizes)) < len(sizes)  # equal sizes: LPT's tie order matters
    params, shared = CASES["tied_pp2_first_stage"]
    tied = _ours("layerwise", params, shared, dp_size=8, bucket_size=None)
    assert len(tied.bucket_indices) == 2 and tied.shard_of(shared[0]) == 0
    zero = _ours("distributed_optimizer", params, shared, dp_size=8, bucket_size=None)
    assert len(zero.bucket_indices) == 2


@pytest.mark.usefixtures("one_torch_thread")
def test_megatron_cores_layerwise_params_differ_from_our_matrix_routes_by_the_router() -> None:
    """megatron-core's ``is_managed_by_layer_wise_optimizer`` on a real (MoE) GPTModel takes
    our matrix-routed parameters and the router weights (AdamW in our routing)."""
    from megatron.core.optimizer.layer_wise_optimizer import is_managed_by_layer_wise_optimizer

    from megatron_ext.convert.parity import init_single_process
    from megatron_ext.megatron.model import build_gpt_model

    init_single_process()
    model = read_recipe("moe_tiny_cpu").sections["model"]
    gpt = build_gpt_model(model, ParallelConfig(), "fp32", VOCAB, 16)
    named = list(gpt.named_parameters())
    theirs = {n for n, p in named if is_managed_by_layer_wise_optimizer(p)}
    planned = [PlannedParam(n, tuple(p.shape), False, False) for n, p in named]
    ours = {s.name for s in matrix_routed(routed_specs(planned, matrix_optimizer="muon"))}
    assert ours < theirs
    assert theirs - ours == {n for n, _ in named if n.endswith("router.weight")}


def _specs(optimizer: str, master: int = 0) -> list[ParamSpec]:
    params, _ = CASES["gpt_1b"]
    specs = routed_specs(params, matrix_optimizer=optimizer, master_bytes_per_element=master)
    return [s for s in specs if s.optimizer == optimizer]


@pytest.mark.parametrize("dp", [1, 3, 8])
def test_megatron_layerwise_load_sums_its_owners(dp: int) -> None:
    specs = _specs("muon", master=4)
    hp = {"muon": {"num_steps": 5}}
    load = megatron_layerwise_load(specs, dp, bucket_size=4_000_000, hyperparameters=hp)
    params = [(s.name, s.numel) for s in specs]
    layout = layerwise_layout(params, dp_size=dp, bucket_size=4_000_000)
    owner = {s.name: layout.shard_of(s.name) for s in specs}
    for r in range(dp):
        mine = [s for s in specs if owner[s.name] == r]
        assert load.owned_numel[r] == sum(s.numel for s in mine)
        assert load.state_bytes[r] == sum(8 * s.numel for s in mine)  # momentum + fp32 master
        assert load.flops is not None
        assert load.flops[r] == pytest.approx(sum(compute_cost(s, hp["muon"]) for s in mine))
        # the equal-shard all-gather of every padded bucket, bf16
        assert load.gather_bytes[r] == 2 * (dp - 1) * sum(layout.shard_sizes)
    assert sum(load.owned_numel) == sum(s.numel for s in specs)
    assert load.padding_numel == layout.padding


@pytest.mark.parametrize("optimizer", ["muon", "lion", "adamw"])
def test_zero1_load_shards_state_by_element(optimizer: str) -> None:
    specs, dp = _specs(optimizer), 8
    load = zero1_load(specs, dp, bucket_size=4_000_000)
    layout = distributed_optimizer_layout(
        [(s.name, s.numel) for s in specs], dp_size=dp, bucket_size=4_000_000
    )
    per_element = {"muon": 4, "lion": 4, "adamw": 8}[optimizer]
    for r in range(dp):
        held = sum(layout.held(r).values())
        assert load.owned_numel[r] == held
        assert load.state_bytes[r] == per_element * held
        assert load.gather_bytes[r] == 2 * (dp - 1) * layout.numel // dp
    assert sum(load.owned_numel) == sum(s.numel for s in specs)
    assert load.owned_numel.imbalance < 1.01  # equal ranges: only padding is uneven
    if optimizer == "muon":  # a matrix step needs the whole matrix: no honest figure
        assert load.flops is None
    else:
        assert load.flops is not None
        assert sum(load.flops) == pytest.approx(12 * sum(s.numel for s in specs))


def test_ours_load_is_the_ownership_plan() -> None:
    specs, dp = _specs("muon"), 8
    load = ours_load(specs, dp, bucket_numel=4_000_000, element_bytes=2)
    plan = plan_ownership(specs, dp)
    assert list(load.flops or ()) == plan.compute
    assert list(load.state_bytes) == plan.memory
    assert load.padding_numel == 0
    total = sum(s.numel for s in specs)
    assert sum(load.gather_bytes) == 2 * (dp - 1) * total  # every rank gets the others' share
    for r in range(dp):
        assert load.gather_bytes[r] == 2 * (total - load.owned_numel[r])
        assert load.state_bytes[r] == sum(state_bytes(s) for s in specs if plan.owner[s.name] == r)


def test_scheme_loads_side_by_side_and_per_rank_spread() -> None:
    specs = matrix_routed(routed_specs(CASES["gpt_1b"][0], matrix_optimizer="muon"))
    ours, layerwise, zero = scheme_loads(specs, 8, bucket_size=40_000_000)
    assert (ours.name, layerwise.name, zero.name) == ("ours", "megatron-core layer-wise", "ZeRO-1")
    total = sum(s.numel for s in specs)
    assert sum(ours.owned_numel) == sum(layerwise.owned_numel) == sum(zero.owned_numel) == total
    assert ours.flops is not None and layerwise.flops is not None and zero.flops is None
    spread = PerRank((1, 3))
    assert (spread.max, spread.mean, spread.imbalance) == (3, 2, 1.5)
    assert PerRank((0, 0)).imbalance == 1.0


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="dp_size"):
        layerwise_layout([("a", 1)], dp_size=0, bucket_size=None)
    with pytest.raises(ValueError, match="unique"):
        distributed_optimizer_layout([("a", 1), ("a", 2)], dp_size=1, bucket_size=None)
    with pytest.raises(ValueError, match="bucket_size"):
        layerwise_layout([("a", 1)], dp_size=1, bucket_size=0)


def test_baselines_run_without_torch() -> None:
    """With torch blocked from importing, the planner's baselines still compute."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch' or name.startswith('torch.'):\n"
        "            raise ImportError('torch is blocked: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "from megatron_ext.config.load import read_recipe\n"
        "from megatron_ext.planner.baselines import matrix_routed, routed_specs, scheme_loads\n"
        "from megatron_ext.planner.params import gpt_parameters\n"
        "r = read_recipe('gpt_1b').sections\n"
        f"params = gpt_parameters(r['model'], r['parallel'], vocab_size={LLAMA_VOCAB})\n"
        "specs = matrix_routed(routed_specs(params, matrix_optimizer='kl_soap'))\n"
        "loads = scheme_loads(specs, 8, bucket_size=40_000_000)\n"
        "print(' '.join(f'{l.state_bytes.imbalance:.3f}' for l in loads))\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "False"
