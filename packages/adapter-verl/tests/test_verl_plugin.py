"""rota_verl against verl 0.9.1's real classes, on CPU (the venv heavy_setup.sh builds; skipped where verl is absent).

What runs: the ``verl.plugins`` entry point in a fresh interpreter (and its loud failure) and in a Ray
worker; verl's ``EngineRegistry`` picking rota's engines; ``rota_sync`` built by verl's registry from verl's
own config (hydra), its hooks called in the order ``PPOTrainer.fit`` calls them (verl 0.9.1:
``on_init_end``, the validation hooks, then per step ``on_step_begin``, ``on_sample_begin``,
``on_sample_end``, ``on_step_end``) against a real orchestrator with a second tenant always waiting;
rota's engine ``to()`` parking and restoring a real module, its grads and Adam state through rota_torch.

Fakes, where verl itself needs a GPU: the rollout replicas' ``CheckpointEngineManager`` (``FakeReplicas``: it
records each call and whether the job held its turn), and the engine's module and optimizer, set on an
engine made without ``__init__`` (verl builds them only under torch.distributed with a device mesh). No
end-to-end verl step runs on CPU.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import threading
import time

import pytest

pytest.importorskip("verl", reason="verl is not installed here: bash packages/adapter-verl/heavy_setup.sh runs "
                                   "these tests in a venv of their own")

import torch

LOADED = "rota_verl: loaded into verl 0.9.1"
PROBE = ("import verl\nfrom verl.trainer.ppo.v1 import get_trainer_cls\n"
         "from verl.workers.engine.base import EngineRegistry\n"
         "print(get_trainer_cls('rota_sync').__name__,\n"
         "      EngineRegistry.get_engine_cls('language_model', 'fsdp2').__name__)")


def run_python(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env=(os.environ | (env or {})))


def test_the_entry_point_loads_in_a_fresh_interpreter_and_says_so() -> None:
    out = run_python(PROBE)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["RotaPPOTrainerSync", "RotaFSDPEngineWithLMHead"]
    assert LOADED in out.stderr and "(cuda, nvidia)" in out.stderr


def test_a_plugin_that_cannot_load_says_so_at_error(tmp_path: pathlib.Path) -> None:
    (tmp_path / "rota_torch.py").write_text("raise ImportError('rota_torch broken for this test')\n")
    out = run_python("import verl\nfrom verl.trainer.ppo.v1 import get_trainer_cls\nget_trainer_cls('rota_sync')",
                     {"PYTHONPATH": str(tmp_path)})
    assert out.returncode != 0 and "Unknown trainer 'rota_sync'" in out.stderr  # verl went on without it
    assert "rota_verl: the verl plugin failed to load" in out.stderr and "rota_torch broken" in out.stderr


def test_the_entry_point_loads_in_a_ray_worker() -> None:
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        def probe() -> tuple[int, str, str]:
            import verl  # noqa: F401  (loads the plugins, as in every verl worker)
            from verl.trainer.ppo.v1 import get_trainer_cls
            from verl.workers.engine.base import EngineRegistry

            return (os.getpid(), get_trainer_cls("rota_sync").__name__,
                    EngineRegistry.get_engine_cls("value_model", "fsdp").__name__)

        pid, trainer, engine = ray.get(probe.remote(), timeout=240)
    finally:
        ray.shutdown()
    assert pid != os.getpid()
    assert (trainer, engine) == ("RotaPPOTrainerSync", "RotaFSDPEngineWithValueHead")


@pytest.mark.parametrize(("device", "vendor", "ours"), [("cuda", "nvidia", True), ("npu", "huawei", False)])
def test_the_registry_picks_rotas_engine_for_cuda_nvidia(monkeypatch, device: str, vendor: str, ours: bool) -> None:
    from verl.workers.engine.base import EngineRegistry

    import rota_verl.engine as engine

    monkeypatch.setenv("VERL_ENGINE_DEVICE", device)
    monkeypatch.setenv("VERL_ENGINE_VENDOR", vendor)
    for model_type, rota_cls in (("language_model", engine.RotaFSDPEngineWithLMHead),
                                 ("value_model", engine.RotaFSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            picked = EngineRegistry.get_engine_cls(model_type, backend)
            assert (picked is rota_cls) == ours, (model_type, backend, picked)
            assert issubclass(rota_cls, picked)  # verl's own engine is the base of rota's


def verl_config(*overrides: str):
    import verl
    from hydra import compose, initialize_config_dir

    folder = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=folder, version_base=None):
        return compose("ppo_trainer", overrides=["trainer.use_v1=True", "trainer.v1.trainer_mode=rota_sync",
                                                 "algorithm.adv_estimator=grpo", *overrides])


OFFLOAD = ["actor_rollout_ref.actor.fsdp_config.param_offload=True",
           "actor_rollout_ref.actor.fsdp_config.optimizer_offload=True",
           "actor_rollout_ref.ref.fsdp_config.param_offload=True"]


def test_rota_sync_refuses_configs_that_keep_state_on_the_device() -> None:
    from verl.trainer.ppo.v1 import get_trainer_cls

    cls = get_trainer_cls("rota_sync")
    with pytest.raises(ValueError, match=r"add actor_rollout_ref\.actor\.fsdp_config\.param_offload=True"):
        cls(verl_config())


class FakeReplicas:
    """A fake of verl's CheckpointEngineManager (its replicas need GPUs): records each call and the turn."""

    def __init__(self, gpu_of) -> None:
        self.gpu_of, self.calls = gpu_of, []

    def update_weights(self, global_steps: int) -> None:
        self.calls.append(("update_weights", self.gpu_of().grant is not None))

    def sleep_replicas(self) -> None:
        self.calls.append(("sleep_replicas", self.gpu_of().grant is not None))


