"""Shared LoRA turns (``lora_concurrency`` > 1): LoRA units on one shared base run at once in one rota turn.

Everything is real: a rota orchestrator on loopback, the shared turn's rota tenant, spawned trainer
processes and the official SDK. What must hold: at most ``limit`` units run at once; its tenant
takes turns like any tenant (another tenant waiting past the turn limit gets the device once the
running units end, and nothing of the shared turn runs during its turn); a trainer that dies inside a
unit frees its place; and each tenant's losses and samples are exactly those of its run alone.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Listener
from typing import Any

import tinker
from tinker import types
from tinker_testlib import KEYS, WIDE, await_queued, batch, concurrently, full_training_client

import rota
from rota.orchestrator import OrchestratorConfig
from rota.policies import Fifo
from rota.testing import running_orchestrator
from rota_tinker import DEFAULT_BASE_MODELS, ServiceConfig, Tenant, TinkerService
from rota_tinker._worker.shared_turn import SharedTurn, SharedTurnGate

TIMEOUT = 180


def wait_until(cond: Callable[[], bool], what: str, timeout_s: float = 30) -> None:
    """A hang guard, not a threshold: normally a few rounds."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


class Entering(threading.Thread):
    """A unit asking the gate to enter, in a thread of its own."""

    def __init__(self, gate: SharedTurnGate) -> None:
        super().__init__(daemon=True)
        self.gate, self.entered, self.timing = gate, threading.Event(), {}
        self.start()

    def run(self) -> None:
        self.timing = self.gate.enter()
        self.entered.set()


def test_the_shared_turn_runs_up_to_its_limit_and_gives_way_to_a_waiting_tenant() -> None:
    with running_orchestrator(OrchestratorConfig(policy=Fifo(max_turn_s=0.2))) as (endpoint, _engine):
        tenant = rota.connect(group="shared-gate", tenant="lora-shared.0", endpoint=endpoint)
        other = rota.connect(group="shared-gate", tenant="other", endpoint=endpoint)
        gate = SharedTurnGate(tenant, limit=2)
        try:
            first, second = gate.enter(), gate.enter()
            assert (first["new_turn"], second["new_turn"], second["units_sharing"]) == (1.0, 0.0, 2.0)
            third = Entering(gate)
            wait_until(lambda: gate.waiting == 1, "the third unit asks")
            assert not third.entered.wait(0.2), "a third unit ran beside two with limit 2"
            gate.leave(1000)
            assert third.entered.wait(10) and third.timing["new_turn"] == 0.0

            granted: list[float] = []
            waiter = threading.Thread(target=lambda: (other.acquire(), granted.append(time.monotonic())))
            waiter.start()
            wait_until(lambda: tenant.should_yield, "the orchestrator asks the shared turn to yield")
            gate.leave(3000)  # a place is free, but the shared turn was asked to yield
            fourth = Entering(gate)
            wait_until(lambda: gate.waiting == 1, "the fourth unit asks")
            assert not fourth.entered.wait(0.2), "a shared turn asked to yield admitted a new unit"
            assert not granted, "the other tenant got the device while a unit of the shared turn ran"
            gate.leave(2000)
            released = time.monotonic()
            waiter.join(10)
            assert granted and granted[0] >= released and tenant.grant is None
            assert not fourth.entered.wait(0.2), "a unit of the shared turn ran during the other tenant's turn"
            other.release()
            assert fourth.entered.wait(10) and fourth.timing["new_turn"] == 1.0  # a new shared turn
            gate.leave(0)
            assert tenant.footprint()["working"] == 2 * 3000  # two at once x the largest unit
            for worker, kept in ((1, 5 * 2**30), (2, 2**30), (1, 4 * 2**30)):  # caches the workers keep
                gate.enter()
                gate.leave(10, kept, worker=worker)
            assert tenant.footprint()["working"] == 5 * 2**30  # worker 1's latest and worker 2's
        finally:
            gate.close()
            tenant.close()
            other.close()


def _enter_and_die(address: str) -> None:
    import torch

    SharedTurn(address, torch.device("cpu")).begin()
    os._exit(3)  # dies inside its unit, without leaving


def test_a_trainer_that_dies_inside_a_unit_frees_its_place() -> None:
    with running_orchestrator() as (endpoint, _engine):
        tenant = rota.connect(group="shared-crash", tenant="lora-shared.0", endpoint=endpoint)
        gate = SharedTurnGate(tenant, limit=1)
        listener = Listener(family="AF_UNIX", authkey=mp.current_process().authkey)

        def serve() -> None:
            conn = listener.accept()
            assert conn.recv() == ("gate",)
            gate.serve(conn)

        server = threading.Thread(target=serve, daemon=True)
        server.start()
        try:
            child = mp.get_context("spawn").Process(target=_enter_and_die, args=(listener.address,))
            child.start()
            child.join(60)
            assert child.exitcode == 3
            server.join(10)
            assert gate.running == 0
            assert gate.enter()["units_sharing"] == 1.0  # the only place is free again
            gate.leave()
        finally:
            listener.close()
            gate.close()
            tenant.close()


