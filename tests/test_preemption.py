"""Cluster-grade runs end to end, through ``megatron-ext launch`` on 2 gloo ranks with real
signals: stop signals at random steps and during a save, ``training.exit_interval``, a damaged
newest checkpoint (``load: auto`` falls back loudly), a damaged named checkpoint (exit 2, one
line for both ranks), and a signalled SOMA run. Every resumed GPT run must continue bit for bit
as the uninterrupted one.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

MEGATRON_EXT = Path(sys.executable).parent / "megatron-ext"
# Steps are a few ms each here: the runs signalled at a step need room after it, or a signal
# delivered late on a loaded machine would meet the end of the run instead of a step.
STEPS, EVERY = 32, 4
TEXT = "\n\n".join(
    f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i % 7} times, "
    f"while megatron trains a tiny model on byte {i % 13}."
    for i in range(400)
)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("preempt")
    (root / "corpus.txt").write_text(TEXT, encoding="utf-8")
    raw = {
        "trainer": "gpt",
        "model": {
            "num_layers": 2,
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_query_groups": 1,
            "ffn_hidden_size": 64,
        },
        "optimizer": {"name": "adamw", "lr": 3e-3, "min_lr": 3e-4},
        "data": {"path": str(root / "data" / "corpus"), "source": [str(root / "corpus.txt")]},
        "training": {
            "steps": STEPS,
            "micro_batch_size": 2,
            "global_batch_size": 4,
            "seq_length": 32,
            "lr_warmup_steps": 1,
            "lr_decay_style": "cosine",
        },
        "logging": {"log_interval": 1, "tensorboard": False, "progress_bar": "off"},
        "checkpoint": {"save_interval": EVERY, "keep_last": 3},
        "launch": {"nproc_per_node_cpu": 2, "threads_per_rank": 1},
    }
    path = root / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


def launch(recipe: Path, run_dir: Path, *overrides: str, signal_when=None, sig=None):
    """``megatron-ext launch``; with ``signal_when(run_dir) -> bool``, send ``sig`` to the
    launcher as soon as it holds. Returns (exit code, stdout, stderr, what the signal saw)."""
    cmd = [str(MEGATRON_EXT), "launch", str(recipe), f"run_dir={run_dir}", *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = None
    try:
        while signal_when is not None and proc.poll() is None:
            seen = signal_when(run_dir)
            if seen:
                proc.send_signal(sig)
                break
            time.sleep(0.005)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, out, err, seen


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss of the complete lines of metrics.jsonl (read while the run writes it)."""
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().split("\n")[:-1] if path.is_file() else []
    rows = [json.loads(r) for r in lines]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def stop_line(out: str) -> str:
    """The stop line: the launcher prints it once, whole, as the last line of the output."""
    (line,) = [line for line in out.splitlines() if "megatron-ext: stopped at" in line]
    assert out.endswith(line + "\n") and line.startswith("megatron-ext: stopped at"), out[-2000:]
    return line


