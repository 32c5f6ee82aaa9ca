"""SOMA as the paper defines it (issue 24, item 1), each check failing on the old behaviour:

- wide controls: the per-expert head is the expert's tied embedding/decoder, updated by the
  decoder-path delta rule and never SPSA-perturbed (paper: App. C, App. E Eq. 7, App. I);
- ``recipes/soma_paper.yaml`` holds the paper's Table 1 / App. D values, each citing its source;
- the test set is held-out documents, not random windows (Table 1, App. L);
- DDPP splits accumulation batches as well as directions (App. H.2).
"""

from __future__ import annotations

import json
import re
from typing import ClassVar

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

from megatron_ext.config import load_recipe
from megatron_ext.soma import update as update_mod
from megatron_ext.soma.data import ExpertShard
from megatron_ext.soma.layout import BodyLayout, ExpertShape, init_body, init_embedding
from megatron_ext.soma.recipe import SomaConfig
from megatron_ext.soma.state import SEED_EXPERT, ExpertState
from megatron_ext.soma.update import UpdateContext, head_update, spsa_update
from megatron_ext.zo.directions import DirectionSplit
from megatron_ext.zo.spsa import PlateauHalving, ZOAdam
from tests.conftest import ROOT
from tests.test_soma_model import reference_forward

pytestmark = pytest.mark.usefixtures("one_torch_thread")

WIDE = ExpertShape(d_embed=8, d_model=12, num_blocks=1)


def _wide_setup(accumulation: int = 1, world_units: int | None = None):
    cfg = SomaConfig(
        d_embed=8, d_model=12, num_blocks=1, n_pert=4, batch_size=3, seq_length=16,
        accumulation=accumulation, head_lr=1e-2, weight_decay=1e-4,
    )  # fmt: skip
    layout = BodyLayout.from_shape(WIDE)
    gen = torch.Generator().manual_seed(5)
    windows = np.random.default_rng(0).integers(0, 256, size=(10, 33), dtype=np.uint8)
    ctx = UpdateContext(
        cfg=cfg,
        layout=layout,
        emb=init_embedding(WIDE, gen),  # a wide body must never read it
        windows=windows,
        seed=3,
        split=DirectionSplit(world_units or cfg.n_pert * accumulation),
    )
    theta = init_body(WIDE, gen)
    state = ExpertState(
        0,
        theta,
        ZOAdam(layout.spsa_numel),
        PlateauHalving(lr=1e-2, eps=1e-2),
        head_adam=ZOAdam(theta.numel() - layout.spsa_numel),
    )
    shard = ExpertShard(0, np.arange(10), np.array([], dtype=np.int64))
    return ctx, state, shard


def test_wide_head_is_outside_spsa_and_embeds_the_inputs(monkeypatch):
    """Every perturbed copy carries the unperturbed head; the SPSA step leaves the head
    unchanged (old: the head was inside the SPSA vector and moved with it); the shared
    ``emb`` is not read by a wide body (old: it embedded the inputs)."""
    ctx, state, shard = _wide_setup()
    layout, n = ctx.layout, ctx.layout.spsa_numel
    assert layout.numel - n == 256 * 8  # the head is the suffix, V x d_E
    head0, body0 = state.theta[n:].clone(), state.theta[:n].clone()
    seen = []
    real = update_mod.batched_loss

    def spy(thetas, emb, tokens, lay):
        seen.append(thetas.clone())
        return real(thetas, emb, tokens, lay)

    monkeypatch.setattr(update_mod, "batched_loss", spy)
    spsa_update(ctx, [state], [shard])
    (perturbed,) = seen
    assert perturbed.shape == (2 * ctx.cfg.n_pert, layout.numel)
    assert torch.equal(perturbed[:, n:], head0.expand(len(perturbed), -1))
    assert not torch.equal(perturbed[:, :n], body0.expand(len(perturbed), -1))
    assert torch.equal(state.theta[n:], head0) and not torch.equal(state.theta[:n], body0)
    # the wide body embeds with its own head: another emb gives the same losses
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    other = torch.randn_like(ctx.emb)
    a = update_mod.batched_loss(state.theta[None], ctx.emb, tokens, layout)
    b = update_mod.batched_loss(state.theta[None], other, tokens, layout)
    assert torch.equal(a, b)


