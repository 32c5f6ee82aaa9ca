"""The one prepared GPU check (issue 16): everything this project could not measure on a CPU host,
run on one GPU (sized for one H200, compute capability 9.0) in under 8 minutes, into one JSON.

Steps, most important first; each has its own time limit, the whole a deadline (``--budget``);
a step that fails or times out is recorded with its exit code and the tail of its output, and
the next one runs. ``gpu_check.json`` is rewritten after every step, so a killed check still
leaves what it measured.

1. ``environment``: the GPU as the launcher (nvidia-smi) and a rank (torch) see it, versions,
   the precisions each description accepts;
2. ``precision_ab``: ``bench precision`` on the tiny GPT recipe on Transformer Engine's spec with
   bf16, fp8_tensorwise, fp8_delayed (60 steps from one step-0 checkpoint); checks that each FP8
   run's first loss differs from bf16's (FP8 GEMMs ran) by less than 5%;
3. ``mxfp8_refused``: ``bench precision`` and ``launch --dry-run`` with mxfp8 exit 2 with the
   gate's one line (MXFP8 needs compute capability 10.x-11.x);
4. ``cuda_tests``: the tests that need CUDA (``scripts/gpu_check_pytest.py`` selects them);
5. ``plan_memory``: ``megatron-ext plan`` against the CUDA allocator: a ~0.3 B-parameter GPT
   (bf16, Transformer Engine) trained 4 steps on one GPU with AdamW and with Muon; the plan's
   peak (one-GPU cluster of this GPU) beside ``summary.json``'s ``peak_allocated_bytes``, ok
   when within 15%.

6. ``layerwise``: ``bench layerwise --device cuda`` (DP=1 on one GPU, bf16);
7. ``mcore_layerwise``: megatron-core's ``LayerWiseDistributedOptimizer`` beside ours
   (``scripts/gpu_mcore_layerwise.py``: ``bench layerwise --against megatron-core`` on a GPT,
   bf16, NCCL, megatron-core's padded layout);
8. ``soma``: ``bench soma --device cuda`` (the SPSA timing);
9. ``optimizers``: ``bench optimizers --device cuda`` with Emerging-Optimizers beside ours.

Usage: scripts/gpu_check.sh [OUT_DIR]  (or python scripts/gpu_check.py --out OUT_DIR)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable
CLI = [PY, "-m", "megatron_ext.launch.cli"]
AB_PRECISIONS = "bf16,fp8_tensorwise,fp8_delayed"
AB_OVERRIDES = [
    "model.transformer_impl=transformer_engine",
    "training.lr_warmup_steps=6",
    "training.lr_wsd_decay_steps=12",
]


def run(cmd: list[str], timeout: float, log: Path) -> dict[str, Any]:
    """Run ``cmd`` in the repository root; its output goes to ``log``; returns the exit code,
    seconds and the output's tail."""
    start = time.perf_counter()
    with open(log, "w") as out:
        try:
            code = subprocess.run(
                cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    lines = log.read_text(errors="replace").splitlines()
    tail = [ln for ln in lines if "Warning" not in ln and "warnings.warn" not in ln][-15:]
    return {"cmd": " ".join(cmd), "rc": code, "seconds": time.perf_counter() - start, "tail": tail}


def read_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def environment(out: Path, timeout: float) -> dict[str, Any]:
    from megatron_ext.run.hardware import (
        probe_device,
        probe_device_with_torch,
        supported_precisions,
    )

    versions = {}
    for dist in ("torch", "megatron-core", "transformer_engine", "emerging_optimizers"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    smi, rank = probe_device(), probe_device_with_torch(0)
    return {
        "launcher_sees": smi.describe(),
        "rank_sees": rank.describe(),
        "launcher_accepts": supported_precisions(smi),
        "rank_accepts": supported_precisions(rank),
        "versions": versions,
        "ok": supported_precisions(smi) == supported_precisions(rank),
    }


def precision_ab(out: Path, timeout: float) -> dict[str, Any]:
    folder = out / "precision"
    cmd = [*CLI, "bench", "precision", "tiny_cpu_gpt", *AB_OVERRIDES]
    cmd += ["--precisions", AB_PRECISIONS, "--steps", "60", "--last", "10", "--out", str(folder)]
    result = run(cmd, timeout, out / "precision_ab.log")
    report = read_json(folder / "precision.json")
    result["report"] = report and {k: v for k, v in report.items() if k != "curves"}
    checks = {}
    if report:
        curves = report["curves"]
        ref = curves["bf16"]["loss"][0]
        for p in AB_PRECISIONS.split(",")[1:]:
            first = curves[p]["loss"][0]
            checks[p] = {"first_loss": first, "bf16_first_loss": ref}
            checks[p]["fp8_changed_numerics"] = first != ref
            checks[p]["within_5pct"] = abs(first - ref) < 0.05 * ref
    result["checks"] = checks
    result["ok"] = result["rc"] == 0 and all(all(v for v in c.values()) for c in checks.values())
    return result


def mxfp8_refused(out: Path, timeout: float) -> dict[str, Any]:
    cmd = [*CLI, "bench", "precision", "tiny_cpu_gpt", *AB_OVERRIDES, "--steps", "60"]
    cmd += ["--precisions", "bf16,mxfp8", "--out", str(out / "mxfp8")]
    bench = run(cmd, timeout * 0.6, out / "mxfp8_bench.log")
    cmd = [*CLI, "launch", "tiny_cpu_gpt", *AB_OVERRIDES, "training.precision=mxfp8", "--dry-run"]
    launch = run(cmd, timeout * 0.4, out / "mxfp8_launch.log")
    refused = [ln for r in (bench, launch) for ln in r["tail"] if "precision=mxfp8 needs" in ln]
    return {
        "bench": bench,
        "launch": launch,
        "messages": refused,
        "ok": bench["rc"] == 2 and launch["rc"] == 2 and len(refused) == 2,
    }


def cuda_tests(out: Path, timeout: float) -> dict[str, Any]:
    files = sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "tests").glob("test_*.py")
        if "cuda" in p.read_text(encoding="utf-8", errors="replace").lower()
    )
    xml = out / "cuda_tests.xml"
    cmd = [PY, "-m", "pytest", "-q", "-rA", "-p", "scripts.gpu_check_pytest", f"--junitxml={xml}"]
    result = run([*cmd, *files], timeout, out / "cuda_tests.log")
    if xml.is_file():
        import xml.etree.ElementTree as ET

        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite[0]
        result["counts"] = {
            k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")
        }
        result["tests"] = {
            f"{c.get('classname')}::{c.get('name')}": (
                "failed" if c.find("failure") is not None or c.find("error") is not None
                else "skipped" if c.find("skipped") is not None else "passed"
            )
            for c in suite.iter("testcase")
        }  # fmt: skip
    result["ok"] = result["rc"] == 0
    return result


