"""RotaCallback's contract, in process, against a real orchestrator (the ``connect`` fixture) and real TRL.

The TRL range check, the refusals of setups whose memory rota cannot free, where evaluation and checkpoints
run (inside the turn), what ``train()`` leaves (an untracked model on its device), ``off_turn`` (sync and
async, outside training, with two trainers in a process) and the colocated vLLM engine's park check, against
a named fake LLM: vLLM cannot run here (TRL's vllm extra stops at 0.31; the CPU build of the heavy tier is
0.32), so the H200 tier (tests/cuda/test_trl_cuda.py) runs the real engine.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import pathlib
import threading

import pytest
import tomllib
import torch
from transformers import AutoModelForCausalLM, Qwen3Config, Trainer, TrainerCallback, TrainingArguments
from trl import GRPOConfig

import rota_trl
from rota_trl._offturn import register_active, unregister_active

PYPROJECT = pathlib.Path(__file__).parents[1] / "pyproject.toml"


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(Qwen3Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=32))


def test_the_trl_range_is_the_dependency_in_pyproject_and_checked() -> None:
    deps = tomllib.loads(PYPROJECT.read_text())["project"]["dependencies"]
    (trl_dep,) = [d for d in deps if d.startswith("trl")]
    assert rota_trl.trl_spec() == trl_dep.removeprefix("trl") == ">=1.10,<1.17"
    assert rota_trl.require_trl() == importlib.metadata.version("trl")


def test_an_unsupported_trl_is_refused_when_training_starts(monkeypatch, tmp_path) -> None:
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "1.9.2" if name == "trl" else real(name))
    callback = rota_trl.RotaCallback()
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(rota_trl.UnsupportedVersion) as err:
        callback.on_train_begin(args, None, None, model=tiny_model(), optimizer=None)
    assert "trl 1.9.2" in str(err.value) and 'pip install "trl>=1.10,<1.17"' in str(err.value)
    assert callback.gpu is None  # refused before it joined rota


def test_colocated_vllm_needs_its_sleep_mode_and_the_trainer(tmp_path) -> None:
    def args(sleep: bool) -> GRPOConfig:
        return GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[], use_vllm=True,
                          vllm_mode="colocate", vllm_enable_sleep_mode=sleep)

    with pytest.raises(ValueError, match="vllm_enable_sleep_mode=True"):
        rota_trl.RotaCallback().on_train_begin(args(False), None, None, model=tiny_model(), optimizer=None)
    with pytest.raises(ValueError, match=r"RotaCallback\(trainer\)"):
        rota_trl.RotaCallback().on_train_begin(args(True), None, None, model=tiny_model(), optimizer=None)


class Watch(TrainerCallback):
    """Added after RotaCallback: records whether the job held its turn at each event (what follows it runs so)."""

    def __init__(self, rota_cb: rota_trl.RotaCallback) -> None:
        self.rota_cb, self.seen = rota_cb, []

    def _note(self, event: str, state) -> None:
        self.seen.append((event, state.global_step, self.rota_cb.holding))

    def on_step_begin(self, args, state, control, **kw):
        self._note("step_begin", state)

    def on_step_end(self, args, state, control, **kw):
        self._note("step_end", state)

    def on_evaluate(self, args, state, control, **kw):
        self._note("evaluate", state)

    def on_save(self, args, state, control, **kw):
        self._note("save", state)


def test_a_plain_trainer_evaluates_and_saves_inside_its_turn_and_ends_untracked(connect, tmp_path) -> None:
    gpu, other = connect("trainer"), connect("other")
    data = [{"input_ids": torch.arange(i, i + 8) % 64, "labels": torch.arange(i, i + 8) % 64} for i in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=4,
                             per_device_train_batch_size=2, eval_strategy="steps", eval_steps=2,
                             save_strategy="steps", save_steps=2, logging_steps=1, disable_tqdm=True)
    model = tiny_model()
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:2])
    callback = rota_trl.RotaCallback(gpu=gpu)
    watch = Watch(callback)
    trainer.add_callback(callback)
    trainer.add_callback(watch)
    trainer.train()

    assert ("step_end", 1, False) in watch.seen and ("step_end", 3, False) in watch.seen  # given back
    assert ("step_end", 2, True) in watch.seen and ("step_end", 4, True) in watch.seen  # kept: eval + save follow
    assert [held for event, _, held in watch.seen if event in ("evaluate", "save", "step_begin")] == [True] * 8
    assert callback.steps == 4 and callback.handles == [] and not callback.holding
    assert all(p.untyped_storage().nbytes() > 0 for p in model.parameters())  # resident, not parked
    with other.turn():  # the group is free and the trainer's state is not rota's any more
        pass
    trainer.evaluate()  # an ordinary model again
    assert gpu.stats.turns >= 4


def test_off_turn_gives_the_turn_to_another_job_and_takes_it_back(connect) -> None:
    gpu, other = connect("slow"), connect("other")
    callback = rota_trl.RotaCallback(gpu=gpu)
    seen = []

    def judge(completions, **kw):
        seen.append(callback.holding)
        with other.turn():  # another job gets the device while the judge runs (it would block otherwise)
            seen.append(other.grant is not None)
        return [1.0] * len(completions)

    async def async_judge(completions, **kw):
        return judge(completions)

    callback.take_turn()
    assert callback.off_turn(judge)(completions=["a", "b"]) == [1.0, 1.0]
    assert callback.holding and seen == [False, True]
    assert asyncio.run(callback.off_turn(async_judge)(completions=["a"])) == [1.0]
    assert callback.holding and seen == [False, True, False, True]
    assert len(callback.gate.intervals) == 2

    def broken(completions, **kw):
        raise RuntimeError("sandbox down")

    with pytest.raises(RuntimeError, match="sandbox down"):
        callback.off_turn(broken)(completions=[])
    assert callback.holding  # taken again before the error went on
    callback.give_turn()


def test_off_turn_keeps_the_reward_name_and_kind_trl_reads() -> None:
    from trl.trainer.utils import is_async_callable

    def slow_judge(completions, **kw):
        return [0.0] * len(completions)

    async def async_judge(completions, **kw):
        return [0.0] * len(completions)

    assert rota_trl.off_turn(slow_judge).__name__ == "slow_judge"  # TRL's rewards/<name>/mean metrics
    assert is_async_callable(rota_trl.off_turn(async_judge)) and not is_async_callable(rota_trl.off_turn(slow_judge))
    assert rota_trl.off_turn(slow_judge)(completions=["x"]) == [0.0]  # no training: it just runs
    with pytest.raises(TypeError, match="needs a callable"):
        rota_trl.off_turn("judge")


def test_off_turn_with_two_trainers_in_a_process_asks_to_bind_it() -> None:
    first, second = rota_trl.RotaCallback(), rota_trl.RotaCallback()
    errors = []

    def elsewhere() -> None:
        try:
            rota_trl.off_turn(lambda: None)()
        except RuntimeError as exc:
            errors.append(str(exc))

    register_active(first)
    register_active(second)
    try:
        t = threading.Thread(target=elsewhere)
        t.start()
        t.join()
    finally:
        unregister_active(first)
        unregister_active(second)
    assert errors and "callback.off_turn(fn)" in errors[0]


class FakeLLM:
    """A fake of vLLM's ``LLM`` (``llm_engine.is_sleeping()``, ``vllm_config``): no vLLM runs here."""

    class Engine:
        def __init__(self) -> None:
            self.sleeping = False
            self.vllm_config = None

        def is_sleeping(self) -> bool:
            return self.sleeping

    def __init__(self) -> None:
        self.llm_engine = self.Engine()


def test_a_park_verifies_trls_sleep_of_the_colocated_engine(connect) -> None:
    gpu = connect("grpo")
    llm = FakeLLM()
    engine = rota_trl.ColocatedEngine(gpu, llm)
    gpu.pm.register(engine, name=engine.name)
    try:
        assert gpu.footprint() == {"vllm_engine": 1}
        with pytest.raises(rota_trl.EngineAwake, match="vllm_enable_sleep_mode=True"):
            gpu.park()
        assert not gpu.parked and engine.parks == 0
        llm.llm_engine.sleeping = True  # what TRL does after every generation
        gpu.park()
        assert gpu.parked and engine.parks == 1
    finally:
        gpu.pm.unregister(name=engine.name)
