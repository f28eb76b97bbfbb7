"""Group per GPU set: the SPANK plugin's own C code (user_init + task_init) run on given
step environments through tests/spank_harness.c, without Slurm daemons; and the Python
side (pattern checks, the epilog's matching) agreeing with what the C code produces."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest

from rota.errors import InvalidArgument
from rota_slurm._groups import check_pattern, expand_node, pattern_regex
from rota_slurm._spank import source_path

HARNESS = Path(__file__).with_name("spank_harness.c")
BATCH = 0xFFFFFFFB  # SLURM_BATCH_SCRIPT


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    if not Path("/usr/include/slurm/spank.h").exists() or not shutil.which("gcc"):
        pytest.skip("needs gcc and slurm/spank.h (Debian libslurm-dev)")
    so = tmp_path_factory.mktemp("harness") / "harness.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-Wall", "-Werror", f"-I{source_path().parent}", "-o",
                    str(so), str(HARNESS)], check=True, capture_output=True, text=True, timeout=120)
    return ctypes.CDLL(str(so))


def run(lib: ctypes.CDLL, group: str, step_env: dict[str, str], task_env: dict[str, str] | None = None, *,
        step: int = 0, nnodes: int = 1, rank: int = 0, world: int = 1) -> dict[str, str | None]:
    """The env the plugin sets for one task ({name: None} for an unset); RuntimeError with its message if it fails."""
    def text(env: dict[str, str]) -> bytes:
        return "".join(f"{k}={v}\n" for k, v in env.items()).encode()

    out = ctypes.create_string_buffer(8192)
    rc = lib.rota_harness_run(group.encode(), text(step_env), text(step_env if task_env is None else task_env),
                              ctypes.c_uint32(step), ctypes.c_uint32(nnodes), ctypes.c_uint32(rank),
                              ctypes.c_uint32(world), out, len(out))
    if rc != 0:
        raise RuntimeError(out.value.decode())
    env: dict[str, str | None] = {}
    for line in out.value.decode().splitlines():
        if line.startswith("-"):
            env[line[1:]] = None
        else:
            key, _, value = line.partition("=")
            env[key] = value
    return env


def group_of(lib: ctypes.CDLL, group: str, **gpus: str) -> str:
    env = run(lib, group, {"SLURMD_NODENAME": "n1", **gpus})
    return str(env["ROTA_GROUP"])


@pytest.mark.parametrize(("gpus", "expected"), [
    ({"SLURM_STEP_GPUS": "0"}, "n1-gpu0"),
    ({"SLURM_STEP_GPUS": "3"}, "n1-gpu3"),
    ({"SLURM_STEP_GPUS": "0,1"}, "n1-gpu0_1"),
    ({"SLURM_STEP_GPUS": "1,0"}, "n1-gpu0_1"),  # Slurm's order does not matter
    ({"SLURM_STEP_GPUS": "2,0,2"}, "n1-gpu0_2"),
    ({"SLURM_STEP_GPUS": "0-3"}, "n1-gpu0_1_2_3"),
    ({"SLURM_STEP_GPUS": "10,9"}, "n1-gpu9_10"),  # numeric, not string, order
    ({"SLURM_JOB_GPUS": "1"}, "n1-gpu1"),  # the batch script: only the job's list
    ({"SLURM_STEP_GPUS": "2", "SLURM_JOB_GPUS": "0,1,2,3"}, "n1-gpu2"),  # a step on part of the job's GPUs
])
def test_group_is_named_after_the_sorted_gpu_set(harness: ctypes.CDLL, gpus: dict[str, str], expected: str) -> None:
    assert group_of(harness, "%n-%g", **gpus) == expected


def test_same_gpus_share_a_group_other_sets_do_not(harness: ctypes.CDLL) -> None:
    pair_a = group_of(harness, "ts-%n-%g", SLURM_STEP_GPUS="0,1")
    pair_b = group_of(harness, "ts-%n-%g", SLURM_JOB_GPUS="1,0")
    single = group_of(harness, "ts-%n-%g", SLURM_STEP_GPUS="0")
    other = group_of(harness, "ts-%n-%g", SLURM_STEP_GPUS="1,2")
    assert pair_a == pair_b == "ts-n1-gpu0_1"
    assert len({pair_a, single, other}) == 3


def test_groups_without_placeholders_are_unchanged(harness: ctypes.CDLL) -> None:
    assert group_of(harness, "g0") == "g0"  # no GPU list needed
    assert group_of(harness, "g0", SLURM_STEP_GPUS="0,1") == "g0"
    assert group_of(harness, "gpu-%n") == "gpu-n1"


def test_every_task_of_a_step_gets_the_steps_group_and_its_rank(harness: ctypes.CDLL) -> None:
    """--gpus-per-task binds each task to one GPU; the group stays the step's GPU set."""
    step_env = {"SLURMD_NODENAME": "n1", "SLURM_STEP_GPUS": "0,1"}
    tasks = [run(harness, "%n-%g", step_env, {**step_env, "SLURM_STEP_GPUS": str(r), "CUDA_VISIBLE_DEVICES": str(r)},
                 rank=r, world=2) for r in (0, 1)]
    assert [t["ROTA_GROUP"] for t in tasks] == ["n1-gpu0_1", "n1-gpu0_1"]
    assert [(t["ROTA_RANK"], t["ROTA_WORLD_SIZE"]) for t in tasks] == [("0", "2"), ("1", "2")]
    assert {t["ROTA_TENANT"] for t in tasks} == {"42"}  # the job id, on every rank


