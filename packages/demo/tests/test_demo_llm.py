"""``rota demo --engine hf`` end to end on the CPU: three LLM jobs (two GRPO, one SFT) with tiny Qwen3-architecture
checkpoints built in the run, the transformers stand-in engine, a real orchestrator parking every switch
(``--capacity 0``). Rewards must rise, every curve must be the same in every mode, and every trainer must have
been parked at least once."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the demo needs torch (installed by ./dev setup)")
pytest.importorskip("transformers", reason="--engine hf needs transformers (pip install 'rota-demo[llm]')")
pytest.importorskip("tokenizers", reason="--engine hf needs tokenizers (pip install 'rota-demo[llm]')")

STEPS = 16


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.slow
def test_demo_hf_engine_learns_and_is_identical_in_every_mode(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--engine", "hf", "--steps", str(STEPS),
                        "--off-device", "0.02", "--capacity", "0", "--cache-dir", str(tmp_path / "ckpt"),
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    seconds = time.monotonic() - t0
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    assert "transformers stand-in, not an inference engine" in r.stderr
    summary = json.loads((tmp_path / "demo.json").read_text())
    curves = summary["curves"]
    assert set(curves) == {"dedicated", "serial", "timesliced"}
    for name, values in curves["dedicated"].items():  # bit for bit, step for step
        assert curves["serial"][name] == values and curves["timesliced"][name] == values, name
    for job in ("rl-a", "rl-b"):  # mean reward per step: the last quarter above the first
        rewards = curves["timesliced"][f"{job}/sampler"]
        assert len(rewards) == STEPS and _mean(rewards[-4:]) > _mean(rewards[:4]) + 0.1, (job, rewards)
    accuracy = curves["timesliced"]["sft/sampler"]
    assert len(accuracy) == STEPS // 4 and accuracy[-1] > accuracy[0], accuracy
    assert all(t["bit_identical"] is True for t in summary["tenants"])
    ts = summary["timesliced"]
    assert ts["failed_parks"] == 0 and ts["failed_restores"] == 0, ts["failures"][:2]
    assert all(ts["parks_by_worker"][f"{job}/trainer"] >= 1 for job in ("rl-a", "rl-b", "sft")), ts["parks_by_worker"]
    assert summary["config"]["engine"] == "hf" and summary["curve_meaning"]["rl sampler"].startswith("mean reward")
    pre = summary["config"]["models"]["rl-b"]["pretraining"]  # tiny: every step (no pretrain_reward), recorded
    assert pre["steps"] == 40 and 0 < pre["expected_reward_first"] < pre["expected_reward_last"] < 1, pre
    assert (tmp_path / "demo-timeline.png").stat().st_size > 10_000
    # a second run finds the checkpoints (named by their config) and does not build them again
    assert "(built)" in r.stderr and "(cached)" not in r.stderr
    print(f"rota demo --engine hf: {seconds:.1f} s")


FAKE_VLLM = Path(__file__).parent / "fake_vllm"  # a fake of vllm.LLM (see its module docs), not vLLM


@pytest.mark.slow
def test_demo_vllm_mode_on_the_cpu_fake_parks_engines_through_rota_vllm_and_learns_identically(tmp_path):
    """The demo's vLLM path on CPU: its engine class, the bf16 push through rota_vllm's update_weights, engines
    parked and restored by rota_vllm (rota's pool, level-2 sleep, weights written back in place) at capacity 0,
    against a fake of vllm.LLM that loses whatever a sleep did not keep (NaN weights fail the next rollout).

    One group, so that every worker's turns interleave with another's and each must park: with the samplers on a
    device of their own (two groups), the SFT engine's two evaluations could come back to back once the RL
    samplers had finished (the priority policy holds it back while they run), with nothing between them to park
    it for."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_VLLM), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--engine", "vllm", "--steps", "8", "--groups", "1",
                        "--off-device", "0.02", "--capacity", "0", "--cache-dir", str(tmp_path / "ckpt"),
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                       env=env)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((tmp_path / "demo.json").read_text())
    ts, curves = summary["timesliced"], summary["curves"]
    assert summary["config"]["engine"] == "vllm" and "rota_vllm" in ts["adapters"], ts["adapters"]
    assert ts["failed_parks"] == 0 and ts["failed_restores"] == 0, ts["failures"][:2]
    assert all(n >= 1 for n in ts["parks_by_worker"].values()) and len(ts["parks_by_worker"]) == 6, \
        ts["parks_by_worker"]  # engines too: each parked by rota_vllm and restored before its next rollout
    for name, values in curves["dedicated"].items():  # bit for bit, step for step
        assert curves["serial"][name] == values and curves["timesliced"][name] == values, name
    assert len(curves["timesliced"]["rl-a/sampler"]) == 8 and all(t["bit_identical"] for t in summary["tenants"])


