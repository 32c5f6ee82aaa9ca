"""The launcher: torchrun commands for one node, flags and SLURM; GPU detection (rank detection:
test_rank_env.py; the real command line and its torch-free --dry-run: test_cli.py).

Command building is tested through ``build_launch_command`` with a made-up environment and host,
so no test depends on the machine it runs on or starts torchrun.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from megatron_ext.errors import ConfigError
from megatron_ext.launch.hosts import HostInfo, count_gpus, count_visible_devices, probe_host
from megatron_ext.launch.launcher import LaunchRequest, build_launch_command, parse_endpoint
from megatron_ext.run.hardware import DeviceDescription

PY = "/opt/python/bin/python3"  # any interpreter path: the launcher must use the one it is given
RANK_ENTRY = ["-m", "megatron_ext.launch.cli", "train"]
CPU_HOST = HostInfo(gpus=0, cpus=8)
GPU_HOST = HostInfo(gpus=8, cpus=96)


def write_recipe(tmp_path: Path, **sections: dict) -> str:
    """A valid small recipe (1 layer, global batch 64, micro batch 1), with ``sections`` merged;
    its dataset is built from ``data.source`` on first use (a dry run checks it is there)."""
    raw: dict = {
        "trainer": "gpt",
        "data": {"path": "/data/tokens", "source": ["python-stdlib"]},
        "model": {"num_layers": 1, "hidden_size": 64, "num_attention_heads": 4},
        "training": {"micro_batch_size": 1, "global_batch_size": 64},
        "launch": {"nproc_per_node_cpu": 2, "master_port": 29611},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def build(
    recipe: str,
    environ: dict[str, str] | None = None,
    host: HostInfo = CPU_HOST,
    overrides: tuple[str, ...] = (),
    **flags: object,
) -> tuple[list[str], dict[str, str]]:
    request = LaunchRequest(recipe=recipe, overrides=overrides, **flags)  # type: ignore[arg-type]
    return build_launch_command(request, environ or {}, host, python=PY)


def torchrun(*args: str) -> list[str]:
    return [PY, "-m", "torch.distributed.run", *args]


def slurm_env(**extra: str) -> dict[str, str]:
    """The variables `srun --ntasks-per-node=1` sets on the third of four nodes."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "gpu[007-010]",
        "SLURM_NODELIST": "gpu[007-010]",
        "SLURM_STEP_NUM_TASKS": "4",
        **extra,
    }


# --------------------------------------------------------------------------- one node