def lora_steps(sc: tinker.ServiceClient, seed: int, steps: int = 3) -> list[float]:
    tc = sc.create_lora_training_client(base_model=WIDE.name, rank=4, seed=seed).result(timeout=TIMEOUT)
    losses = []
    for step in range(steps):
        fb = tc.forward_backward(batch(step, seed=seed, vocab=WIDE.vocab, n=4, length=32), "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result(timeout=TIMEOUT).metrics["loss:sum"])
        op.result(timeout=TIMEOUT)
    return losses


def full_steps(sc: tinker.ServiceClient, seed: int, steps: int = 3) -> list[float]:
    tc = full_training_client(sc, "rota/tiny")
    losses = []
    for step in range(steps):
        fb = tc.forward_backward(batch(step, seed=seed), "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(fb.result(timeout=TIMEOUT).metrics["loss:sum"])
        op.result(timeout=TIMEOUT)
    return losses


def test_lora_tenants_step_together_with_their_numbers_alone(tmp_path: Any) -> None:
    seeds = {"bob": 31, "carol": 32, "dave": 33}
    with running_orchestrator(OrchestratorConfig(ttl_s=10.0, park_timeout_s=60.0)) as (endpoint, _engine):
        config = ServiceConfig(tenants=tuple(Tenant(n, k) for n, k in KEYS.items()), data_dir=str(tmp_path),
                               endpoint=endpoint, group="tinker-shared", long_poll_s=2.0, lora_concurrency=3,
                               base_models={**DEFAULT_BASE_MODELS, WIDE.name: WIDE})
        with TinkerService(config) as svc:
            sc = {t: tinker.ServiceClient(base_url=svc.url, api_key=KEYS[t]) for t in KEYS}
            # the three LoRA tenants' first forward_backward wait together at the shared turn while another tenant
            # holds the device; when it lets go, the shared turn's tenant takes one turn and runs them at once
            tcs = concurrently({t: (lambda t=t: sc[t].create_lora_training_client(
                base_model=WIDE.name, rank=4, seed=seeds[t]).result(timeout=TIMEOUT)) for t in seeds})
            blocker = rota.connect(group="tinker-shared", tenant="blocker", endpoint=endpoint)
            try:
                blocker.acquire()
                with svc.state.lock:
                    since = len(svc.state.futures)
                fbs = {t: tcs[t].forward_backward(batch(0, seed=1, vocab=WIDE.vocab, n=4, length=32),
                                                  "cross_entropy") for t in seeds}
                for t in seeds:
                    await_queued(svc, t, ["ForwardBackward"], since, TIMEOUT)
                time.sleep(0.5)  # the units reach the gate (no threshold: fewer at once only weakens the check)
                blocker.release()
                for fut in fbs.values():
                    fut.result(timeout=TIMEOUT)
            finally:
                blocker.close()
            with svc.state.lock:
                ours = {f.request_id for f in list(svc.state.futures.values())[since:]}
            units = [u for u in svc.unit_timings() if u["request_id"] in ours and u["kind"] == "ForwardBackward"]
            assert len(units) == 3 and max(u["units_sharing"] for u in units) >= 2, units
            assert sum(u["new_turn"] for u in units) == 1.0  # one shared turn for all three

            together = concurrently({**{t: (lambda t=t: lora_steps(sc[t], seeds[t])) for t in seeds},
                                     "alice": lambda: full_steps(sc["alice"], 41)})
            shared = [u for u in svc.unit_timings() if u["kind"] in ("ForwardBackward", "OptimStep")
                      and u["tenant"] != "alice"]
            assert all(u.get("parked_bytes", 0) == 0 for u in shared)  # adapters in a shared turn never move
            alone = {t: lora_steps(sc[t], seeds[t]) for t in seeds}
            alone["alice"] = full_steps(sc["alice"], 41)
            assert together == alone
            assert len({tuple(v) for v in together.values()}) == 4  # four different runs

            # the shared models' weights go to samplers, which sample in the shared turn too: two tenants' samples
            # held back together run in one shared turn, each as it samples alone
            samplers = {}
            for t in ("bob", "carol"):
                tc = tcs[t]
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
                path = tc.save_weights_for_sampler("shared").result(timeout=TIMEOUT).path
                samplers[t] = sc[t].create_sampling_client(model_path=path).result(timeout=TIMEOUT)

            def sample(t: str) -> Any:
                return samplers[t].sample(types.ModelInput.from_ints([1, 2, 3]), 2,
                                          types.SamplingParams(max_tokens=6, seed=7, temperature=1.0))

            def tokens(res: Any) -> list[list[int]]:
                return [list(map(int, seq.tokens)) for seq in res.sequences]

            alone = {t: tokens(sample(t).result(timeout=TIMEOUT)) for t in samplers}
            blocker = rota.connect(group="tinker-shared", tenant="blocker", endpoint=endpoint)
            try:
                blocker.acquire()
                with svc.state.lock:
                    since = len(svc.state.futures)
                futs = {t: sample(t) for t in samplers}
                for t in samplers:
                    await_queued(svc, t, ["Sample"], since, TIMEOUT)
                time.sleep(0.5)  # the units reach the gate (no threshold: fewer at once only weakens the check)
                blocker.release()
                together = {t: tokens(f.result(timeout=TIMEOUT)) for t, f in futs.items()}
            finally:
                blocker.close()
            assert together == alone
            with svc.state.lock:
                ours = {f.request_id for f in list(svc.state.futures.values())[since:]}
            units = [u for u in svc.unit_timings() if u["request_id"] in ours and u["kind"] == "Sample"]
            assert len(units) == 2 and max(u["units_sharing"] for u in units) == 2, units
            assert sum(u["new_turn"] for u in units) == 1.0