def test_rota_sync_takes_and_gives_turns_per_phase_in_fits_order(endpoint, monkeypatch) -> None:
    from verl.trainer.ppo.v1 import get_trainer_cls

    import rota

    monkeypatch.setenv("ROTA_ORCHESTRATOR", endpoint)
    monkeypatch.setenv("ROTA_TENANT", "verl-job")
    trainer = get_trainer_cls("rota_sync")(verl_config(*OFFLOAD))
    assert trainer.trainer_mode == "sync" and type(trainer.replay_buffer).__name__ == "ReplayBuffer"
    trainer.checkpoint_manager = FakeReplicas(lambda: trainer.rota_gpu)
    trainer.global_steps, trainer.curr_step_profile = 1, False

    other, stop, other_turns = rota.connect(tenant="other", endpoint=endpoint), threading.Event(), []

    def contend() -> None:  # always waiting: every turn the job gives goes to it first
        while not stop.is_set():
            with other.turn():
                other_turns.append(time.monotonic())

    trainer.rota_connect()
    thread = threading.Thread(target=contend, daemon=True)
    thread.start()
    held_in_update = []
    try:
        trainer.on_init_end()
        trainer.on_validate_begin()  # val_before_train
        trainer.on_validate_end()
        trainer.on_train_begin()
        for _ in range(2):
            trainer.on_step_begin()
            trainer.on_sample_begin()
            trainer.on_sample_end()
            held_in_update.append(trainer.rota_gpu.grant is not None)  # reward, log-probs, update, checkpoint
            before = len(other_turns)
            trainer.on_step_end()
            deadline = time.monotonic() + 10
            while len(other_turns) == before and time.monotonic() < deadline:
                time.sleep(0.01)  # the other tenant's turn after ours
    finally:
        stop.set()
        thread.join(10)
        trainer.on_train_end()
        other.close()

    step = [("on_sample_begin", "take"), ("on_sample_begin", "sync"), ("on_sample_end", "sleep"),
            ("on_sample_end", "give"), ("on_sample_end", "take"), ("on_step_end", "give")]
    assert trainer.rota_log == [("on_init_end", "take"), ("on_init_end", "sleep"), ("on_init_end", "give"),
                                ("on_validate_begin", "take"), ("on_validate_begin", "sync"),
                                ("on_validate_end", "sleep"), ("on_validate_end", "give"), *step, *step]
    assert trainer.checkpoint_manager.calls == [  # every replica call inside the job's turn
        ("sleep_replicas", True), ("update_weights", True), ("sleep_replicas", True),
        ("update_weights", True), ("sleep_replicas", True), ("update_weights", True), ("sleep_replicas", True)]
    assert held_in_update == [True, True]
    turns = [e for e in trainer.rota_gpu.stats.events if e[0] == "turn"]
    assert len(turns) == 2 + 2 * 2  # init, validation, and two (sampling, update) per step
    assert len(other_turns) >= len(turns)  # it ran after each of the job's turns: a real hand-off every time


