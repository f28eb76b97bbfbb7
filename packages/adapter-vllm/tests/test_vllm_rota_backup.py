"""``backup="rota"``: an OFFLOAD park copies each worker's parameters into rota's host pool and sleeps at level 2;
the restore wakes the weights, starts copying them back, wakes the KV cache meanwhile, then waits for the copy.
The fake engine below does what vLLM's level-2 sleep does to the weights' memory (its contents are lost:
overwritten with NaN here) and keeps the buffers as vLLM does; the model is a real torch module with tied
weights. (The H200 run is in the CUDA tier.)"""

from __future__ import annotations

import pytest
import torch

import rota_vllm


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(64, 16)
        self.mlp = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 64, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, kept once
        self.register_buffer("rope", torch.arange(16.0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.mlp(self.embed(ids)) + self.rope))


class Worker:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model_runner = type("Runner", (), {})()
        self.model_runner.model = TinyLM()


class SleepingLLM:
    """vllm.LLM's sleep mode over one in-process worker: level 2 loses the weights' contents (NaN here)."""

    def __init__(self) -> None:
        self.worker, self.calls, self.asleep = Worker(), [], set()

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))
        assert level == 2, "with backup='rota' the engine sleeps at level 2"
        with torch.no_grad():
            for p in self.worker.model_runner.model.parameters():
                p.fill_(float("nan"))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))
        self.asleep -= set(tags or ("weights", "kv_cache"))

    def collective_rpc(self, method, args=(), kwargs=None):
        self.calls.append(("rpc", method.__name__, sorted(self.asleep)))
        return [method(self.worker, *args, **(kwargs or {}))]


def _parked(connect, gpu) -> None:
    """One turn of the engine, then one of a trainer of another job, which parks it."""
    gpu.acquire()
    gpu.release()
    trainer = connect("trainer")
    trainer.acquire()  # parks the engine
    trainer.release()


def _park_and_restore(connect, gpu) -> None:
    _parked(connect, gpu)
    gpu.acquire()  # restores it
    gpu.release()


def test_offload_keeps_the_weights_in_rotas_pool_and_outputs_are_unchanged(connect) -> None:
    gpu = connect("llm")
    llm = SleepingLLM()
    model = llm.worker.model_runner.model
    ids = torch.arange(8)
    before = model(ids).detach().clone()
    tracked = rota_vllm.track(gpu, llm, check_version=False)
    params = sum(p.numel() * 4 for p in {p.data_ptr(): p for p in model.parameters()}.values())
    assert tracked.stash_bytes == params  # the tied weight counted once
    assert rota_vllm.worker_stash(llm.worker).nbytes == params  # what benchmarks read
    _park_and_restore(connect, gpu)
    assert llm.calls[1:] == [("rpc", "worker_save", []), ("sleep", 2),
                             ("rpc", "worker_trim", ["kv_cache", "weights"]), ("wake_up", ["weights"]),
                             ("rpc", "worker_load_begin", ["kv_cache"]), ("wake_up", ["kv_cache"]),
                             ("rpc", "worker_load_end", [])]
    assert list(tracked.last_phases) == ["wake_weights", "issue", "wake_kv_cache", "wait"]  # the restore's steps
    assert all(s >= 0 for s in tracked.last_phases.values())
    assert torch.equal(model(ids), before)  # bit for bit, buffers included
    assert rota_vllm.worker_stash(llm.worker).copy_back() >= 0  # the pool's bytes again (benchmarks time it)
    assert torch.equal(model(ids), before)
    assert tracked.dropped == ("kv_cache",) and not tracked.weights_stale
    assert model.head.weight is model.embed.weight
    tracked.untrack()
    assert not hasattr(llm.worker, "_rota_weights_stash") and rota_vllm.worker_stash(llm.worker) is None


def test_a_discard_plan_keeps_nothing_and_wants_a_weight_push(connect) -> None:
    gpu = connect("llm")
    llm = SleepingLLM()
    tracked = rota_vllm.track(gpu, llm, mode="discard", check_version=False)
    _park_and_restore(connect, gpu)
    rpcs = [c[1] for c in llm.calls if c[0] == "rpc"]
    assert rpcs == ["worker_prepare", "worker_trim"]  # no save, no load
    assert tracked.weights_stale and tracked.dropped == ("weights", "kv_cache")
    tracked.untrack()


def test_parameters_that_moved_while_asleep_are_refused_not_overwritten(connect) -> None:
    gpu = connect("llm")
    llm = SleepingLLM()
    tracked = rota_vllm.track(gpu, llm, check_version=False)
    gpu.acquire()
    gpu.release()
    trainer = connect("trainer")
    trainer.acquire()
    mlp = llm.worker.model_runner.model.mlp
    kept, mlp.weight = mlp.weight, torch.nn.Parameter(torch.zeros(16, 16))  # a new model loaded
    trainer.release()
    with pytest.raises(Exception, match="parameters moved while the engine slept"):
        gpu.acquire()
    assert torch.equal(mlp.weight, torch.zeros(16, 16))  # not overwritten with the old weights
    mlp.weight = kept
    tracked.untrack()  # restores into the parameters it saved
    assert not torch.isnan(kept).any()


class KvWakeFails(SleepingLLM):
    """The KV cache's wake fails once (out of memory, as on the H200 when another job's trainer held the device);
    a tag woken twice is an error, as in vLLM (its memory is mapped already)."""

    fail = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        assert not set(tags or ("weights", "kv_cache")) - self.asleep, f"woken twice: {tags}"
        if tags == ["kv_cache"] and self.fail:
            self.fail = False
            self.calls.append(("wake_up", tags))
            raise RuntimeError("CUDA Error: out of memory (a fake's)")
        super().wake_up(tags)


def test_a_failed_kv_wake_still_waits_for_the_weights_copy_and_fails_the_restore(connect) -> None:
    gpu = connect("llm")
    llm = KvWakeFails()
    tracked = rota_vllm.track(gpu, llm, check_version=False)
    _parked(connect, gpu)
    with pytest.raises(Exception, match="out of memory"):
        gpu.acquire()
    names = [c[1] if c[0] == "rpc" else c for c in llm.calls]
    assert names[-3:] == ["worker_load_begin", ("wake_up", ["kv_cache"]), "worker_load_end"]
    assert gpu.stats.failed("restore") == 1
    model = llm.worker.model_runner.model
    assert not torch.isnan(model.mlp.weight).any()  # the copy landed all the same
    gpu.acquire()  # the retry wakes only the KV cache
    gpu.release()
    assert llm.calls[-1] == ("wake_up", ["kv_cache"]) and not llm.asleep
    assert not torch.isnan(model.mlp.weight).any() and tracked.parked_level == 0
    tracked.untrack()