def test_wide_head_step_is_the_decoder_path_delta_rule():
    """head_update's gradient == float64 autograd of the cross-entropy w.r.t. the decoder alone
    (hidden states detached; paper App. E Eq. 7), on the expert's OWN head, and Adam applies it
    to that head only (the body is not touched)."""
    ctx, state, shard = _wide_setup(accumulation=2)
    n = ctx.layout.spsa_numel
    captured = {}

    class Spy(ZOAdam):
        def step(self, theta, grad, lr, weight_decay):
            captured.update(grad=grad.clone(), lr=lr, wd=weight_decay)
            super().step(theta, grad, lr, weight_decay)

    spy = Spy(state.theta.numel() - n)
    body0, head0 = state.theta[:n].clone(), state.theta[n:].clone()
    head_update(ctx, state, shard, spy, update=0)
    assert torch.equal(state.theta[:n], body0) and not torch.equal(state.theta[n:], head0)
    theta64 = torch.cat([body0, head0]).double()
    head64 = head0.double().view(256, 8).clone().requires_grad_(True)
    total = torch.zeros(256, 8, dtype=torch.float64)
    for a in range(2):
        tokens = update_mod._batch(ctx, shard, 0, 0, a)
        hidden, _ = reference_forward(theta64, None, tokens[:, :-1], WIDE)
        z = hidden.detach() @ head64.T
        loss = F.cross_entropy(z.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        (g,) = torch.autograd.grad(loss, head64)
        total += g
    torch.testing.assert_close(
        captured["grad"].double().view(256, 8), total / 2, rtol=1e-4, atol=1e-7
    )
    assert captured["lr"] == ctx.cfg.head_lr


def test_wide_experts_train_their_own_heads(tmp_path):
    """A wide two-expert run: each expert's head moved away from the seed's and the two differ
    (updated locally, never shared: paper App. I 'The saved heads differ across experts')."""
    from tests.test_soma_trainer import TINY, train_here, write_stdlib_corpus

    corpus = write_stdlib_corpus(tmp_path / "docs.txt")
    raw = json.loads(json.dumps(TINY))
    raw.update(run_dir=str(tmp_path / "wide"), data={"source": [str(corpus)]})
    raw["soma"].update(d_model=12, expert_updates=3, seed_updates=2, accumulation=1)
    path = tmp_path / "wide.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    train_here(path)
    from megatron_ext.soma.state import expert_path, load_file

    files = [load_file(expert_path(tmp_path / "wide", e)) for e in (SEED_EXPERT, 0, 1)]
    n = BodyLayout.from_shape(WIDE).spsa_numel
    heads = [f["state"]["theta"][n:] for f in files]
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[0], heads[2])
    assert not torch.equal(heads[1], heads[2])
    assert all(f["state"]["head_adam"]["steps"] > 0 for f in files)
    assert all(f["state"]["adam"]["m"].numel() == n for f in files)


#: The paper's values (Table 1, App. D, App. E) that recipes/soma_paper.yaml must hold.
PAPER = {
    "num_experts": 256, "d_embed": 32, "d_model": 32, "num_blocks": 2, "n_pert": 64,
    "batch_size": 64, "seq_length": 1024, "lr": 1e-3, "eps": 1e-3, "lr_floor": 1e-5,
    "plateau_patience": 1000, "plateau_min_delta": 1e-8, "weight_decay": 1e-4,
    "seed_updates": 1000, "seed_lr": 2.5e-3, "val_fraction": 0.01, "route_bytes": 256,
    "score_bytes": 768, "router_max_features": 50000, "router_min_df": 5, "router_svd_dim": 128,
}  # fmt: skip


def test_paper_recipe_holds_the_papers_values_each_with_its_source():
    path = ROOT / "recipes" / "soma_paper.yaml"
    recipe = load_recipe(path, world_size=1 * 256)
    s = recipe.section(SomaConfig)
    got = {k: getattr(s, k) for k in PAPER}
    assert got == PAPER
    lines = path.read_text(encoding="utf-8").splitlines()
    body = lines[lines.index("soma:") + 1 :]
    for line in body:
        if not line.startswith("  ") or not line.strip():
            break
        assert re.search(r"#.*(Table \d|App\. [A-Z]|Sec\. \d|\(ours\))", line), line
    from megatron_ext.soma.trainer import new_state

    theta = torch.zeros(BodyLayout.from_shape(ExpertShape()).numel)
    assert new_state(recipe, SEED_EXPERT, theta).plateau.lr == 2.5e-3
    assert new_state(recipe, 0, theta).plateau.lr == 1e-3


