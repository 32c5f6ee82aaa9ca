"""Megatron-LM's own training loop (``megatron.training.pretrain``) with megatron-ext's optimizers.

``tests/dist/megatron_lm_pretrain.py`` (a script in the style of Megatron-LM 0.19's
``pretrain_gpt.py``: model provider, forward step, mock-data provider) trains a tiny GPT for 10
iterations per configuration on gloo, at world size 1 and 2; each of the four launches below
runs several configurations in one process:

- *plain*: the script alone (CPU compatibility only; Megatron-LM's parser and
  ``get_megatron_optimizer`` untouched): Megatron-LM's Adam, megatron-core's ``--optimizer
  muon`` (Emerging-Optimizers) at Megatron-LM's default Muon flags (bf16 Newton–Schulz) with
  learned absolute positions (Megatron-LM's default); at world size 2 also with RoPE, a tiny
  MoE, two pipeline stages of two virtual stages each, and the documented two-line edit
  (``extra_args_provider=megatron_ext_args``); at world size 1 with fp32 Newton–Schulz;
- *runner*: ``-m megatron_ext.megatron.run_pretrain`` (the zero-edit entry): Adam, the four
  ``--megatron-ext-optimizer`` choices (Muon and KL-SOAP at world size 1), Muon with RoPE,
  MoE and virtual pipeline stages at world size 2 (fp32 Newton–Schulz at world size 1), and
  checkpoints: the world-size-2 Muon run saves at 5 (and 10) with dropout on, resumed from 5
  at world size 2 with dropout and without, and at world size 1 without; ``--ckpt-format
  torch`` at world size 2 is refused.

References: the plain runs (Adam identical to the bit; megatron-core's Muon identical to the
bit, losses and gradient norms, at every iteration) and the uninterrupted run (a resumed run's
iterations 6-10 identical to the bit, dropout included).
"""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import DIST, run_torchrun

SCRIPT = DIST / "megatron_lm_pretrain.py"
# a tiny GPT as Megatron-LM builds it by default (learned absolute positions, LayerNorm, GeLU,
# dropout 0.1, tied embeddings); local layers (no Transformer Engine); the LR schedule fixed at
# 10 iterations so a 5-iteration run is the first half of a 10-iteration one
COMMON = [
    *("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4"),
    *("--seq-length", "32", "--max-position-embeddings", "32"),
    *("--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10"),
    *("--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine"),
    *("--lr-warmup-iters", "2", "--lr-decay-iters", "10"),
    *("--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128"),
    *("--distributed-backend", "gloo", "--log-interval", "1", "--seed", "1234"),
    # the data in this process: no DataLoader worker processes (spawned, each re-imports
    # Megatron-LM) for a mock dataset
    *("--num-workers", "0"),
    *("--eval-iters", "0", "--eval-interval", "1000", "--split", "100,0,0"),
    *("--transformer-impl", "local", "--no-gradient-accumulation-fusion"),
    *("--no-persist-layer-norm", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion"),
    *("--no-bias-dropout-fusion", "--no-rope-fusion"),
]
ROPE = ["--position-embedding-type", "rope"]
# MoE without biases, as MoE models are built (megatron-core's expert MLP adds a bias in place
# on a view, which autograd refuses): 4 experts, top-2, with the router Muon takes
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]
# two pipeline stages of two model chunks each (Megatron-LM's interleaved schedule, its default
# overlapped p2p), the word embeddings tied over the stages
VIRTUAL = [
    *("--pipeline-model-parallel-size", "2", "--num-layers", "4"),
    *("--num-layers-per-virtual-pipeline-stage", "1"),
]
# Newton–Schulz in fp32 (Megatron-LM's default "medium" runs it in bf16)
HIGH = ["--muon-fp32-matmul-prec", "high"]
EXT = ("muon", "kl_soap", "mop", "lion")