def layerwise(out: Path, timeout: float) -> dict[str, Any]:
    path = out / "layerwise.json"
    cmd = [*CLI, "bench", "layerwise", "--device", "cuda", "--dp", "1", "--precision", "bf16"]
    result = run([*cmd, "--steps", "5", "--json", str(path)], timeout, out / "layerwise.log")
    result["report"] = read_json(path)
    result["ok"] = result["rc"] == 0
    return result


def mcore_layerwise(out: Path, timeout: float) -> dict[str, Any]:
    path = out / "mcore_layerwise.json"
    cmd = [PY, "scripts/gpu_mcore_layerwise.py", "--out", str(path), "--budget", "10"]
    result = run(cmd, timeout, out / "mcore_layerwise.log")
    result["report"] = read_json(path)
    result["ok"] = result["rc"] == 0 and bool((result["report"] or {}).get("runs"))
    return result


def soma(out: Path, timeout: float) -> dict[str, Any]:
    path = out / "soma.json"
    cmd = [*CLI, "bench", "soma", "--device", "cuda", "--spsa-only", "--json", str(path)]
    result = run(cmd, timeout, out / "soma.log")
    result["report"] = read_json(path)
    result["ok"] = result["rc"] == 0
    return result


def optimizers(out: Path, timeout: float) -> dict[str, Any]:
    path = out / "optimizers.json"
    cmd = [*CLI, "bench", "optimizers", "--device", "cuda", "--interleave", "--steps", "5"]
    result = run([*cmd, "--json", str(path)], timeout, out / "optimizers.log")
    result["report"] = read_json(path)
    result["ok"] = result["rc"] == 0 and "emerging_muon" in (result["report"] or {}).get(
        "results", {}
    )
    return result