def test_test_set_is_held_out_documents(tmp_path):
    """prepare_corpus's test windows come from documents none of whose bytes reach a training
    window (old: random windows of one stream, so a test window's document continued in the
    neighbouring training windows); each is the first window of its document."""
    from megatron_ext.soma.corpus import prepare_corpus, test_windows

    docs = [f"<doc{i:03d}> " + f"body of document {i:03d} with words " * 12 for i in range(120)]
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    raw = {
        "trainer": "soma",
        "run_dir": str(tmp_path / "run"),
        "data": {"source": [str(path)]},
        "soma": {"num_experts": 2, "window_bytes": 129, "seq_length": 64, "route_bytes": 32,
                 "score_bytes": 64, "test_fraction": 0.1, "router_svd_dim": 8},
    }  # fmt: skip
    rp = tmp_path / "r.yaml"
    rp.write_text(yaml.safe_dump(raw), encoding="utf-8")
    recipe = load_recipe(rp, world_size=1)
    corpus = prepare_corpus(recipe, 0, lambda: None, lambda _m: None)
    assert len(corpus.test) == 12  # round(120 * 0.1) documents, one window each
    train_stream = corpus.windows.tobytes()
    for w in corpus.test:
        text = w.tobytes().decode("utf-8", errors="ignore")
        tag = re.match(r"<doc(\d{3})>", text)
        assert tag, text[:20]
        i = int(tag.group(1))
        assert docs[i].encode()[:129] == w.tobytes()
        assert f"document {i:03d} ".encode() not in train_stream
    windows, _ = test_windows(recipe)
    assert np.array_equal(windows, corpus.test)


class _FakeRanks(DirectionSplit):
    """Rank ``rank`` of ``world`` with the all-gather answered from a one-rank run's
    differences (checking that this rank's own part equals its slice of them)."""

    full: ClassVar[dict] = {}

    def gather(self, local_diffs):
        full = self.full["diffs"].pop(0)
        r = self.local()
        assert torch.equal(local_diffs, full[r.start : r.stop])
        return full


def test_ddpp_splits_batches_as_well_as_directions(monkeypatch):
    """A = 2 accumulation batches over 2 ranks: each rank draws and scores ONE batch with all
    its directions (old: both ranks scored both batches, half the directions each), and each
    rank's update equals the one-rank update bit for bit."""
    narrow = ExpertShape(d_embed=8, d_model=8, num_blocks=1)
    cfg = SomaConfig(
        d_embed=8, d_model=8, num_blocks=1, n_pert=4, batch_size=3, seq_length=16,
        accumulation=2, weight_decay=1e-4,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(2)
    windows = np.random.default_rng(0).integers(0, 256, size=(10, 33), dtype=np.uint8)
    ctx1 = UpdateContext(
        cfg, BodyLayout.from_shape(narrow), init_embedding(narrow, gen), windows, 3,
        DirectionSplit(8),
    )  # fmt: skip
    theta = init_body(narrow, gen)
    ref = ExpertState(0, theta, ZOAdam(theta.numel()), PlateauHalving(1e-2, 1e-2))
    shard = ExpertShard(0, np.arange(10), np.array([], dtype=np.int64))
    drawn: list[tuple[int, int]] = []
    real_batch = update_mod._batch

    def spy(ctx, shard_, expert, update, a):
        drawn.append((update, a))
        return real_batch(ctx, shard_, expert, update, a)

    monkeypatch.setattr(update_mod, "_batch", spy)
    theta0 = ref.theta.clone()
    gathered = []

    class Record(DirectionSplit):
        def gather(self, local_diffs):
            gathered.append(local_diffs.clone())
            return local_diffs

    ctx1.split = Record(8)
    spsa_update(ctx1, [ref], [shard])
    assert sorted(drawn) == [(0, 0), (0, 1)]
    for rank in (0, 1):
        drawn.clear()
        _FakeRanks.full = {"diffs": [gathered[0]]}
        st = ExpertState(0, theta0.clone(), ZOAdam(theta0.numel()), PlateauHalving(1e-2, 1e-2))
        ctx1.split = _FakeRanks(8, rank, 2)
        spsa_update(ctx1, [st], [shard])
        assert drawn == [(0, rank)], drawn  # this rank's batch only
        assert torch.equal(st.theta, ref.theta)
