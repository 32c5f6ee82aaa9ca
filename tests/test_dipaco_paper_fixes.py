"""DiPaCo as the paper defines it (issue 24, item 1), each against the trainer's own tasks run
in this process (``dipaco_tiny`` shrunk: a 4-block width-32 GPT, τ = 1, the real tasks claimed
by :func:`~megatron_ext.dipaco.run.worker.run_worker` from an SQLite queue):

- path-specific parts take the outer Nesterov step (paper: Sec. 2.6.1): block 0 kept
  path-specific equals, bit for bit, block 0 inside a level of K = P modules, each used by one
  path -- modules the outer step has always covered;
- early stopping compares losses on one fixed slice per path: after a discriminative re-shard
  every path's validation documents are the ones phase 0 drew, and it never trains on them;
- the paper re-shards once (Sec. 2.4.2): the default, halfway;
- evaluation reads documents to ``dipaco.eval_seq_length`` tokens (the paper's 2,048 vs 1,024).

The routing fix (product k-means) is tested on its own in tests/test_dipaco_routing.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_ext.config import load_recipe
from megatron_ext.dipaco.recipe import DipacoConfig
from megatron_ext.dipaco.run.plan import build_plan, final_id, outer_id, reshard_phases, train_id

pytestmark = pytest.mark.usefixtures("one_torch_thread")

COMMON = ["training.steps=2", "dipaco.tau=1", "dipaco.eval_documents=8"]
#: block 0 path-specific (K = (2, 1): level 0's modules are used by one path each) ...
SPECIFIC = [
    "dipaco.modules_per_level=[2,1]",
    "dipaco.level_parts=[1, embedding 2-3 final_layernorm output_layer]",
    "dipaco.path_specific=0",
    "dipaco.reshards=0",
]
#: ... and the same model with block 0 inside those single-path modules
IN_LEVEL = [
    "dipaco.modules_per_level=[2,1]",
    "dipaco.level_parts=[0-1, embedding 2-3 final_layernorm output_layer]",
    "dipaco.path_specific=",
    "dipaco.reshards=0",
]
#: 2 x 2 paths, 2 phases, the discriminative re-shard before phase 1, longer eval documents
RESHARD = ["dipaco.phases=2", "dipaco.reshards=1", "dipaco.eval_seq_length=56"]


def _run(data: Path, root: Path, name: str, extra: list[str], kinds: tuple[str, ...]):
    from megatron_ext.bench._dipaco_measure import small_overrides
    from megatron_ext.dipaco.run.worker import run_worker

    overrides = [*small_overrides(data, root / name), *COMMON, *extra]
    recipe = load_recipe("dipaco_tiny", overrides)
    wanted = [t.id for t in build_plan(recipe) if t.kind in kinds]
    report = run_worker(recipe, name=name, max_tasks=len(wanted))
    assert sorted(report.completed) == sorted(wanted)
    return recipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from megatron_ext.bench._dipaco_measure import write_small_corpus
    from megatron_ext.convert.parity import init_single_process

    init_single_process()
    data = write_small_corpus(tmp_path_factory.mktemp("fix_data"), documents=300)
    root = tmp_path_factory.mktemp("fix_runs")
    train = ("prepare", "base", "route", "train", "outer")
    return {
        "specific": _run(data, root, "specific", SPECIFIC, train),
        "in_level": _run(data, root, "in_level", IN_LEVEL, train),
        "reshard": _run(data, root, "reshard", RESHARD, (*train, "score", "final")),
    }


def _files(recipe):
    from megatron_ext.dipaco.run.store import RunFiles
    from megatron_ext.dipaco.run.worker import open_run_queue

    return RunFiles(recipe, open_run_queue(recipe, worker="test"))


def _tools(recipe):
    from megatron_ext.dipaco.run.tools import TaskTools

    return TaskTools(recipe, lambda: False)


def test_path_specific_parts_take_the_outer_step(runs: dict) -> None:
    from megatron_ext.dipaco.model.layout import ModuleId
    from megatron_ext.dipaco.run.store import load_tensors

    own, level = _files(runs["specific"]), _files(runs["in_level"])
    block0 = "decoder.layers.0."
    for p in range(2):
        for phase in range(2):  # after phase 0 (no momentum yet) and after phase 1
            saved = load_tensors(own.done(train_id(phase, p)) / "state.pt")
            module = load_tensors(level.done(outer_id(phase, ModuleId(0, p))) / "module.pt")
            names = [n for n in module["params"] if n.startswith(block0)]
            assert names and set(saved["specific"]) == set(names)
            for n in names:
                assert torch.equal(saved["specific"][n], module["params"][n]), (p, phase, n)
                assert torch.equal(saved["specific_momentum"][n], module["momentum"][n])
        # and it is a step, not the raw inner values: the path's trained copy differs
        trained = load_tensors(own.done(train_id(1, p)) / "l0.pt")
        assert set(trained).isdisjoint(saved["specific"])
        momentum = saved["specific_momentum"]
        assert all(float(v.abs().max()) > 0 for v in momentum.values())


def test_early_stopping_slices_stay_fixed_through_a_reshard(runs: dict) -> None:
    recipe = runs["reshard"]
    assert reshard_phases(recipe) == [1]
    files = _files(recipe)
    first, second = files.shards(0), files.shards(1)
    moved = 0
    for p in range(4):
        np.testing.assert_array_equal(second[f"val_{p}"], first[f"val_{p}"])
        assert len(first[f"val_{p}"]) > 0
        for phase in (first, second):  # a path never trains on its own slice
            assert not np.isin(phase[f"train_{p}"], first[f"val_{p}"]).any()
        moved += not np.array_equal(second[f"train_{p}"], first[f"train_{p}"])
    assert moved > 0  # the re-shard did move training documents
    # the early-stopping history (version 0, 1 and 2) is on that slice: recompute version 0's
    for p in range(4):
        history = files.result(final_id(p))["val"]
        assert len(history) == 3 and all(v is not None for v in history)
        want = _val_loss(recipe, files, 0, p, first[f"val_{p}"])
        assert history[0] == pytest.approx(want, rel=1e-6)


def _val_loss(recipe, files, version: int, path: int, docs: np.ndarray) -> float:
    from megatron_ext.dipaco.data.documents import ShardStream
    from megatron_ext.dipaco.model.parts import assign_params
    from megatron_ext.dipaco.model.path_model import lm_loss

    tools = _tools(recipe)
    model = tools.path_model.model
    assign_params(model, *files.composition(version, path))
    model.eval()
    stream = ShardStream(tools.dataset, docs)
    with torch.no_grad():
        windows = stream.val_windows(recipe.training.seq_length)
        return float(np.mean([float(lm_loss(model, w)) for w in windows]))


def test_evaluation_reads_documents_to_eval_seq_length(runs: dict) -> None:
    from megatron_ext.dipaco.run.store import load_tensors

    files = _files(runs["reshard"])
    dataset = _tools(runs["reshard"]).dataset
    docs = files.split()["eval"]
    losses = load_tensors(files.done(final_id(0)) / "eval_losses.pt")["losses"]
    want = [min(int(dataset.sequence_lengths[d]), 57) - 1 for d in docs]
    assert [len(x) for x in losses] == want
    assert max(want) > 32  # longer than training.seq_length = 32 reads


def test_the_paper_reshards_once_by_default() -> None:
    assert DipacoConfig().reshards == 1
    paper = load_recipe("dipaco_paper")
    d = paper.section(DipacoConfig)
    assert (d.phases, d.tau, d.eval_seq_length) == (427, 150, 2048)  # 64K steps, 2,048 at eval
    assert reshard_phases(paper) == [214]  # one re-shard, halfway
    tiny = load_recipe("dipaco_tiny", ["dipaco.phases=5", "dipaco.reshards=4"])
    assert reshard_phases(tiny) == [1, 2, 3, 4]  # before every phase, as reshard_every=1 was


def test_the_w_router_reads_the_whole_prefix_so_far() -> None:
    """Re-routing (paper Sec. 4.4) routes chunk i + 1 on everything before it: the row for chunk
    i is the mean per-token feature over chunks 0..i, built from the stored chunk means; a
    document's last chunk routes nothing."""
    from megatron_ext.dipaco.data.features import chunk_spans
    from megatron_ext.dipaco.run.evaluate import _prefix_rows

    rng = np.random.default_rng(0)
    lengths, r, w = [23, 9, 40], 5, 8
    spans = [chunk_spans(n, r, w) for n in lengths]
    tokens = [rng.normal(size=(n, 3)) for n in lengths]  # per-token features of each document
    chunk_means = np.concatenate(
        [[t[a:b].mean(0) for a, b in s] for t, s in zip(tokens, spans, strict=True)]
    )
    offsets = np.cumsum([0, *(len(s) for s in spans)])
    rows = _prefix_rows(chunk_means, offsets, spans)
    for t, s, got in zip(tokens, spans, rows, strict=True):
        assert got.shape == (len(s) - 1, 3)
        for i, (_, end) in enumerate(s[:-1]):
            np.testing.assert_allclose(got[i], t[:end].mean(0), rtol=1e-12)
    with pytest.raises(ValueError, match="rows for"):
        _prefix_rows(chunk_means[:-1], offsets - np.r_[0, 0, 0, 1], spans)