def test_single_node_is_standalone_with_the_recipes_cpu_rank_count(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    argv, env = build(recipe, overrides=("optimizer.lr=1e-3",))
    assert argv == [
        *torchrun("--standalone", "--nproc-per-node", "2"),
        *RANK_ENTRY,
        recipe,
        "optimizer.lr=1e-3",
    ]
    # 8 cores shared by 2 ranks; no CUDA-only variable on a CPU host
    assert env == {"OMP_NUM_THREADS": "4", "PYTHONUNBUFFERED": "1"}


def test_gpu_host_runs_one_rank_per_gpu(tmp_path: Path) -> None:
    recipe = write_recipe(
        tmp_path, parallel={"tensor_model_parallel_size": 2}, launch={"threads_per_rank": 3}
    )
    argv, env = build(recipe, host=GPU_HOST)
    assert argv[3:6] == ["--standalone", "--nproc-per-node", "8"]
    assert env["OMP_NUM_THREADS"] == "3"  # the recipe's choice beats the 96 // 8 default
    assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"  # tp > 1 on GPU


def test_data_parallel_gpu_run_leaves_cuda_connections_alone(tmp_path: Path) -> None:
    _, env = build(write_recipe(tmp_path), host=GPU_HOST)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env
    assert env["OMP_NUM_THREADS"] == "12"


def test_cpu_host_never_sets_cuda_variables(tmp_path: Path) -> None:
    _, env = build(write_recipe(tmp_path, parallel={"tensor_model_parallel_size": 2}))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env


def test_nproc_flag_beats_gpu_count(tmp_path: Path) -> None:
    argv, _ = build(write_recipe(tmp_path), host=GPU_HOST, nproc_per_node=4)
    assert argv[3:6] == ["--standalone", "--nproc-per-node", "4"]


def test_more_ranks_than_gpus_fails_unless_gloo(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="exceeds the 8 GPU"):
        build(write_recipe(tmp_path), host=GPU_HOST, nproc_per_node=16)
    gloo = write_recipe(tmp_path, parallel={"backend": "gloo"})
    assert build(gloo, host=GPU_HOST, nproc_per_node=16)[0][5] == "16"


def test_layout_that_does_not_fit_the_world_fails_before_launch(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path, training={"global_batch_size": 8})
    with pytest.raises(ConfigError, match=r"global_batch_size=8 .* 1\*6 = 6"):
        build(recipe, nnodes=2, node_rank=0, rdzv_endpoint="node01:29500", nproc_per_node=3)


def test_elastic_restarts_give_each_rendezvous_round_a_fresh_store(tmp_path: Path) -> None:
    """With launch.max_restarts the ranks of every round get a new store (torchrun's shared one
    keeps the previous round's keys: the restarted ranks' gloo connects to dead addresses;
    tests/test_multinode.py runs the restart); without, torchrun's default is left alone."""
    (tmp_path / "restarts").mkdir()
    restarts = write_recipe(tmp_path / "restarts", launch={"max_restarts": 2})
    plain = write_recipe(tmp_path)
    for flags in ({}, {"nnodes": 2, "node_rank": 0, "rdzv_endpoint": "node01:29400"}):
        argv, env = build(restarts, **flags)
        assert argv[argv.index("--max-restarts") + 1] == "2"
        assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" not in build(plain, **flags)[1]


# --------------------------------------------------------------------------- multi-node flags


def test_multi_node_from_flags(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    argv, _ = build(
        recipe, host=GPU_HOST, nnodes=2, node_rank=1, rdzv_endpoint="node01:29400", rdzv_id="exp7"
    )
    assert argv == [
        *torchrun(
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--nproc-per-node",
            "8",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            "node01:29400",
            "--rdzv-id",
            "exp7",
            "--rdzv-conf",
            "join_timeout=600,read_timeout=600",
        ),
        *RANK_ENTRY,
        recipe,
    ]


def test_multi_node_flags_default_rdzv_id_is_shared_by_all_nodes(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)
    for node_rank in (0, 1):
        argv, _ = build(
            recipe, host=GPU_HOST, nnodes=2, node_rank=node_rank, rdzv_endpoint="node01:29400"
        )
        assert argv[argv.index("--rdzv-id") + 1] == "megatron-ext"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            {"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "n1:1"},
            r"--node-rank 2 is not in \[0, 1\]",
        ),
        ({"nnodes": 2, "node_rank": -1, "rdzv_endpoint": "n1:1"}, "--node-rank -1"),
        ({"nnodes": 0}, "--nnodes 0"),
        ({"nproc_per_node": 0}, "--nproc-per-node 0"),
        ({"nnodes": 2, "node_rank": 0}, "--nnodes 2 needs --rdzv-endpoint"),
        ({"rdzv_id": "x"}, "--rdzv-id needs --rdzv-endpoint"),
        ({"nnodes": 2, "rdzv_endpoint": "node01"}, "'node01' is not HOST:PORT"),
        ({"nnodes": 2, "rdzv_endpoint": "node01:http"}, "is not HOST:PORT"),
        ({"nnodes": 2, "rdzv_endpoint": "node01:70000"}, "port in 1-65535"),
        ({"nnodes": 2, "rdzv_endpoint": ":29500"}, "is not HOST:PORT"),
        ({"nnodes": 2, "rdzv_endpoint": "fe80::1:29500"}, "is not HOST:PORT"),  # needs [brackets]
    ],
)
def test_bad_flags_are_config_errors(tmp_path: Path, flags: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        build(write_recipe(tmp_path), **flags)


@pytest.mark.parametrize(
    ("endpoint", "expected"),
    [
        ("node01:29500", ("node01", 29500)),
        ("10.0.0.1:1", ("10.0.0.1", 1)),
        ("gpu-7.cluster.local:65535", ("gpu-7.cluster.local", 65535)),
        ("[fe80::1]:29500", ("fe80::1", 29500)),
    ],
)
def test_parse_endpoint(endpoint: str, expected: tuple[str, int]) -> None:
    assert parse_endpoint(endpoint) == expected


# --------------------------------------------------------------------------- SLURM


def test_slurm_environment_gives_the_rendezvous(tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path)  # 4 nodes x 8 GPUs = 32 ranks: 64 = 1 x 32 x 2 fits
    argv, _ = build(recipe, slurm_env(), host=GPU_HOST)
    assert argv == [
        *torchrun(
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
        ),
        *RANK_ENTRY,
        recipe,
    ]


def test_slurm_step_variables_win_over_the_job_allocation(tmp_path: Path) -> None:
    # a 2-node step inside the 4-node job: node ids count within the step
    env = slurm_env(
        SLURM_STEP_NUM_NODES="2",
        SLURM_STEP_NODELIST="gpu[009-010]",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_NODEID="1",
    )
    argv, _ = build(write_recipe(tmp_path), env, host=GPU_HOST)
    assert argv[3:7] == ["--nnodes", "2", "--node-rank", "1"]
    assert "gpu009:29611" in argv


def test_flags_override_slurm_field_by_field(tmp_path: Path) -> None:
    argv, _ = build(
        write_recipe(tmp_path), slurm_env(), host=GPU_HOST, rdzv_endpoint="10.1.2.3:4000"
    )
    assert argv[3:7] == ["--nnodes", "4", "--node-rank", "2"]  # still from SLURM
    assert argv[argv.index("--rdzv-endpoint") + 1] == "10.1.2.3:4000"
    assert argv[argv.index("--rdzv-id") + 1] == "4242"


def test_single_node_slurm_job_is_standalone(tmp_path: Path) -> None:
    env = slurm_env(
        SLURM_JOB_NUM_NODES="1",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_JOB_NODELIST="gpu007",
        SLURM_NODELIST="gpu007",
        SLURM_STEP_NUM_TASKS="1",
    )
    argv, _ = build(write_recipe(tmp_path), env, host=GPU_HOST)
    assert argv[3:6] == ["--standalone", "--nproc-per-node", "8"]


def test_slurm_step_with_one_task_per_gpu_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one launcher per node"):
        build(write_recipe(tmp_path), slurm_env(SLURM_STEP_NUM_TASKS="32"), host=GPU_HOST)


# --------------------------------------------------------------------------- GPU detection


@pytest.mark.parametrize(
    ("value", "count"),
    [
        ("0,1,2,3", 4),
        ("3", 1),
        ("", 0),
        ("-1", 0),
        ("NoDevFiles", 0),
        ("0,1,-1,2", 2),
        ("GPU-8f1c2a3e-aaaa-bbbb-cccc-000000000000,MIG-1234", 2),
    ],
)
def test_count_visible_devices(value: str, count: int) -> None:
    assert count_visible_devices(value) == count


def test_count_gpus_from_dev_files_then_nvidia_smi(tmp_path: Path) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "nvidia-caps"):
        (dev / name).touch()
    no_smi = DeviceDescription()
    assert count_gpus({}, no_smi, dev) == 2
    assert count_gpus({"CUDA_VISIBLE_DEVICES": "5"}, no_smi, dev) == 1  # the variable wins

    empty = tmp_path / "empty"
    empty.mkdir()
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\necho 'WARNING: a driver note'\n"
        "echo '0, GPU-1, NVIDIA H100 80GB HBM3, 9.0'\necho '1, GPU-2, NVIDIA H100 80GB HBM3, 9.0'\n"
    )
    smi.chmod(0o755)
    host = probe_host({}, dev_dir=empty, nvidia_smi=str(smi))
    assert (host.gpus, host.gpu_name, host.device.gpus) == (2, "NVIDIA H100 80GB HBM3", 2)
    missing = probe_host({}, dev_dir=empty, nvidia_smi=str(tmp_path / "missing"))
    assert (missing.gpus, missing.gpu_name) == (0, "")