def test_a_worker_that_raises_stops_the_run_naming_itself_and_its_error(tmp_path):
    """Each engine's first generate raises (the fake's FAKE_VLLM_FAIL_GENERATE): the run stops with rl-a's sampler
    named and its error, not its trainer (which dies after it, its pipe closed), exits 1 and writes nothing. On an
    H100 the demo once named a worker that had died of another's CUDA out-of-memory error."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_VLLM), os.environ.get("PYTHONPATH", "")]),
           "FAKE_VLLM_FAIL_GENERATE": "1"}
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--engine", "vllm", "--steps", "1", "--groups", "1",
                        "--capacity", "0", "--cache-dir", str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 1, r.stderr[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("Error: ")]
    assert errors and errors[-1].startswith("Error: demo worker rl-a/sampler failed: RuntimeError: fake vllm: CUDA "
                                            "out of memory"), r.stderr[-3000:]
    assert "nothing written" in errors[-1] and not (tmp_path / "out" / "demo.json").exists()


def test_demo_vllm_engine_is_refused_on_cpu_with_the_reason():
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--engine", "vllm"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "needs a CUDA device" in r.stderr and "--engine hf" in r.stderr, r.stderr


def test_starting_checkpoints_are_cached_by_their_config_and_load_with_from_pretrained(tmp_path):
    import dataclasses

    from transformers import AutoTokenizer, Qwen3ForCausalLM

    from rota_demo import llm_tasks as t
    from rota_demo.llm_models import LlmSize, build_checkpoint

    size = LlmSize("rev", pretrain_steps=2)
    path, built = build_checkpoint(size, 0, "cpu", str(tmp_path))
    assert built and build_checkpoint(size, 0, "cpu", str(tmp_path)) == (path, False)  # found, not rebuilt
    # what does not change the checkpoint's bytes (the RL learning rate, loop sizes) does not change its name
    assert build_checkpoint(dataclasses.replace(size, lr=1.0, group=2), 0, "cpu", str(tmp_path)) == (path, False)
    assert size.key(1) != size.key(0) and dataclasses.replace(size, pretrain_steps=3).key(0) != size.key(0)
    model = Qwen3ForCausalLM.from_pretrained(path)
    assert model.config.model_type == "qwen3" and sum(p.numel() for p in model.parameters()) == size.params
    tok = AutoTokenizer.from_pretrained(path)
    assert tok("cab:", add_special_tokens=False)["input_ids"] == t.encode("cab:") and tok.eos_token_id == t.EOS


def test_the_h200_shapes_fit_one_h200_alone_but_not_all_at_once_and_not_an_80_gb_card():
    from rota_demo.llm_models import PRESETS
    from rota_demo.memory import capacity_margin

    def room(total: int) -> int:  # what --capacity auto leaves, and what check_device_fits compares with
        return total - capacity_margin(total)

    h200, h100 = 143_771 << 20, 81_559 << 20  # the two cards' memory as torch reports it
    sizes = PRESETS["h200"]
    alone = [s.device_bytes("vllm", h200) for s in sizes]
    assert max(alone) <= room(h200) < sum(alone)  # each job alone fits; all at once the policy must park
    assert max(s.device_bytes("vllm", h100) for s in sizes) > room(h100)  # refused on an 80 GB card
    # what the orchestrator counts: trainer states and the engines' shares, over the capacity by more than the
    # smallest trainer state, so a switch cannot always be served by parking engines and that trainer alone
    counted = sum(s.trainer_state_bytes + s.engine_memory * h200 for s in sizes)
    assert counted - room(h200) > min(s.trainer_state_bytes for s in sizes)


def test_the_h100_shapes_fit_an_80_gb_card_alone_but_not_all_at_once():
    """The same experiment for the cards the GPU sessions get: each job alone fits an H100's room, all at once the
    trainer states and engines' shares exceed it by more than the smallest trainer state (trainers must park)."""
    from rota_demo.llm_models import PRESETS
    from rota_demo.memory import capacity_margin

    h100 = 81_559 << 20
    room = h100 - capacity_margin(h100)
    sizes = PRESETS["h100"]
    alone = [s.device_bytes("vllm", h100) for s in sizes]
    assert max(alone) <= room < sum(alone)
    counted = sum(s.trainer_state_bytes + s.engine_memory * h100 for s in sizes)
    assert counted - room > min(s.trainer_state_bytes for s in sizes)
    assert [s.task for s in sizes] == [s.task for s in PRESETS["h200"]]  # the same jobs, smaller