@pytest.fixture(scope="module")
def straight(recipe, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("straight")
    code, _, err, _ = launch(recipe, run_dir)
    assert code == 0, err[-3000:]
    assert sorted(losses(run_dir)) == list(range(1, STEPS + 1))
    return run_dir


def test_stop_signals_and_exit_interval_resume_bit_identical(recipe, straight, tmp_path):
    """exit_interval=3 -> exit_duration_in_mins -> a stop signal at a random step -> a stop
    signal during a save -> the rest: each part exits 0 with its checkpoint and the resume
    command, and the whole equals the uninterrupted run bit for bit."""
    seed = random.randrange(10**6)
    rng = random.Random(seed)
    run = tmp_path / "run"
    code, out, err, _ = launch(recipe, run, "training.exit_interval=3")
    assert code == 0, err[-3000:]
    assert stop_line(out) == (
        f"megatron-ext: stopped at step 3 of {STEPS} (training.exit_interval=3); checkpoint "
        f"{run}/checkpoints/step_000003. Resume with: megatron-ext launch {recipe} "
        f"run_dir={run} training.exit_interval=3"
    )

    # the time limit: a few milliseconds have passed after the first step of the resumed run
    code, out, err, _ = launch(recipe, run, "training.exit_duration_in_mins=0.0001")
    assert code == 0, err[-3000:]
    assert stop_line(out).startswith(
        f"megatron-ext: stopped at step 4 of {STEPS} (training.exit_duration_in_mins=0.0001 "
        f"reached); checkpoint {run}/checkpoints/step_000004."
    ), stop_line(out)

    at, sig = rng.randint(5, 9), rng.choice([signal.SIGUSR1, signal.SIGTERM])

    def reached(run_dir: Path) -> bool:
        return len(losses(run_dir)) >= at

    code, out, err, _ = launch(recipe, run, signal_when=reached, sig=sig)
    assert code == 0, (seed, err[-3000:])
    stopped = int(stop_line(out).split("stopped at step ")[1].split()[0])
    assert at <= stopped < STEPS and f"({sig.name})" in stop_line(out), (seed, stop_line(out))
    assert (run / "checkpoints" / f"step_{stopped:06d}" / "manifest.json").is_file()

    def saving(run_dir: Path) -> str | None:
        """A save in progress, not the last one (a signal then would meet the end of the run)."""
        tmp = [p.name for p in (run_dir / "checkpoints").glob(".step_*.tmp")]
        tmp = [name for name in tmp if int(name.split("_")[1].split(".")[0]) < STEPS]
        return tmp[0] if tmp else None

    code, out, err, seen = launch(recipe, run, signal_when=saving, sig=signal.SIGUSR1)
    assert code == 0 and seen, (seed, err[-3000:])
    save_step = int(seen.split("_")[1].split(".")[0])
    stopped = int(stop_line(out).split("stopped at step ")[1].split()[0])
    # Sent while the test saw the save's folder: normally caught during the save, so the run
    # stops right after it; when the test saw the folder only at the save's very end, the
    # signal may reach the ranks just after their stop check and they stop one step later.
    assert stopped in (save_step, save_step + 1), (seen, stop_line(out))
    assert (run / "checkpoints" / f"step_{stopped:06d}" / "manifest.json").is_file()

    code, out, err, _ = launch(recipe, run)
    assert code == 0, err[-3000:]
    assert losses(run) == losses(straight), seed


def test_damaged_newest_checkpoint_falls_back_loudly_and_resumes_exactly(
    recipe, straight, tmp_path
):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    (run / "metrics.jsonl").unlink()
    shard = run / "checkpoints" / f"step_{STEPS:06d}" / "__1_0.distcp"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(100)
    code, _, err, _ = launch(recipe, run)
    assert code == 0, err[-3000:]
    assert (
        f"megatron-ext: warning: {shard.parent} is damaged: __1_0.distcp: 100 bytes, the manifest "
        f"says {size} (truncated); trying the previous checkpoint"
    ) in err
    previous = STEPS - EVERY
    assert losses(run) == {s: v for s, v in losses(straight).items() if s > previous}


def test_a_damaged_named_checkpoint_stops_with_one_line_and_exit_2(recipe, straight, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    named = run / "checkpoints" / f"step_{STEPS - EVERY:06d}"
    data = bytearray((named / "__0_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (named / "__0_0.distcp").write_bytes(bytes(data))
    code, _, err, _ = launch(recipe, run, f"checkpoint.load={named}")
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("megatron-ext: error:")]
    assert len(errors) == 1, err[-3000:]
    assert errors[0].startswith(f"megatron-ext: error: checkpoint.load={named}: {named} is damaged")
    assert "__0_0.distcp: checksum" in errors[0] and errors[0].endswith("[ranks 0-1]")
    assert "Traceback" not in err
    log = Path(err.split("the ranks' tracebacks and torchrun's report: ")[1].split()[0])
    assert log.parent == run / "logs" and "ChildFailedError" in log.read_text()


def test_a_signalled_soma_run_saves_its_experts_and_exits_cleanly(tmp_path):
    from tests.test_soma_trainer import TINY, write_stdlib_corpus

    # real documents: SOMA's test set is held-out documents, each long enough for a window
    corpus = write_stdlib_corpus(tmp_path / "docs.txt")
    raw = json.loads(json.dumps(TINY))
    raw["soma"].update(expert_updates=100_000, eval_interval=1)
    raw |= {"run_dir": str(tmp_path / "soma"), "data": {"source": [str(corpus)]}}
    raw["launch"] = {"nproc_per_node_cpu": 2, "threads_per_rank": 1}
    path = tmp_path / "soma.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")

    def experts_training(run_dir: Path) -> bool:
        m = run_dir / "metrics.jsonl"
        return m.is_file() and any('"expert": 0' in r for r in m.read_text().splitlines())

    code, out, err, _ = launch(
        path, tmp_path / "soma", signal_when=experts_training, sig=signal.SIGTERM
    )
    assert code == 0, err[-3000:]
    line = stop_line(out)
    assert "stopped at expert update" in line and "(SIGTERM)" in line, line
    from megatron_ext.soma.state import expert_path, load_file

    for expert in (0, 1):  # FSO: each rank saved its own expert where it stopped
        update = load_file(expert_path(tmp_path / "soma", expert))["state"]["update"]
        assert 1 <= update < 100_000, (expert, update)


def test_stop_policy_reasons_with_real_signals_to_this_process():
    import os
    import signal as sig

    from megatron_ext.run.stopping import StopPolicy

    previous = sig.getsignal(sig.SIGUSR1)
    stop = StopPolicy(["SIGUSR1"], exit_interval=3)
    assert stop.requested(1) is None and stop.requested(6) == "training.exit_interval=3"
    os.kill(os.getpid(), sig.SIGUSR1)  # caught: the process keeps running
    assert stop.requested(1) == "SIGUSR1" and stop.check(1, collective=False) == "SIGUSR1"
    stop.uninstall()
    assert sig.getsignal(sig.SIGUSR1) is previous
    late = StopPolicy([], exit_duration_in_mins=0.5, start=time.monotonic() - 31)
    assert late.requested(1) == "training.exit_duration_in_mins=0.5 reached"
    assert StopPolicy([], exit_duration_in_mins=0.5).requested(1) is None


def test_every_rank_stops_when_one_rank_is_signalled():
    from tests.conftest import DIST, run_torchrun

    proc = run_torchrun(DIST / "stop_agreement.py", 2)
    rows = sorted(
        (json.loads(r) for r in proc.stdout.splitlines() if r.startswith("{")),
        key=lambda r: r["rank"],
    )
    assert [r["before"] for r in rows] == [None, None]
    assert [r["local"] for r in rows] == [None, "SIGUSR1"]
    assert [r["agreed"] for r in rows] == ["SIGUSR1", "SIGUSR1"]


def test_a_bad_stop_signal_is_a_recipe_error():
    from megatron_ext.config.load import read_recipe
    from megatron_ext.errors import ConfigError

    with pytest.raises(ConfigError, match=r"training.exit_signals: 'SIGKILL' is not a stop signal"):
        read_recipe("tiny_cpu_gpt", ["training.exit_signals=[SIGKILL]"]).check(2)
