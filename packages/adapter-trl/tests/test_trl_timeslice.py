"""Three real TRL jobs time-slice one device through the embedded orchestrator, each exactly as it runs alone.

Two GRPOTrainer jobs (one with a slow host-side reward wrapped in ``rota_trl.off_turn``, one with a KL term,
so TRL keeps a reference model) and one SFTTrainer job, each its own process (trl_job.py), with the
one-line change ``trainer.add_callback(rota_trl.RotaCallback(trainer))``. Nothing is configured: the first
job starts this user's embedded orchestrator (in the test's runtime folder), which parks the holder at
every switch (no ``--capacity``). Checked: every job's losses, rewards and grad norms step for step and its
final weights equal its run alone; no two jobs hold the device at once; while the slow reward runs, another
job holds the turn (the timeline in the message shows it) and the slow job is parked and restored mid-step.
Each job's first step waits, in its turn, until every job has arrived and another waits for the device (the
job script's own callbacks, not rota's), so every job is parked and restored however the machine is loaded.
"""

from __future__ import annotations

import itertools
import pathlib

import pytest

from rota.testing import ScriptedProcess

pytestmark = pytest.mark.slow

JOB = str(pathlib.Path(__file__).with_name("trl_job.py"))
SLOW_S = 0.3
JOBS = {  # tenant -> (kind, seed, steps, reward seconds); SFT steps are short: more of them, so all overlap
    "grpo-slow": ("grpo", 1, 6, SLOW_S),
    "grpo-ref": ("grpo_ref", 2, 6, 0.0),
    "sft": ("sft", 3, 12, 0.0),
}


def timeline(runs: dict[str, dict], t0: float) -> str:
    """One line per turn and off-turn reward, in time order: what a person reads when the test fails."""
    rows = [(s, e, name, "turn") for name, r in runs.items() for kind, s, e in r["events"] if kind == "turn"]
    rows += [(s, e, name, "reward off the turn") for name, r in runs.items() for s, e in r["off_turn"]]
    return "\n".join(f"{s - t0:7.3f}-{e - t0:7.3f}  {name:10s} {what}" for s, e, name, what in sorted(rows))


def overlaps(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] < b[1] and b[0] < a[1]


def test_grpo_grpo_sft_time_slice_and_match_their_runs_alone(child_env, tmp_path) -> None:
    procs: dict[str, ScriptedProcess] = {}
    try:
        for name, (kind, seed, steps, slow) in JOBS.items():
            env = child_env | {"ROTA_TENANT": name, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1",
                               "ROTA_TEST_JOBS": str(len(JOBS))}  # the rota run's training starts together
            procs[name] = ScriptedProcess(JOB, [kind, str(seed), str(steps), str(slow), str(tmp_path)], env,
                                          timeout=240)
        alone, sliced = {}, {}
        for run, out in (("alone", alone), ("rota", sliced)):
            for p in procs.values():  # all at once: the rota runs overlap in time
                p.send(run)
            for name, p in procs.items():
                out[name] = p.read()
                assert "error" not in out[name], f"{name} ({run}): {out[name]['error']}"
    finally:
        for p in procs.values():
            p.stop()

    for name, (kind, _, steps, _) in JOBS.items():
        a, r = alone[name], sliced[name]
        assert len(a["loss"]) == steps, a
        for key in ("loss", "reward", "grad_norm", "weights"):
            assert r[key] == a[key], f"{name}: {key} time-sliced {r[key]} != alone {a[key]}"
        assert r["steps"] == steps and r["tenant"] == name
        assert r["tracked"] == (["Qwen3ForCausalLM"] * (2 if kind == "grpo_ref" else 1)), r["tracked"]
        # parked by the others' turns (no --capacity: every switch parks) and restored: the numbers above held
        assert r["parks"] >= 1 and r["restores"] >= 1, f"{name}: parks {r['parks']}, restores {r['restores']}"
    assert all(x is not None for x in alone["grpo-slow"]["reward"] + alone["grpo-ref"]["reward"])

    t0 = min(r["start"] for r in sliced.values())
    shown = timeline(sliced, t0)
    print(shown)  # pytest -s shows it; a failure shows it in its message
    turns = sorted((s, e, name) for name, r in sliced.items() for kind, s, e in r["events"] if kind == "turn")
    for (s1, e1, n1), (s2, e2, n2) in itertools.pairwise(turns):
        assert s2 >= e1, f"{n1} and {n2} held the device at once ({s1 - t0:.3f}-{e1 - t0:.3f} and " \
                         f"{s2 - t0:.3f}-{e2 - t0:.3f}):\n{shown}"

    slow, steps = sliced["grpo-slow"], JOBS["grpo-slow"][2]
    assert len(slow["off_turn"]) == steps and len(slow["reward_intervals"]) == steps, slow["off_turn"]
    own = [(s, e) for kind, s, e in slow["events"] if kind == "turn"]
    for interval in slow["off_turn"]:
        assert not any(overlaps(interval, t) for t in own), f"grpo-slow held its turn in its reward:\n{shown}"
    others = [(s, e) for s, e, name in turns if name != "grpo-slow"]
    handed = [i for i in slow["off_turn"] if any(overlaps(i, t) for t in others)]
    assert handed, f"no other job ran while grpo-slow's reward ran off the turn:\n{shown}"
    # a turn per step, and one more after each reward (taken again after it)
    assert len(own) >= steps + len(slow["off_turn"]), f"{len(own)} turns:\n{shown}"
