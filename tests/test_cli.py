"""The real ``megatron-ext`` command: ``launch --dry-run`` prints the torchrun command (one node,
simulated SLURM) without importing torch, and ``launch`` passes stop signals on to torchrun."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from tests.test_launcher import RANK_ENTRY, slurm_env, write_recipe

MEGATRON_EXT = Path(sys.executable).with_name("megatron-ext")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without launcher variables and without GPUs, plus ``extra``."""
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("SLURM_", "OMPI_", "PMI_", "MASTER_"))
    }
    return {**base, "CUDA_VISIBLE_DEVICES": "", **extra}


def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """``megatron-ext ARGS``; ``cwd``: where a dry run writes ``run_dir/schedule.png``."""
    return subprocess.run(
        [str(MEGATRON_EXT), *args],
        cwd=cwd,
        env=clean_env(**(env or {})),
        capture_output=True,
        text=True,
        timeout=60,
    )


def parse_dry_run(stdout: str) -> tuple[dict[str, str], list[str]]:
    *exports, command = stdout.strip().splitlines()
    env = dict(shlex.split(line)[1].split("=", 1) for line in exports)
    assert all(line.startswith("export ") for line in exports)
    return env, shlex.split(command)


def test_cli_dry_run_prints_the_command(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, launch={"threads_per_rank": 2})
    proc = run_cli("launch", recipe, "run_dir=my runs/x", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    env, argv = parse_dry_run(proc.stdout)
    assert env == {"OMP_NUM_THREADS": "2", "PYTHONUNBUFFERED": "1"}
    assert Path(argv[0]).name.startswith("python")
    assert argv[1:] == [
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        *RANK_ENTRY,
        recipe,
        "run_dir=my runs/x",
    ]  # quoted, so one argument


def test_cli_dry_run_under_simulated_slurm(tmp_path: Path) -> None:
    proc = run_cli(
        "launch",
        write_recipe(tmp_path),
        "--dry-run",
        env={**slurm_env(), "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"},
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    _, argv = parse_dry_run(proc.stdout)
    rdzv = argv[3 : argv.index("-m", 3)]
    assert rdzv == [
        "--nnodes",
        "4",
        "--node-rank",
        "2",
        "--nproc-per-node",
        "8",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "gpu007:29611",
        "--rdzv-id",
        "4242",
        "--rdzv-conf",
        "join_timeout=600,read_timeout=600",
    ]


def test_cli_dry_run_shows_the_expanded_moe_preset(tmp_path: Path) -> None:
    """An MoE preset recipe's dry run lists every field the preset sets, each marked as the
    preset's value or the recipe's (an override counts as the recipe's); stdout stays the
    command."""
    proc = run_cli(
        "launch",
        "moe_tiny_cpu",
        f"run_dir={tmp_path / 'run'}",
        "model.moe_z_loss_coeff=0.002",
        "--dry-run",
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    parse_dry_run(proc.stdout)
    lines = proc.stderr.splitlines()
    start = lines.index("model.moe_preset=olmoe expands to (megatron-core fields):")
    shown = lines[start + 1 : start + 13]
    assert shown == [
        "  model.num_moe_experts=8 (recipe; preset 64)",
        "  model.moe_router_topk=2 (recipe; preset 8)",
        "  model.activation='swiglu' (preset)",
        "  model.normalization='RMSNorm' (preset)",
        "  model.layernorm_epsilon=1e-05 (preset)",
        "  model.moe_router_score_function='softmax' (preset)",
        "  model.moe_router_pre_softmax=True (preset)",
        "  model.moe_router_load_balancing_type='aux_loss' (preset)",
        "  model.moe_z_loss_coeff=0.002 (recipe; preset 0.001)",
        "  model.qk_layernorm=True (preset)",
        "  model.qk_layernorm_scope='projection' (preset)",
        "  model.moe_aux_loss_coeff=0.01 (preset)",  # HF's 0.01 x k / L = 0.01 x 2 / 2
    ]
    dense = run_cli("launch", write_recipe(tmp_path), "--dry-run", cwd=tmp_path)
    assert dense.returncode == 0 and "moe_preset" not in dense.stderr


def test_launcher_and_dry_run_never_import_torch(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "import megatron_ext.launch.launcher, megatron_ext.run.rank_env\n"
        "from megatron_ext.launch.cli import main\n"
        f"assert main(['launch', {write_recipe(tmp_path)!r}, '--dry-run']) == 0\n"
        "assert main(['launch', 'soma_tiny', '--dry-run']) == 0\n"  # every trainer's rules
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "False"


def test_run_passes_signals_on_and_returns_the_exit_code() -> None:
    child = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
        "print('ready', os.getpgrp() == os.getpid(), flush=True)\n"
        "time.sleep(30)\n"
    )
    parent = (
        "import os, sys\n"
        "from megatron_ext.launch.supervise import run_forwarding_signals\n"
        f"sys.exit(run_forwarding_signals([sys.executable, '-c', {child!r}], os.environ))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        # the child leads its own process group, so a terminal's Ctrl-C reaches it only once
        assert proc.stdout is not None and proc.stdout.readline().split() == ["ready", "True"]
        proc.send_signal(signal.SIGTERM)  # to the launcher only: it must pass it on
        assert proc.wait(timeout=20) == 7
    finally:
        proc.kill()

    killed = (
        "import sys\nfrom megatron_ext.launch.supervise import run_forwarding_signals\n"
        "sys.exit(run_forwarding_signals([sys.executable, '-c', "
        "'import os; os.kill(os.getpid(), 9)'], {}))\n"
    )
    assert subprocess.run([sys.executable, "-c", killed], timeout=20).returncode == 128 + 9


def test_nothing_but_the_command_line_imports_the_launcher() -> None:
    """The launcher sits on top: no module of the package imports ``megatron_ext.launch``."""
    import ast

    root = Path(__file__).resolve().parents[1] / "megatron_ext"
    importers = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(
                n == "megatron_ext.launch" or n.startswith("megatron_ext.launch.") for n in names
            ):
                importers.append(str(path.relative_to(root)))
    assert importers == []


def test_launch_checks_this_node_before_any_rank_starts(tmp_path: Path) -> None:
    """A missing dataset (no data.source) and an unwritable run_dir stop the real launcher with
    one line and exit 2 before torchrun starts (so no rank repeats the message)."""
    recipe = write_recipe(tmp_path)  # data.path=/data/tokens, which does not exist
    proc = run_cli("launch", recipe, "data.source=[]", f"run_dir={tmp_path / 'run'}", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.splitlines() == [
        "megatron-ext: error: data.path='/data/tokens': /data/tokens.bin and /data/tokens.idx "
        "not found, and no data.source to build it from: build it (megatron-ext data build "
        "FILES --output /data/tokens) or set data.source"
    ]
    (tmp_path / "file").write_text("")
    proc = run_cli("launch", recipe, "data.source=[x]", f"run_dir={tmp_path / 'file' / 'r'}")
    assert proc.returncode == 2 and "is not writable" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1


def test_ranks_sharing_one_unbuffered_output_keep_their_lines_whole(tmp_path):
    """Two processes print into one file as torchrun's ranks do, under PYTHONUNBUFFERED (the
    launcher sets it): with ``whole_lines`` (what ``megatron-ext`` does first) every line stays
    whole. Without it print's text and newline are separate writes, and lines splice (seen
    in CI; this test without the call: hundreds of spliced lines here)."""
    import re

    code = (
        "import sys\n"
        "from megatron_ext.launch.cli import whole_lines\n"
        "whole_lines()\n"
        "for i in range(4000): print('rank', sys.argv[1], 'line', i)\n"
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(tmp_path / "out.txt", "w") as out:
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(r)], stdout=out, env=env)
            for r in (0, 1)
        ]
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    lines = (tmp_path / "out.txt").read_text().splitlines()
    bad = [x for x in lines if not re.fullmatch(r"rank [01] line \d+", x)]
    assert len(lines) == 8000 and not bad, bad[:3]


def test_raw_test_scripts_under_torchrun_keep_their_lines_whole():
    """torchrun starts its ranks with ``python -u``, so the tests' raw scripts (not
    ``megatron-ext``) get line buffering from ``tests/dist/site/sitecustomize.py``, which
    ``run_torchrun`` puts first on their PYTHONPATH: two ranks × 3,000 lines into one file, all
    whole. (Without it a test of two ranks' JSON lines failed in CI on a spliced line.)"""
    import json

    from tests.conftest import DIST, run_torchrun

    proc = run_torchrun(DIST / "print_lines.py", 2, "3000")
    rows = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    assert sorted((r["rank"], r["i"]) for r in rows) == [
        (r, i) for r in (0, 1) for i in range(3000)
    ]
