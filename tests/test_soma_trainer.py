"""The SOMA trainer end to end on a small corpus: exact resume, FSO without communication,
DDPP bit-identical to one rank, bad input, and the routed evaluation against a direct computation.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from megatron_ext.config import load_recipe
from megatron_ext.errors import ConfigError, TrainingDivergedError
from megatron_ext.run.metrics import read_jsonl
from megatron_ext.soma.recipe import SomaConfig
from tests.conftest import ROOT, run_torchrun

SCRIPT = ROOT / "tests" / "dist" / "soma_run.py"
METRICS = ("metrics.jsonl", "metrics.rank1.jsonl")  # rank 0's, rank 1's

TINY = {
    "trainer": "soma",
    "soma": {
        "num_experts": 2,
        "d_embed": 8,
        "d_model": 8,
        "num_blocks": 1,
        "n_pert": 4,
        "batch_size": 4,
        "seq_length": 32,
        "accumulation": 2,
        "seed_updates": 4,
        "expert_updates": 6,
        "eval_interval": 2,
        "val_windows": 2,
        "head_lr": 1.0e-2,
        "lr": 1.0e-2,
        "eps": 1.0e-2,
        "lr_floor": 1.0e-5,
        "route_bytes": 64,
        "score_bytes": 128,
        "window_bytes": 257,
        "test_fraction": 0.05,
        "val_fraction": 0.02,
        "router_svd_dim": 16,
    },
    "seed": 7,
    "checkpoint": {"save_interval": 0},
}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~120 KB of real English-ish text: the first stdlib docstrings, as one .txt file."""
    return write_stdlib_corpus(tmp_path_factory.mktemp("soma_corpus") / "docs.txt")


def write_stdlib_corpus(path: Path, max_bytes: int = 120_000) -> Path:
    """The first stdlib docstrings (real documents, each long enough for SOMA's held-out test
    windows) until ``max_bytes``, as one .txt file at ``path``."""
    from megatron_ext.data.corpus import python_stdlib_documents

    docs, size = [], 0
    for doc in python_stdlib_documents():
        docs.append(doc)
        size += len(doc.encode())
        if size > max_bytes:
            break
    path.write_text("\n\n".join(docs), encoding="utf-8")
    return path


def write_recipe(tmp: Path, corpus: Path, run: str, **soma) -> Path:
    raw = json.loads(json.dumps(TINY))
    raw["run_dir"] = str(tmp / run)
    raw["data"] = {"source": [str(corpus)]}
    raw["soma"].update(soma)
    path = tmp / f"{run}.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def train_here(recipe_path: Path, *overrides: str) -> None:
    from megatron_ext.soma.trainer import train

    train(load_recipe(recipe_path, list(overrides), world_size=1))


def bodies(run_dir: Path, n: int) -> list[torch.Tensor]:
    from megatron_ext.soma.state import SEED_EXPERT, expert_path, load_file

    return [load_file(expert_path(run_dir, e))["state"]["theta"] for e in [SEED_EXPERT, *range(n)]]


def histories(run_dir: Path, n: int) -> list[list[dict]]:
    from megatron_ext.soma.state import SEED_EXPERT, expert_path, load_file

    return [
        load_file(expert_path(run_dir, e))["state"]["history"] for e in [SEED_EXPERT, *range(n)]
    ]


def test_resume_is_exact(tmp_path, corpus):
    """6 expert updates straight == 4 updates, stop, resume to 6 (bodies, losses, lr/eps)."""
    straight = write_recipe(tmp_path, corpus, "straight")
    train_here(straight)
    split = write_recipe(tmp_path, corpus, "split", expert_updates=4)
    train_here(split)
    first = bodies(tmp_path / "split", 2)
    train_here(split, "soma.expert_updates=6")
    a, b = bodies(tmp_path / "straight", 2), bodies(tmp_path / "split", 2)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)
    assert not torch.equal(first[1], b[1])  # the resumed run did train further
    assert histories(tmp_path / "straight", 2) == histories(tmp_path / "split", 2)
    summary = json.loads((tmp_path / "split" / "summary.json").read_text())
    assert summary["k"] == 2 and summary["test_windows"] > 0
    rows = (tmp_path / "split" / "soma" / "curves.csv").read_text().splitlines()
    assert len(rows) == 1 + sum(len(h) for h in histories(tmp_path / "split", 2))
    assert (tmp_path / "split" / "soma" / "curves.png").stat().st_size > 0