# --------------------------------------------------------------------------- before launch


def test_data_prefix_must_exist_unless_a_source_is_given(tmp_path: Path) -> None:
    from megatron_ext.config.load import read_recipe
    from megatron_ext.launch.preflight import check_data

    missing = read_recipe(
        write_recipe(tmp_path), ["data.path=" + str(tmp_path / "tok"), "data.source=[]"]
    )
    with pytest.raises(ConfigError, match=r"tok\.bin and .*tok\.idx not found, and no data.source"):
        check_data(missing)
    check_data(read_recipe(write_recipe(tmp_path), ["data.source=[corpus/]"]))  # built at start
    for suffix in (".bin", ".idx"):
        (tmp_path / f"tok{suffix}").write_bytes(b"")
    check_data(missing)


def test_run_dir_must_be_writable(tmp_path: Path) -> None:
    from megatron_ext.launch.preflight import check_run_dir

    check_run_dir(tmp_path / "new" / "run")  # created
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"run_dir=.*file/run' is not writable"):
        check_run_dir(tmp_path / "file" / "run")


def test_a_rendezvous_port_in_use_on_this_node_is_refused() -> None:
    import socket

    from megatron_ext.launch.preflight import check_port_free

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=rf"port 127.0.0.1:{port} is in use on this node"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again
    check_port_free("192.0.2.1", port)  # another machine's address (TEST-NET): not checked


