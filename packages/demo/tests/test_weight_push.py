"""The demo's weight push (one shared host buffer per job, a version number over the pipe)
and its host-memory refusal, with real worker processes."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="the demo needs torch (installed by ./dev setup)")

from rota_demo.memory import HostMemoryShort, host_memory_plan  # noqa: E402
from rota_demo.push import WeightPush, push_bytes, weights_digest  # noqa: E402
from rota_demo.runner import DemoConfig, run_demo  # noqa: E402
from rota_demo.workloads import ModelSize, build  # noqa: E402

SMALL = ModelSize(vocab=16, hidden=32, layers=2, seq=4, batch=4)


@pytest.mark.slow
@pytest.mark.parametrize("groups", [1, 2])
def test_sampler_holds_byte_identical_weights_after_every_push(groups):
    cfg = DemoConfig(steps=8, groups=groups, size=SMALL, off_device_s=0.0, modes=("dedicated", "timesliced"),
                     record_digests=True)
    results = run_demo(cfg, lambda line: None)
    for mode, res in results.items():
        for job, pushes in (("rl-a", cfg.steps - 1), ("rl-b", cfg.steps - 1), ("sft", cfg.steps // cfg.eval_every())):
            sent, got = res.reports[f"{job}/trainer"].digests, res.reports[f"{job}/sampler"].digests
            assert len(sent) == pushes and got == sent, (mode, job)
            assert len(set(sent)) == pushes, (mode, job)  # every push carried new weights
    assert results["dedicated"].reports["sft/sampler"].values == results["timesliced"].reports["sft/sampler"].values
    assert mp.active_children() == []  # every worker of every mode was reaped before run_demo returned


def _slow_reader(push: WeightPush, inbox, out, count: int) -> None:
    """A sampler that lags: it waits after each announcement before copying, as a busy eval sampler would."""
    model, _ = build(SMALL, 1, "cpu", optimizer=False)
    push.bind(model)
    for _ in range(count):
        version = inbox.recv()
        time.sleep(0.3)
        push.read_into(model)
        out.put((version, weights_digest(model.state_dict())))


def test_async_pushes_never_overwrite_a_push_still_being_read():
    ctx = mp.get_context("spawn")
    push = WeightPush.create(ctx, SMALL.push_bytes)
    inbox, outbox = ctx.Pipe(duplex=False)
    out = ctx.Queue()
    reader = ctx.Process(target=_slow_reader, args=(push, inbox, out, 4), daemon=True)
    reader.start()
    try:
        model, _ = build(SMALL, 0, "cpu", optimizer=False)
        push.bind(model)
        sent = []
        for version in range(1, 5):  # push as fast as the buffer allows, like an SFT trainer between evals
            with torch.no_grad():
                for i, t in enumerate(model.state_dict().values()):
                    t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(version * 100 + i)))
            push.claim()
            push.write(model)
            sent.append((version, weights_digest(model.state_dict())))
            outbox.send(version)
        got = [out.get(timeout=60) for _ in sent]
    finally:
        reader.join(timeout=60)
    assert reader.exitcode == 0
    assert got == sent


def _bf16_reader(push: WeightPush, out) -> None:
    """An engine that holds bf16 weights: it receives the buffer's views as they are (read_with)."""
    model, _ = build(SMALL, 1, "cpu", optimizer=False)  # the layout: the trainer's fp32 state dict
    push.bind(model)
    push.read_with(lambda named: out.put({name: (str(t.dtype), t.contiguous().view(torch.int16).numpy().tobytes())
                                          for name, t in named}))  # raw bits: tensors would outlive this process