def test_fso_is_silent_and_ddpp_is_bit_identical(tmp_path, corpus):
    """2 ranks vs 1 process, same recipe: FSO (each rank its own expert, zero collectives while
    the experts train) and DDPP (directions split, scalars exchanged) give bit-identical bodies."""
    one = write_recipe(tmp_path, corpus, "one")
    train_here(one)
    ref = bodies(tmp_path / "one", 2)
    for mode in ("fso", "ddpp"):
        recipe = write_recipe(tmp_path, corpus, mode, distribution=mode)
        counts = tmp_path / f"{mode}_calls"
        run_torchrun(SCRIPT, 2, str(recipe), str(counts), timeout=300)
        got = bodies(tmp_path / mode, 2)
        for e, (x, y) in enumerate(zip(ref, got, strict=True)):
            assert torch.equal(x, y), f"{mode}: body {e - 1} differs from the 1-process run"
        calls = [json.loads(Path(f"{counts}.{r}").read_text()) for r in range(2)]
        if mode == "fso":
            assert calls == [[], []], calls
        else:  # the counter does see traffic: one scalar all-gather per expert and update,
            # and one all-reduce of an integer per update (the ranks' stop decision)
            assert all(c and set(c) == {"all_gather", "all_reduce"} for c in calls), calls
        # Each validation check is written once, by the rank that writes the expert's file:
        # under FSO rank 1 writes its own expert's records, under DDPP rank 0 writes them all.
        run = tmp_path / mode
        rows = {r: read_jsonl(run / f) for r, f in enumerate(METRICS) if (run / f).is_file()}
        experts = {r: sorted({row["expert"] for row in got}, key=str) for r, got in rows.items()}
        assert experts == ({0: [0, "seed"], 1: [1]} if mode == "fso" else {0: [0, 1, "seed"]})


def test_validation_checks_are_the_runs_metrics_records(tmp_path, corpus):
    """One process: metrics.jsonl holds every validation check, the same figures as the
    experts' checkpointed histories (what curves.csv is written from)."""
    train_here(write_recipe(tmp_path, corpus, "records", expert_updates=4))
    run = tmp_path / "records"
    rows = read_jsonl(run / "metrics.jsonl")
    expected = [
        {"expert": "seed" if e < 0 else e, **h}
        for e, history in zip([-1, 0, 1], histories(run, 2), strict=True)
        for h in history
    ]
    key = lambda r: (str(r["expert"]), r["update"])  # noqa: E731
    got = [
        {k: v for k, v in r.items() if k not in ("step", "perturbed_tokens_per_s")} for r in rows
    ]
    assert sorted(got, key=key) == sorted(expected, key=key) and len(rows) == len(expected) == 6
    assert all(r["step"] == r["update"] and r["perturbed_tokens_per_s"] > 0 for r in rows)
    assert not (run / "metrics.rank1.jsonl").exists()


def test_a_non_finite_loss_stops_the_run_before_checkpointing_it(tmp_path, corpus, monkeypatch):
    """The seed run's 4th update sees NaN losses: TrainingDivergedError names it, and the
    checkpoint written after update 2 is the newest (nothing of the diverged state is saved)."""
    from megatron_ext.soma import update

    calls = {"n": 0}
    real = update.batched_loss

    def nan_on_the_fourth_update(thetas, emb, tokens, layout):
        losses = real(thetas, emb, tokens, layout)
        if thetas.shape[0] > 1:  # a perturbed batch (validation scores one body)
            calls["n"] += 1
            if calls["n"] > 3 * TINY["soma"]["accumulation"]:
                losses = losses * float("nan")
        return losses

    monkeypatch.setattr(update, "batched_loss", nan_on_the_fourth_update)
    recipe = write_recipe(tmp_path, corpus, "nan")
    with pytest.raises(TrainingDivergedError, match=r"seed run, update 4: the SPSA loss diff"):
        train_here(recipe, "checkpoint.save_interval=2")
    from megatron_ext.soma.state import SEED_EXPERT, expert_path, load_file

    assert load_file(expert_path(tmp_path / "nan", SEED_EXPERT))["state"]["update"] == 2


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, corpus) -> Path:
    """A finished two-expert run (its recipe's path)."""
    recipe_path = write_recipe(tmp_path_factory.mktemp("soma"), corpus, "ev", expert_updates=2)
    train_here(recipe_path)
    return recipe_path