def test_a_port_holding_only_time_wait_connections_is_free() -> None:
    """The previous job's store closed its connections first, leaving TIME_WAIT sockets on the
    port: torchrun's store binds with SO_REUSEADDR and succeeds, so the check must too (it
    refused such a port: issue 42). A plain bind is refused there, which is what this sets up."""
    import socket

    from megatron_ext.launch.preflight import check_port_free

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torchrun's store does
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = server.accept()
    accepted.close()  # the listening side closes first: its end goes to TIME_WAIT
    client.close()
    server.close()
    with socket.socket() as plain, pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    check_port_free("127.0.0.1", port)


def test_too_little_disk_for_a_checkpoint_is_a_warning(tmp_path: Path, monkeypatch, capsys) -> None:
    import shutil

    from megatron_ext.config.load import read_recipe
    from megatron_ext.launch import preflight

    recipe = read_recipe("gpt_1b", [f"run_dir={tmp_path}", "model.vocab_size=32000"])
    need = preflight.checkpoint_bytes(recipe)  # the planner's (tests/test_planner_*.py)
    assert 10e9 < need < 25e9  # ~1.2 B parameters x (fp32 weight, master, Adam/Muon state)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=need // 2))
    preflight.warn_if_disk_short(recipe)
    assert "megatron-ext: warning:" in capsys.readouterr().err
    monkeypatch.setattr(shutil, "disk_usage", lambda _: usage._replace(free=2 * need))
    preflight.warn_if_disk_short(recipe)
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------------- rank failures


def test_each_distinct_rank_error_is_reported_once_with_its_ranks(tmp_path: Path) -> None:
    from megatron_ext.launch.failures import failure_report
    from megatron_ext.run.rank_errors import record_error

    env = {"MEGATRON_EXT_ERRORS_DIR": str(tmp_path)}
    for rank in (0, 1, 2, 3, 5):
        record_error(rank, 2, "megatron-ext: error: data.path='x' is missing", env)
    record_error(4, 1, "RuntimeError: CUDA out of memory\n(more)", env)
    log = tmp_path / "launch.log"
    lines, code = failure_report(tmp_path, log, torchrun_code=1)
    assert lines == [
        "megatron-ext: error: data.path='x' is missing [ranks 0-3, 5]",
        "RuntimeError: CUDA out of memory [rank 4]",
        f"megatron-ext: the ranks' tracebacks and torchrun's report: {log}",
    ]
    assert code == 2  # rank 0's


def test_the_stop_line_is_printed_last_and_whole_by_the_launcher(tmp_path: Path, capfd) -> None:
    """Rank 0 records its stop line; another rank still writes (a partial line, then the rest)
    after it: the launcher prints the stop line once, as the last line, after the ranks."""
    import sys

    from megatron_ext.launch.supervise import run_ranks

    rank = (
        "import os, sys, time\n"
        "from megatron_ext.run.rank_errors import record_stop\n"
        "assert record_stop('megatron-ext: stopped at step 3 of 9 (SIGTERM). Resume with: x')\n"
        "sys.stdout.write('a late rank line without its end'); sys.stdout.flush()\n"
        "time.sleep(0.05); print(' ... and its end')\n"
    )
    code = run_ranks([sys.executable, "-c", rank], dict(os.environ), tmp_path, 0, ())
    out = capfd.readouterr().out
    assert code == 0
    assert out == (
        "a late rank line without its end ... and its end\n"
        "megatron-ext: stopped at step 3 of 9 (SIGTERM). Resume with: x\n"
    )
    assert not list((tmp_path / "logs").glob("errors-*"))  # the record was read and removed
    from megatron_ext.run.rank_errors import record_stop

    assert not record_stop("no launcher", {})  # then rank 0 prints it itself