def test_preload_imports_the_engine_before_the_set_up_turn_and_starts_no_cuda():
    """A vLLM engine worker imports vLLM (here the fake) and rota_vllm before its set-up turn (that import held the
    device ~23 s of each engine's turn on the H100), with the engine's settings, and without starting CUDA; a
    machine without vLLM gets no error here (the build names what is missing)."""
    code = ("import os, sys, torch; from rota_demo.llm_engines import preload; preload('vllm', 'sampler'); "
            "print(int('vllm' in sys.modules), int('rota_vllm' in sys.modules), int(torch.cuda.is_initialized()), "
            "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'], int('transformers' in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FAKE_VLLM), os.environ.get("PYTHONPATH", "")])}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split() == ["1", "1", "0", "0", "1"], r.stdout + r.stderr[-2000:]
    env.pop("PYTHONPATH")  # no vLLM at all: nothing raised, nothing imported
    r = subprocess.run([sys.executable, "-c", code.replace(", os.environ['VLLM_ENABLE_V1_MULTIPROCESSING']", "")],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.split()[:2] == ["0", "0"], r.stdout + r.stderr[-2000:]


def test_shared_vllm_engines_tell_rota_what_they_will_hold_before_they_start():
    """With a capacity, a tenant that has tracked nothing counts as 0 bytes, so an engine's set-up turn keeps the
    residents that fit beside nothing, and vLLM refuses to start below its share of free memory: by the
    orchestrator's rule (park the lowest priority, oldest first, until the newcomer fits), in 8 of the 48 set-up
    orders of the h200 shapes on an H200 the rl-b engine would have found about 16.5 GiB free for its 16.8 GiB
    share. So each vLLM engine worker of a shared run hints what rota_vllm reports once it tracks the engine;
    trainers, the hf stand-in and dedicated runs keep their sizes' own figures."""
    import rota_vllm
    from rota_demo.llm_models import PRESETS
    from rota_demo.runner import JOBS, DemoConfig, worker_specs

    h200 = 143_771 << 20
    cfg = DemoConfig(engine="vllm", device="cuda", groups=1, llm_sizes=PRESETS["h200"], capacity_bytes=1 << 40)
    specs = worker_specs(cfg, JOBS, "127.0.0.1:1", device_total=h200)
    hints = {s.name: s.footprint_hint for s in specs}
    for s in specs:
        want = rota_vllm.awake_footprint(s.size.engine_memory, h200) if s.role == "sampler" else 0
        assert s.footprint_hint == want and (s.role == "trainer" or want > s.size.engine_memory * h200), hints
    assert all(s.footprint_hint == 0 for s in worker_specs(cfg, JOBS, None, device_total=h200))  # dedicated
    hf = DemoConfig(engine="hf", device="cpu", groups=1, llm_sizes=PRESETS["h200"])
    assert all(s.footprint_hint == 0 for s in worker_specs(hf, JOBS, "127.0.0.1:1"))


def test_pretraining_stops_where_a_rollout_would_be_right_as_often_as_asked(tmp_path):
    """``pretrain_reward``: pre-training stops once the model's mean probability of the exact answer, on questions
    it has not seen, reaches the target; and that probability is what rollouts at temperature 1 then score."""
    import dataclasses

    import torch
    from transformers import Qwen3ForCausalLM

    from rota_demo import llm_tasks as t
    from rota_demo.llm_models import LlmSize, build_checkpoint

    size = LlmSize("rev", pretrain_steps=60, pretrain_reward=0.3)
    path, _ = build_checkpoint(size, 1, "cpu", str(tmp_path))  # seed 1 gets there in 35 steps (seed 0: not in 60)
    record = json.loads((Path(path) / "rota-demo.json").read_text())
    rewards = record["pretrain_expected_rewards"]
    assert rewards[-1] >= 0.3 and max(rewards[:-1]) < 0.3 and len(record["pretrain_losses"]) == len(rewards) - 1 < 60
    assert size.key(1) != dataclasses.replace(size, pretrain_reward=0.0).key(1)  # a different checkpoint
    model = Qwen3ForCausalLM.from_pretrained(path).eval()
    questions = t.prompts("rev", 12345, 0, 64)
    prompt = torch.tensor([[t.BOS, *t.encode(q)] for q in questions]).repeat_interleave(8, dim=0)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=t.MAX_NEW, pad_token_id=t.PAD, eos_token_id=t.EOS)
    scored = [t.reward(questions[i // 8], row[prompt.shape[1]:].tolist()) for i, row in enumerate(out)]
    # 512 samples: sd about 0.02 (measured here: 0.311 sampled, 0.311 expected)
    assert abs(_mean(scored) - rewards[-1]) < 0.08, (_mean(scored), rewards[-1])


def test_engine_memory_sets_each_jobs_share_and_the_footprint_rota_counts():
    """One share for all or three; each vLLM engine's footprint hint (what a capacity counts before it tracks)
    follows its share, so larger shares leave less room beside the engines."""
    import dataclasses

    from rota_demo.cli import engine_shares
    from rota_demo.llm_models import PRESETS
    from rota_demo.runner import JOBS, DemoConfig, worker_specs
    from rota_demo.workloads import ModelSize

    assert engine_shares("") is None and engine_shares("0.3") == (0.3, 0.3, 0.3)
    assert engine_shares("0.2, 0.25,0.3") == (0.2, 0.25, 0.3)
    total = 140 << 30

    def hints(shares):
        sizes = tuple(dataclasses.replace(s, engine_memory=f) for s, f in zip(PRESETS["h200"], shares, strict=True))
        cfg = DemoConfig(steps=1, groups=1, device="cuda:0", size=ModelSize(), engine="vllm", llm_sizes=sizes,
                         capacity_bytes=100 << 30)
        return [s.footprint_hint for s in worker_specs(cfg, JOBS, "127.0.0.1:1", device_total=total)
                if s.role == "sampler"]

    small, large = hints((0.1, 0.12, 0.2)), hints(engine_shares("0.2,0.25,0.3"))
    assert len(small) == len(large) == 3 and all(small)
    added = (0.1, 0.13, 0.1)  # each job's share grew by this much of the device
    assert all(b - a == pytest.approx(d * total, rel=0.02) for a, b, d in zip(small, large, added, strict=True))