def test_routed_eval_matches_direct_mixture(trained_run):
    """summary.json's test loss == a mixture computed here from the saved router and experts,
    expert by expert with the single-probe forward."""
    recipe_path = trained_run
    from megatron_ext.soma.corpus import test_windows
    from megatron_ext.soma.data import window_texts
    from megatron_ext.soma.layout import BodyLayout
    from megatron_ext.soma.model import log_probs
    from megatron_ext.soma.state import SEED_EXPERT, expert_path, load_file
    from megatron_ext.soma.trainer import expert_shape

    recipe = load_recipe(recipe_path)
    s, run_dir = recipe.section(SomaConfig), Path(recipe.run_dir)
    windows, router = test_windows(recipe)
    layout = BodyLayout.from_shape(expert_shape(recipe))
    emb = load_file(expert_path(run_dir, SEED_EXPERT))["emb"]
    experts = bodies(run_dir, 2)[1:]
    nll = []
    for w in windows:
        routes = router.route(window_texts(w[None, : s.route_bytes]), 2)[0]
        tokens = torch.from_numpy(w.astype(np.int64))[None]
        n_in = s.route_bytes + s.score_bytes
        p = 0
        for e in routes:
            lp = log_probs(experts[e][None].double(), emb.double(), tokens[:, :n_in], layout)
            p = p + lp[0, 0].exp() / len(routes)
        tgt = tokens[0, 1 : n_in + 1]
        nll.append(-p[torch.arange(n_in), tgt].log()[s.route_bytes :])
    expected = float(torch.cat(nll).mean())
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["test_nats_per_byte"] == pytest.approx(expected, rel=1e-5)


def test_soma_eval_and_generate_on_a_trained_run(trained_run, capsys):
    """``megatron-ext soma eval`` prints the run's own test loss; ``soma generate`` writes the
    prompt and then exactly --bytes sampled bytes, the same for the same seed, other for
    another, and refuses --bytes 0."""
    from megatron_ext.launch.cli import main

    summary = json.loads((Path(load_recipe(trained_run).run_dir) / "summary.json").read_text())
    assert main(["soma", "eval", str(trained_run)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["k"] == 2
    assert printed["test_nats_per_byte"] == pytest.approx(summary["test_nats_per_byte"], rel=1e-6)

    def generate(seed: int) -> str:
        argv = ["soma", "generate", str(trained_run), "--prompt", "def f(x):", "--bytes", "40"]
        assert main([*argv, "--seed", str(seed)]) == 0
        captured = capsys.readouterr()
        assert captured.err.startswith("[experts ")
        return captured.out

    first, again, other = generate(0), generate(0), generate(1)
    assert first == again != other
    assert first.startswith("def f(x):") and first.endswith("\n")
    sampled = first[len("def f(x):") : -1].encode("utf-8", errors="surrogateescape")
    assert 0 < len(sampled) <= 40 * 3  # 40 bytes, invalid UTF-8 shown as U+FFFD (3 bytes)
    argv = ["soma", "generate", str(trained_run), "--prompt", "x", "--bytes", "0"]
    assert main(argv) == 2


@pytest.mark.parametrize(
    "override, message",
    [
        ("soma.eval_topk=3", "exceeds soma.num_experts=2"),
        ("soma.n_pert=0", "soma.n_pert"),
        ("soma.route_bytes=200", "exceeds the 256 targets"),
    ],
)
def test_bad_recipe_values_stop_before_training(tmp_path, corpus, override, message):
    recipe = write_recipe(tmp_path, corpus, "bad")
    with pytest.raises(ConfigError, match=message):
        load_recipe(recipe, [override], world_size=1)


def test_too_many_experts_for_the_corpus(tmp_path, corpus):
    recipe = write_recipe(tmp_path, corpus, "many", num_experts=400)
    with pytest.raises(ConfigError, match="400"):
        train_here(recipe)
    assert not list((tmp_path / "many").glob("soma/experts/*.pt"))


def test_eval_without_router_is_one_clear_error(tmp_path, corpus):
    recipe = write_recipe(tmp_path, corpus, "norouter")
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_ext.launch.cli", "soma", "eval", str(recipe)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().startswith("megatron-ext: error:"), proc.stderr
    assert "Traceback" not in proc.stderr