def test_ranks_that_died_without_a_word_are_named_from_torchruns_report(tmp_path: Path) -> None:
    from megatron_ext.launch.failures import failure_report

    log = tmp_path / "launch.log"
    log.write_text(
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-01_09:26:57\n"
        "  host      : node1\n  rank      : 3 (local_rank: 1)\n  exitcode  : -9 (pid: 4414)\n"
    )
    lines, code = failure_report(tmp_path / "none", log, torchrun_code=1)
    assert lines[0] == "megatron-ext: error: rank 3 failed (killed by SIGKILL) [rank 3]"
    assert code == 128 + 9


def test_the_terminal_gets_the_ranks_stderr_without_tracebacks_and_reports() -> None:
    import io

    from megatron_ext.launch.failures import StderrTee

    stream = io.StringIO(
        "UserWarning: Apex is not installed\n"
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "x.py", line 1, in <module>\n'
        "[rank1]: ValueError: bad\n"
        "megatron-ext: warning: step_000008 is damaged: ...; trying the previous checkpoint\n"
        "megatron-ext: error: data.path='x' is missing\n"
        "E1201 09:26:57.506000 4508 torch/distributed/elastic/multiprocessing/api.py:882] failed\n"
        "============================================================\n"
        "megatron_ext.launch.cli FAILED\n"
        "============================================================\n"
        "step 3 done\n"
    )
    log, terminal = io.StringIO(), io.StringIO()
    StderrTee(stream, log, terminal).join()
    assert log.getvalue() == stream.getvalue()
    assert terminal.getvalue().splitlines() == [
        "UserWarning: Apex is not installed",
        "megatron-ext: warning: step_000008 is damaged: ...; trying the previous checkpoint",
        "step 3 done",
    ]


def test_stop_signals_reach_torchruns_children(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from megatron_ext.launch.supervise import children

    kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) for _ in "ab"]
    try:
        assert set(children(os.getpid())) >= {k.pid for k in kids}
    finally:
        for k in kids:
            k.kill()
            k.wait()


def test_the_sbatch_script_stops_the_run_before_the_time_limit_and_requeues(tmp_path) -> None:
    """docker/slurm_train.sbatch under stub srun/scancel/scontrol: SIGUSR1 to the batch script
    (what --signal=B:USR1@120 sends) reaches the job's tasks (scancel --signal=USR1), and once
    the step exits 0 the job is requeued."""
    import os
    import signal
    import subprocess
    import time

    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    stubs = {  # the "step" stops (exit 0) on SIGUSR1, as the ranks do
        "srun": f'echo "srun $*" >> {calls}; echo $$ > {tmp_path}/step.pid\n'
        "trap 'sleep 0.2; exit 0' USR1\nwhile true; do sleep 0.05; done",
        "scancel": f'echo "scancel $*" >> {calls}; kill -USR1 "$(cat {tmp_path}/step.pid)"',
        "scontrol": f'echo "scontrol $*" >> {calls}',
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_ID": "77",
        "SLURM_CPUS_ON_NODE": "8",
        "SLURM_SUBMIT_DIR": str(tmp_path),
    }
    script = Path(__file__).resolve().parents[1] / "docker" / "slurm_train.sbatch"
    proc = subprocess.Popen(["bash", str(script), "gpt_8b"], env=env)
    try:
        deadline = time.monotonic() + 120  # the stub's start on a loaded host; left at once
        while not (tmp_path / "step.pid").is_file() and time.monotonic() < deadline:
            time.sleep(0.02)
        proc.send_signal(signal.SIGUSR1)
        assert proc.wait(timeout=20) == 0
    finally:
        proc.kill()
    lines = calls.read_text().splitlines()
    assert lines[0].startswith("srun --ntasks-per-node=1") and lines[0].endswith("launch gpt_8b")
    assert lines[1:] == ["scancel --signal=USR1 77", "scontrol requeue 77"]