def _launch(tmp, name: str, nproc: int, runs: dict[str, list[str]], module: bool) -> dict:
    plan, out = tmp / f"{name}.json", tmp / f"{name}.out.json"
    plan.write_text(json.dumps({"common": COMMON, "runs": runs}))
    if module:
        run_torchrun(
            "megatron_ext.megatron.run_pretrain",
            nproc,
            str(SCRIPT),
            str(plan),
            str(out),
            module=True,
        )
    else:
        run_torchrun(SCRIPT, nproc, str(plan), str(out))
    return json.loads(out.read_text())


def _plain_runs(world_size: int) -> dict[str, list[str]]:
    runs = {"adam": [], "mc_muon": ["--optimizer", "muon"]}
    if world_size == 1:
        runs["mc_muon_high"] = ["--optimizer", "muon", *HIGH]
    else:  # RoPE and MoE at world size 2 (the data-parallel path; world size 1 adds nothing)
        runs["mc_muon_rope"] = ["--optimizer", "muon", *ROPE]
        runs["mc_muon_moe"] = ["--optimizer", "muon", *MOE]
        runs["mc_muon_vp"] = ["--optimizer", "muon", *VIRTUAL]
        # last: the edit installs megatron-ext in this process
        runs["two_line_kl_soap"] = ["--two-line-edit", "--megatron-ext-optimizer", "kl_soap"]
    return runs


def _runner_runs(ckpt, world_size: int) -> dict[str, list[str]]:
    muon = ["--megatron-ext-optimizer", "muon"]
    # every choice at world size 2; at 1 the ones the other checks compare (MOP and Lion take
    # the same drop-in path as KL-SOAP: world size 2 covers them)
    chosen = EXT if world_size == 2 else ("muon", "kl_soap")
    runs = {"adam": [], **{name: ["--megatron-ext-optimizer", name] for name in chosen}}
    resume = ["--load", str(ckpt), "--ckpt-step", "5"]
    if world_size == 2:
        runs["muon_rope"] = [*muon, *ROPE]
        runs["muon_moe"] = [*muon, *MOE]
        runs["muon_vp"] = [*muon, *VIRTUAL]
        # the uninterrupted run saves at 5 and 10 (the parity with megatron-core's Muon, which
        # does not save, shows that saving changes nothing)
        runs["muon"] += ["--save-interval", "5", "--save", str(ckpt)]
        runs["resumed"] = [*muon, *resume]
        runs["resumed_no_dropout"] = [*muon, *NO_DROPOUT, *resume]
        runs["torch_format_refused"] = [
            *(*muon, "--ckpt-format", "torch", "--save-interval", "5"),
            *("--save", str(ckpt.parent / "torch_format")),
        ]
    else:
        runs["muon_high"] = [*muon, *HIGH]
        runs["resumed_other_dp"] = [*muon, *NO_DROPOUT, *resume]
    return runs


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("mlm2")
    ckpt = tmp / "ckpt"
    return {
        "plain": _launch(tmp, "plain", 2, _plain_runs(2), module=False),
        "runner": _launch(tmp, "runner", 2, _runner_runs(ckpt, 2), module=True),
        "ckpt": ckpt,
    }


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, two_ranks) -> dict:
    tmp = tmp_path_factory.mktemp("mlm1")
    return {
        "plain": _launch(tmp, "plain", 1, _plain_runs(1), module=False),
        "runner": _launch(tmp, "runner", 1, _runner_runs(two_ranks["ckpt"], 1), module=True),
    }


def _world(request, name: str) -> dict:
    # each fixture named literally, so that tests/tiers.py sees the launches (torchrun lane)
    if name == "one_rank":
        return request.getfixturevalue("one_rank")
    return request.getfixturevalue("two_ranks")


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("world", ["one_rank", "two_ranks"])
def test_every_optimizer_trains_ten_iterations(world, request):
    got = _world(request, world)
    for where in ("plain", "runner"):
        for name, run in got[where].items():
            if name.endswith("_refused"):
                continue
            if name.startswith("resumed"):
                assert run["iterations"] == [6, 7, 8, 9, 10], name
                continue
            assert run["iterations"] == list(range(1, 11)), (where, name)
            assert all(math.isfinite(x) for x in run["loss"]), (where, name)
            assert run["loss"][-1] < run["loss"][0] - 0.05, (
                f"{where} {name} did not learn: {run['loss']}"
            )


