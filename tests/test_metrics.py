"""The one metrics logger: every record is one JSON line, printed by the logger's own policy,
and the GPT trainer's step record and a SOMA validation check go through it alike.

(End to end: test_training.py reads the GPT trainer's metrics.jsonl, test_soma_trainer.py the
SOMA trainer's.)
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

from megatron_ext.run.metrics import MetricsLogger, read_jsonl


def logger(tmp_path: Path, **kw) -> MetricsLogger:
    args = {"echo": True, "write": True, "tensorboard": False, **kw}
    return MetricsLogger(tmp_path, **args)


def test_each_record_is_one_json_line_in_order(tmp_path) -> None:
    log = logger(tmp_path)
    records = [{"step": s, "loss": 1.0 / s, "expert": "seed"} for s in (1, 2, 3)]
    for r in records:
        log.record(r["step"], r)
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert lines == [json.dumps(r) for r in records]
    assert read_jsonl(tmp_path / "metrics.jsonl") == records == log.records


def test_the_logger_decides_which_lines_to_print(tmp_path, capsys) -> None:
    log = logger(tmp_path, log_interval=10, last_step=25, prefix="[x] ")
    for step in range(1, 26):
        log.record(step, {"step": step}, line=f"line {step}")
    log.info("done")
    log.close()
    assert capsys.readouterr().out.splitlines() == [
        "[x] line 10",
        "[x] line 20",
        "[x] line 25",
        "[x] done",
    ]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 25  # every record


def test_only_write_ranks_write_and_persist_false_echoes_only(tmp_path, capsys) -> None:
    quiet = logger(tmp_path / "a", echo=False, write=False)
    quiet.record(1, {"step": 1}, line="never")
    quiet.close()
    assert not (tmp_path / "a").exists() and capsys.readouterr().out == ""
    log = logger(tmp_path / "b", file="metrics.rank1.jsonl")
    log.record(1, {"step": 1, "who": "this rank"})
    log.record(1, {"step": 1, "who": "rank 0's"}, line="echoed", persist=False)
    log.close()
    assert read_jsonl(tmp_path / "b" / "metrics.rank1.jsonl") == [{"step": 1, "who": "this rank"}]
    assert capsys.readouterr().out == "echoed\n"


def test_tensorboard_gets_the_named_scalars_of_each_record(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = logger(tmp_path, tensorboard=True)
    log.record(3, {"step": 3, "val_loss": 2.5, "note": "x"}, scalars=("val_loss",), group="e1")
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["e1/val_loss"]
    (point,) = events.Scalars("e1/val_loss")
    assert (point.step, point.value) == (3, 2.5)


def test_plots_go_through_the_logger_on_write_ranks_only(tmp_path) -> None:
    series = {"seed": [(0, 3.0), (10, 2.0)], "expert 0": [(0, 2.5), (10, 1.5)]}
    out = logger(tmp_path).plot("soma/curves.png", series, xlabel="update", ylabel="loss")
    assert out == tmp_path / "soma" / "curves.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    silent = logger(tmp_path / "other", write=False)
    assert silent.plot("x.png", series, xlabel="", ylabel="") is None


def test_the_gpt_step_record_is_one_logger_record(tmp_path, capsys) -> None:
    """record_step: the documented fields in order, as the JSON line and the log line."""
    from megatron_ext.gpt.report import StepRecord, record_step
    from megatron_ext.gpt.step import StepResult
    from megatron_ext.schedules.batch import Stage
    from megatron_ext.schedules.plan import TrainingSchedule

    training = SimpleNamespace(global_batch_size=16, seq_length=128, steps=300)
    lr = SimpleNamespace(lr_at=lambda tokens: 1e-3 * (tokens // 2048 + 1))  # per step
    run = SimpleNamespace(
        recipe=SimpleNamespace(training=training),
        schedule=TrainingSchedule((Stage(0, 0, 16),), 300, 128, 16, lr),  # type: ignore[arg-type]
        env=SimpleNamespace(world_size=2),
        flops_per_token=1e9,
        start_step=0,
    )
    log = logger(tmp_path, log_interval=10, last_step=300)
    result = StepResult(loss=2.5, grad_norm=0.5, success=True, optimizer_s=0.125, lr=1e-2)
    rec = record_step(log, run, 10, result, step_time_s=0.5)
    log.close()
    assert isinstance(rec, StepRecord) and rec.lr == 1e-2 and rec.consumed_tokens == 20_480
    assert rec.tokens_per_s == 4096.0 and rec.tokens_per_s_per_rank == 2048.0
    (line,) = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert line == json.dumps(asdict(rec))
    assert list(json.loads(line)) == [
        "step", "consumed_tokens", "global_batch", "tokens_per_step", "lr", "loss", "grad_norm",
        "tokens_per_s",
        "tokens_per_s_per_rank", "tflops_per_rank", "elapsed_s", "eta_s", "step_time_s",
        "optimizer_s",
    ]  # fmt: skip
    assert rec.optimizer_s == 0.125
    printed = capsys.readouterr().out
    assert printed.startswith(
        "step  10/300 | tokens 20.48K | gbs 16 (2.05K tok) | lr 1.000e-02 | loss 2.5000"
    )
    assert "| tok/s 4.10K (2.05K/rank) | TFLOP/s/rank 2.0480 |" in printed


def test_a_mapping_figure_is_one_tensorboard_scalar_per_entry(tmp_path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = logger(tmp_path, tensorboard=True)
    per_layer = {"layer_1": 1.25, "layer_2": 2.0}
    log.record(4, {"step": 4, "moe_load_imbalance": per_layer}, scalars=("moe_load_imbalance",))
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 4, "moe_load_imbalance": per_layer}]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = sorted(events.Tags()["scalars"])
    assert tags == ["train/moe_load_imbalance/layer_1", "train/moe_load_imbalance/layer_2"]
    assert [p.value for p in events.Scalars("train/moe_load_imbalance/layer_2")] == [2.0]


def test_a_moe_step_record_carries_the_expert_load(tmp_path, capsys) -> None:
    """record_step with MoE figures: after the step's own fields in the JSON line, to
    TensorBoard, and their short part at the end of the log line."""
    from megatron_ext.gpt.report import record_step
    from megatron_ext.gpt.step import StepResult
    from megatron_ext.schedules.batch import Stage
    from megatron_ext.schedules.plan import TrainingSchedule

    training = SimpleNamespace(global_batch_size=16, seq_length=128, steps=10)
    lr = SimpleNamespace(lr_at=lambda tokens: 1e-3)
    run = SimpleNamespace(
        recipe=SimpleNamespace(training=training),
        schedule=TrainingSchedule((Stage(0, 0, 16),), 10, 128, 16, lr),  # type: ignore[arg-type]
        env=SimpleNamespace(world_size=1),
        flops_per_token=1e9,
        start_step=0,
    )
    moe = {
        "moe_expert_batch": 512.0,
        "moe_load_imbalance": {"layer_1": 1.5},
        "moe_load_imbalance_max": 1.5,
        "moe_load_balancing_loss": {"layer_1": 1.0123},
        "moe_load_balancing_loss_mean": 1.0123,
        "moe_z_loss": {"layer_1": 3.25},
        "moe_z_loss_mean": 3.25,
    }
    log = logger(tmp_path, tensorboard=True, last_step=10)
    result = StepResult(loss=2.5, grad_norm=0.5, success=True, optimizer_s=0.1, lr=1e-3, moe=moe)
    record_step(log, run, 10, result, step_time_s=0.5)
    log.close()
    (rec,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert list(rec)[-len(moe) :] == list(moe) and {k: rec[k] for k in moe} == moe
    assert capsys.readouterr().out.rstrip().endswith("| moe imb 1.50 aux 1.012 z 3.25")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/moe_expert_batch", "train/moe_load_imbalance/layer_1", "train/loss"} <= tags