def test_one_task_steps_leave_ranks_to_the_process(harness: ctypes.CDLL) -> None:
    """A batch script or `srun -n1` may start torchrun: no ROTA_RANK/ROTA_WORLD_SIZE (and none inherited)."""
    env = {"SLURMD_NODENAME": "n1", "SLURM_JOB_GPUS": "0,1"}
    for kw in ({"world": 1}, {"step": BATCH, "world": 4, "rank": 0}):  # a batch step of an `sbatch -n4` job
        got = run(harness, "%n-%g", env, **kw)
        assert got["ROTA_RANK"] is None and got["ROTA_WORLD_SIZE"] is None, kw


@pytest.mark.parametrize(("group", "env", "kw", "words"), [
    ("%n-%g", {}, {}, "uses %g, but the step has no GPUs on node 'n1' (SLURM_STEP_GPUS and SLURM_JOB_GPUS are unset)"),
    ("%n-%g", {"SLURM_STEP_GPUS": "NoDevFiles"}, {}, "SLURM_STEP_GPUS=NoDevFiles is not a list of GPU indices"),
    ("%n-%g", {"SLURM_STEP_GPUS": "0,x"}, {}, "SLURM_STEP_GPUS=0,x is not a list"),
    ("%n-%g", {"SLURM_STEP_GPUS": "0"}, {"nnodes": 2, "world": 2}, "this step runs on 2 nodes"),
    ("g-%n", {}, {"nnodes": 3, "world": 3}, "give a group without %n/%g (e.g. --timeslice=g0)"),
])
def test_placeholders_that_cannot_name_one_group_fail_the_task(harness: ctypes.CDLL, group: str,
                                                               env: dict[str, str], kw: dict[str, int],
                                                               words: str) -> None:
    with pytest.raises(RuntimeError) as err:
        run(harness, group, {"SLURMD_NODENAME": "n1", **env}, **kw)
    assert words in str(err.value)
    assert str(err.value).startswith(f"rota: --timeslice={group} ")


def test_multi_node_steps_with_a_fixed_group_and_the_batch_script_still_run(harness: ctypes.CDLL) -> None:
    env = {"SLURMD_NODENAME": "n1", "SLURM_JOB_GPUS": "0"}
    assert run(harness, "g0", env, nnodes=2, rank=3, world=4)["ROTA_RANK"] == "3"
    assert run(harness, "%n-%g", env, step=BATCH, nnodes=2, world=2)["ROTA_GROUP"] == "n1-gpu0"


def test_option_accepts_g_and_still_refuses_other_percent(harness: ctypes.CDLL) -> None:
    with pytest.raises(RuntimeError, match=r"may only contain .*%g for the job's GPUs"):
        run(harness, "x-%x", {})


def test_python_patterns_match_what_the_plugin_names(harness: ctypes.CDLL) -> None:
    rx = pattern_regex(expand_node("ep-%n-%g", "n1"))
    for gpus in ("0", "1,0", "0-3", "7,12"):
        assert rx.match(group_of(harness, "ep-%n-%g", SLURM_STEP_GPUS=gpus))
    for other in ("ep-n2-gpu0", "ep-n1-gpu", "ep-n1-gpu0-x", "ep-n1-gpu0+1", "xep-n1-gpu0", "ep-n10-gpu0"):
        assert not rx.match(other), other
    assert pattern_regex("g.1-%g").match("g.1-gpu0") and not pattern_regex("g.1-%g").match("gx1-gpu0")


def test_check_pattern() -> None:
    for ok in ("g0", "%n-%g", "gpu-%n", "%g"):
        assert check_pattern(ok) == ok
    for bad in ("bad group", "x-%x", "-%g", "", "%n/" + "x"):
        with pytest.raises(InvalidArgument, match=r"malformed|empty"):
            check_pattern(bad)