def test_a_bf16_push_carries_the_trainers_weights_rounded_once_in_half_the_bytes():
    # what --engine vllm does: its engine holds bf16 weights, so they travel as bf16 (PUSH_DTYPE)
    ctx = mp.get_context("spawn")
    model, _ = build(SMALL, 0, "cpu", optimizer=False)
    shapes = [(t.numel(), 2) for t in model.state_dict().values()]
    push = WeightPush.create(ctx, push_bytes(shapes), "bfloat16")
    assert push_bytes(shapes) < SMALL.push_bytes
    out = ctx.Queue()
    reader = ctx.Process(target=_bf16_reader, args=(push, out), daemon=True)
    reader.start()
    try:
        push.bind(model)
        push.claim()
        push.write(model)
        got = out.get(timeout=60)
    finally:
        reader.join(timeout=60)
    assert reader.exitcode == 0
    want = {name: ("torch.bfloat16", t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
            for name, t in model.state_dict().items()}
    assert list(got) == list(want)
    for name, bits in got.items():
        assert bits == want[name], name


def test_push_buffer_too_small_names_the_fix():
    push = WeightPush.create(mp.get_context("spawn"), SMALL.push_bytes - 64)
    model, _ = build(SMALL, 0, "cpu", optimizer=False)
    with pytest.raises(ValueError, match="too small for the state dict"):
        push.bind(model)


def test_host_memory_plan_counts_pools_and_push_buffers_and_refuses_what_does_not_fit():
    size = ModelSize.for_state_bytes(20 * 10**9)
    cfg = DemoConfig(steps=4, groups=1, device="cuda", size=size, host_memory_bytes=128 * 2**30)
    fits = host_memory_plan(cfg)
    assert fits.mode == "timesliced"
    assert fits.push == 3 * size.push_bytes and fits.models == 0
    if fits.pools:  # rota_fsdp installed: 3 trainers' full state + 3 samplers' weights
        assert fits.pools == 3 * (size.trainer_state_bytes + size.weight_bytes)
    fits.check()
    assert "host memory: about" in fits.describe() and "137.4 GB available (--host-memory)" in fits.describe()
    short = host_memory_plan(DemoConfig(steps=4, groups=1, device="cuda", size=size, host_memory_bytes=50 * 10**9))
    with pytest.raises(HostMemoryShort, match=r"needs about .* GB .* only 50.0 GB is available .* smaller --state"):
        short.check()


def test_host_memory_plan_of_vllm_engines_counts_their_pools_and_bf16_push_buffers():
    pytest.importorskip("transformers", reason="the LLM mode's sizes need transformers")
    from rota_demo.llm_models import PRESETS

    sizes = PRESETS["h200"]
    plans = {eng: host_memory_plan(DemoConfig(steps=4, groups=1, device="cuda", size=SMALL, engine=eng,
                                              llm_sizes=sizes, capacity_bytes=64 << 30,
                                              host_memory_bytes=128 << 30)) for eng in ("hf", "vllm")}
    states = sum(s.trainer_state_bytes for s in sizes)
    # rota_vllm reserves each engine's pool (bf16 weights) when it tracks it, whatever the capacity; the hf
    # stand-in pins one only where every switch parks
    assert plans["vllm"].pools == states + sum(s.params * 2 for s in sizes) and plans["hf"].pools == states
    assert plans["vllm"].push == sum(s.push_bytes_as("bfloat16") for s in sizes)
    assert plans["hf"].push == sum(s.push_bytes for s in sizes) > 1.9 * plans["vllm"].push
    plans["vllm"].check()  # the three Qwen3 shapes fit a 128 GiB host with the engines' bf16 pushes


@pytest.mark.parametrize("args", [["--state", "10TB"], ["--state", "400MB", "--host-memory", "4GB"]])
def test_demo_refuses_a_run_that_would_not_fit_in_host_memory_before_starting_workers(args):
    r = subprocess.run([sys.executable, "-m", "rota", "demo", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stderr
    assert "host memory: about" in r.stderr and "smaller --state" in r.stderr
    assert "dedicated:" not in r.stderr  # no mode started


@pytest.mark.parametrize("value,needle", [("lots", "'lots' is not a size"), ("0", "must be > 0")])
def test_demo_rejects_a_bad_host_memory(value, needle):
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--host-memory", value], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and needle in r.stderr, r.stderr
