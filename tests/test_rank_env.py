"""Where a rank sits in the job (run/rank_env.py): torchrun, Open MPI, MPICH/Hydra and SLURM
variables, SLURM's compact lists, and the variables exported for ``env://``."""

from __future__ import annotations

import pytest

from megatron_ext.errors import ConfigError
from megatron_ext.run.rank_env import (
    RankEnv,
    detect_rank_env,
    expand_nodelist,
    expand_tasks_per_node,
    export_torch_env,
)

# --------------------------------------------------------------------------- SLURM lists


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node17", ["node17"]),
        ("gpu[001-004,007],cpu01", ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007", "cpu01"]),
        ("n[8-11]", ["n8", "n9", "n10", "n11"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("a[1-2]-b[3,5]", ["a1-b3", "a1-b5", "a2-b3", "a2-b5"]),
        ("x-[1],y.z,w[2-3]-ib", ["x-1", "y.z", "w2-ib", "w3-ib"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist", ["", "gpu[1-2", "gpu1-2]", "gpu[[1]]", "gpu[2-1]", "gpu[a-b]"])
def test_malformed_nodelist_is_a_config_error(nodelist: str) -> None:
    with pytest.raises(ConfigError, match="node list"):
        expand_nodelist(nodelist)


def test_expand_tasks_per_node() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("8") == [8]
    with pytest.raises(ConfigError, match="tasks-per-node"):
        expand_tasks_per_node("2(3)")


# --------------------------------------------------------------------------- rank detection


def test_torchrun_variables() -> None:
    env = detect_rank_env(
        {
            "RANK": "5",
            "WORLD_SIZE": "8",
            "LOCAL_RANK": "1",
            "LOCAL_WORLD_SIZE": "4",
            "MASTER_ADDR": "n1",
            "MASTER_PORT": "1234",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
        }
    )  # torchrun inside srun
    assert env == RankEnv(5, 8, 1, 4, "n1", 1234, "torchrun")


def test_open_mpi_variables_beat_slurm_ones_of_its_daemons() -> None:
    env = detect_rank_env(
        {
            "OMPI_COMM_WORLD_RANK": "6",
            "OMPI_COMM_WORLD_SIZE": "16",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "2",
            "SLURM_LOCALID": "0",
        }
    )
    assert env == RankEnv(6, 16, 2, 8, None, None, "mpi")


def test_mpich_hydra_variables() -> None:
    env = detect_rank_env(
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    )
    assert env == RankEnv(3, 4, 1, 2, None, None, "mpi")


def test_pmi_local_variables() -> None:
    env = detect_rank_env(
        {
            "PMI_RANK": "0",
            "PMI_SIZE": "2",
            "PMI_LOCAL_RANK": "0",
            "PMI_LOCAL_SIZE": "2",
            "MASTER_PORT": "29999",
        }
    )
    assert env == RankEnv(0, 2, 0, 2, None, 29999, "mpi")


def test_slurm_srun_variables() -> None:
    # srun -n 9 over 3 nodes places 4, 4, 1 tasks: this is the 2nd task on the 2nd node
    env = detect_rank_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_NTASKS": "9",
            "SLURM_LOCALID": "1",
            "SLURM_NODEID": "1",
            "SLURM_STEP_TASKS_PER_NODE": "4(x2),1",
            "SLURM_TASKS_PER_NODE": "8(x3)",
        }
    )
    assert env == RankEnv(5, 9, 1, 4, None, None, "slurm")


def test_no_launcher_is_a_single_process() -> None:
    assert detect_rank_env({"PATH": "/bin"}) == RankEnv(0, 1, 0, 1, None, None, "single")


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"PMI_RANK": "0", "PMI_SIZE": "2"}, "MPI_LOCALRANKID or PMI_LOCAL_RANK is not set"),
        (
            {"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"},
            "rank 2 of 2",
        ),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a non-negative integer"),
    ],
)
def test_broken_rank_environment_is_a_config_error(environ: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        detect_rank_env(environ)


def test_export_torch_env_master_address_sources() -> None:
    out: dict[str, str] = {}
    export_torch_env(RankEnv(1, 4, 1, 2, "n1", None, "mpi"), out, default_port=29611)
    assert out == {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "n1",
        "MASTER_PORT": "29611",
    }

    slurm = {"SLURM_NODELIST": "gpu[03-04]"}
    export_torch_env(RankEnv(3, 4, 1, 2, None, 1234, "slurm"), slurm)
    assert (slurm["MASTER_ADDR"], slurm["MASTER_PORT"]) == ("gpu03", "1234")

    one_host: dict[str, str] = {}
    export_torch_env(RankEnv(1, 2, 1, 2, None, None, "mpi"), one_host)
    assert one_host["MASTER_ADDR"] == "127.0.0.1"


def test_export_torch_env_refuses_to_guess_across_hosts() -> None:
    with pytest.raises(ConfigError, match="MASTER_ADDR is not set"):
        export_torch_env(RankEnv(1, 4, 1, 2, None, None, "mpi"), {})