def bare_engine():
    """rota's verl engine with a real module and Adam state set by hand (verl's __init__ needs torch.distributed)."""
    from verl.workers.config import FSDPEngineConfig

    from rota_verl.engine import RotaFSDPEngineWithLMHead

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-2)
    module(torch.randn(3, 8)).sum().backward()
    optimizer.step()
    engine = object.__new__(RotaFSDPEngineWithLMHead)
    engine.module, engine.optimizer, engine.engine_config = module, optimizer, FSDPEngineConfig()
    return engine


def test_the_engines_to_parks_and_restores_through_rota_torch() -> None:
    engine = bare_engine()
    params = list(engine.module.parameters())
    before = [t.detach().clone() for t in params] + [p.grad.clone() for p in params]
    state = [v.clone() for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    ids = [id(p) for p in params]

    engine.to("cpu", model=True, optimizer=True, grad=True)  # a train phase ends with offload on
    assert all(p.untyped_storage().nbytes() == 0 and p.grad.untyped_storage().nbytes() == 0 for p in params)
    assert all(v.untyped_storage().nbytes() == 0 for s in engine.optimizer.state.values() for v in s.values()
               if isinstance(v, torch.Tensor) and v.numel() > 1)
    assert all(p.parked for p in engine.rota_parkers().values())

    engine.to("cuda", model=True, optimizer=False, grad=False)  # an eval phase: weights only
    assert engine.rota_parkers()["optimizer"].parked and not engine.rota_parkers()["weights"].parked
    engine.to("cuda", model=True, optimizer=True, grad=True)  # a train phase
    after = [t.detach() for t in engine.module.parameters()] + [p.grad for p in engine.module.parameters()]
    assert [id(p) for p in engine.module.parameters()] == ids
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    restored = [v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert all(torch.equal(a, b) for a, b in zip(state, restored, strict=True))


def test_the_engines_own_methods_run_with_the_state_restored() -> None:
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    from rota_verl.engine import RESIDENT_METHODS, RotaFSDPEngineWithLMHead

    engine = bare_engine()
    engine.to("cpu")
    with engine.rota_resident():  # what save_checkpoint, load_checkpoint and the weight exports run in
        assert all(p.untyped_storage().nbytes() > 0 and p.grad is not None for p in engine.module.parameters())
        assert not any(p.parked for p in engine.rota_parkers().values())
    assert all(p.parked for p in engine.rota_parkers().values())  # parked again after
    wrapped = [name for name in RESIDENT_METHODS if hasattr(FSDPEngineWithLMHead, name)]
    assert wrapped == list(RESIDENT_METHODS)  # verl 0.9.1 has every one
    for name in wrapped:  # each is verl's own method, run inside rota_resident()
        assert RotaFSDPEngineWithLMHead.__dict__[name].__wrapped__ is getattr(FSDPEngineWithLMHead, name)