#: the plan check's model: tiny_cpu_gpt widened to ~0.3 B parameters, on TE, bf16
PLAN_OVERRIDES = [
    "model.num_layers=12",
    "model.hidden_size=1536",
    "model.num_attention_heads=12",
    "model.num_query_groups=4",
    "model.ffn_hidden_size=4096",
    "model.transformer_impl=auto",  # Transformer Engine on the GPU (the plan: fused attention)
    "training.precision=bf16",
    "training.steps=4",
    "training.lr_warmup_steps=1",
    "training.lr_wsd_decay_steps=2",
    "training.eval_interval=4",
    "training.micro_batch_size=4",
    "training.global_batch_size=8",
    "training.seq_length=1024",
    "checkpoint.save_at_end=false",
]


def plan_memory(out: Path, timeout: float) -> dict[str, Any]:
    from megatron_ext.launch.hosts import gpu_name
    from megatron_ext.planner.gpus import gpu_kind, gpu_spec
    from megatron_ext.planner.inputs import Cluster
    from megatron_ext.planner.plan import plan_recipe

    kind = gpu_kind(gpu_name())
    if kind is None:
        return {"ok": False, "error": f"GPU {gpu_name()!r} is not in the plan's catalog"}
    result: dict[str, Any] = {"gpu": kind, "runs": {}}
    for optimizer in ("adamw", "muon"):
        overrides = [*PLAN_OVERRIDES, f"optimizer.name={optimizer}"]
        overrides.append(f"run_dir={out / ('plan_' + optimizer)}")
        plan = plan_recipe("tiny_cpu_gpt", overrides, Cluster(gpu_spec(kind), 1, 1))
        cmd = [*CLI, "launch", "tiny_cpu_gpt", *overrides, "--nproc-per-node", "1"]
        run_result = run(cmd, timeout / 2, out / f"plan_{optimizer}.log")
        summary = read_json(out / f"plan_{optimizer}" / "summary.json") or {}
        measured = (summary.get("memory") or {}).get("peak_allocated_bytes")
        predicted = plan.worst.memory.peak
        ratio = predicted / measured if measured else None
        result["runs"][optimizer] = {
            "rc": run_result["rc"],
            "predicted": plan.worst.memory.as_dict(),
            "measured_peak_allocated": measured,
            "predicted_over_measured": ratio,
            "ok": run_result["rc"] == 0 and ratio is not None and abs(ratio - 1) <= 0.15,
        }
    result["ok"] = all(r["ok"] for r in result["runs"].values())
    return result


#: (name, function, its own time limit in seconds), in the order they run
STEPS: tuple[tuple[str, Callable[[Path, float], dict[str, Any]], float], ...] = (
    ("environment", environment, 60),
    ("precision_ab", precision_ab, 200),
    ("mxfp8_refused", mxfp8_refused, 60),
    ("cuda_tests", cuda_tests, 90),
    ("plan_memory", plan_memory, 100),
    ("layerwise", layerwise, 60),
    ("mcore_layerwise", mcore_layerwise, 90),
    ("soma", soma, 60),
    ("optimizers", optimizers, 90),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu_check"))
    parser.add_argument("--budget", type=float, default=450.0, help="seconds for all the steps")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from megatron_ext.atomic import write_json

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget
    report: dict[str, Any] = {"budget_s": args.budget, "steps": {}}
    for name, step, limit in STEPS:
        left = deadline - time.perf_counter()
        if left < 15:
            report["steps"][name] = {"ok": False, "skipped": "out of time"}
        else:
            print(f"[gpu_check] {name} (up to {min(limit, left):.0f} s)", flush=True)
            try:
                report["steps"][name] = step(out, min(limit, left))
            except Exception as exc:  # recorded; the next step still runs
                report["steps"][name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(f"[gpu_check] {name}: ok={report['steps'][name].get('ok')}", flush=True)
        report["ok"] = all(s.get("ok") for s in report["steps"].values())
        write_json(out / "gpu_check.json", report)
    print(f"wrote {out / 'gpu_check.json'} (all ok: {report['ok']})")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