@pytest.mark.parametrize("world", ["one_rank", "two_ranks"])
def test_megatron_lms_adam_is_untouched(world, request):
    got = _world(request, world)
    assert got["runner"]["adam"] == got["plain"]["adam"]


@pytest.mark.parametrize(
    ("world", "variant"),
    [(w, "") for w in ("one_rank", "two_ranks")]
    + [("two_ranks", "_rope"), ("two_ranks", "_moe"), ("two_ranks", "_vp"), ("one_rank", "_high")],
)
def test_ext_muon_equals_megatron_cores_muon(world, variant, request):
    """Megatron-LM's default Muon flags (``--muon-fp32-matmul-prec medium``: bf16 Newton–Schulz,
    split QKV, spectral scale): learned absolute positions, RoPE, MoE (the router Muon-trained),
    virtual pipeline stages (PP=2 x 2 chunks, Megatron-LM's interleaved schedule) give the same
    losses and gradient norms to the bit at every iteration. fp32 Newton–Schulz
    (``high``, world size 1) within 1e-6 relative (measured 1.1e-7 at iteration 9): megatron-ext
    multiplies matrices of one shape in one batched product, Emerging-Optimizers one by one, and
    fp32 keeps the kernels' last-bit differences that bf16 rounding removes."""
    got = _world(request, world)
    ours, theirs = got["runner"][f"muon{variant}"], got["plain"][f"mc_muon{variant}"]
    if variant == "_high":
        assert _rel(ours["loss"], theirs["loss"]) <= 1e-6, (ours["loss"], theirs["loss"])
    else:
        assert ours["loss"] == theirs["loss"], (_rel(ours["loss"], theirs["loss"]), ours, theirs)
        assert ours["grad_norm"] == theirs["grad_norm"]
    # and it is not Adam: Muon moves the loss somewhere else
    assert _rel(ours["loss"], got["plain"]["adam"]["loss"]) > 1e-3


def test_the_two_line_edit_is_the_runner(two_ranks):
    assert two_ranks["plain"]["two_line_kl_soap"] == two_ranks["runner"]["kl_soap"]


def test_resume_at_five_is_bit_exact_with_dropout(two_ranks):
    """Saved at 5 by the 10-iteration run (dropout 0.1), resumed to 10: the CPU host's stand-in
    device generator continues as in the uninterrupted run (cpu_compat_training)."""
    runner = two_ranks["runner"]
    whole, resumed = runner["muon"], runner["resumed"]
    assert resumed["loss"] == whole["loss"][5:]
    assert resumed["grad_norm"] == whole["grad_norm"][5:]


def test_resume_at_another_data_parallel_size(one_rank, two_ranks):
    """The world-size-2 checkpoint resumed without dropout by two ranks and by one: the same
    model and optimizer state, gradients summed in another order."""
    two = two_ranks["runner"]["resumed_no_dropout"]
    one = one_rank["runner"]["resumed_other_dp"]
    assert _rel(one["loss"], two["loss"]) <= 1e-5
    assert two["loss"] != two_ranks["runner"]["resumed"]["loss"]  # dropout was off


def test_the_legacy_torch_format_is_refused_with_sharded_state(two_ranks):
    """``--ckpt-format torch`` writes data-parallel rank 0's optimizer state only: refused at
    DP 2 before anything is written (the runner prints the message as its one line, exit 1)."""
    refused = two_ranks["runner"]["torch_format_refused"]
    assert "--ckpt-format torch" in refused["error"] and "torch_dist" in refused["error"]
    assert "\n" not in refused["error"]
    assert not (two_ranks["ckpt"].parent / "torch_format").exists()
