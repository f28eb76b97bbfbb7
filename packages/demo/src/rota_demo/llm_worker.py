"""The LLM mode's work in a demo worker (``rota demo --engine hf|vllm``): what :func:`rota_demo.worker.worker_main`
and its loops call, in place of :class:`rota_demo.worker.ToyWork`.

An RL job is a GRPO loop: its engine process generates ``group`` samples for each of ``prompts`` questions with
the current policy (seeded per step, :mod:`rota_demo.llm_engines`), the verifier scores them off the device
(exact answers, :mod:`rota_demo.llm_tasks`), the trainer process (a ``rota_fsdp``-tracked
``Qwen3ForCausalLM``) takes the policy-gradient step, and the new weights reach the engine through the job's
push buffer before its next rollout (``hf``: copied into the engine's model; ``vllm``:
``TrackedLLM.update_weights``). The SFT job's trainer learns from generated examples; its engine evaluates
(greedy, exact-match accuracy on held-out questions) after every ``eval_every`` steps.

What the report calls a sampler's values are here the RL engines' mean rewards per step and the SFT engine's
accuracies; the trainers' are their losses.
"""

from __future__ import annotations

from typing import Any

import torch

from rota_demo import llm_engines as e
from rota_demo import llm_models as m
from rota_demo import llm_tasks as t
from rota_demo.push import WeightPush
from rota_demo.worker import DeviceTurns, WorkerReport, WorkerSpec, free_device_state, step_at_zero_lr

__all__ = ["EVAL_QUESTIONS", "LlmWork"]

EVAL_QUESTIONS = 32


class LlmWork:
    """One worker's side of an LLM job (trainer or engine), for the loops of :mod:`rota_demo.worker`."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec, self.size = spec, spec.size
        self.engine: e.HfEngine | e.VllmEngine | None = None

    # ------------------------------------------------------------------ setup

    def setup(self, dev: DeviceTurns, report: WorkerReport) -> tuple[Any, Any]:
        """Inside ``dev.setup()``: the trainer's model and AdamW, or the engine; warmed up and tracked."""
        spec, size = self.spec, self.size
        if spec.role == "trainer":
            model, opt = m.load_trainer(size, dev.device, optimizer=True)
            report.state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * 4
            tokens, mask = m.examples(size.task, spec.seed, 10**6, size.batch)
            tokens, mask = tokens.to(dev.device), mask.to(dev.device)
            if spec.kind == "rl":
                step_at_zero_lr(model, opt, lambda: m.grpo_step(model, opt, tokens, mask,
                                                                torch.zeros(size.batch, device=dev.device),
                                                                size.group))
            else:
                step_at_zero_lr(model, opt, lambda: m.sft_step(model, opt, tokens.cpu(), mask.cpu(),
                                                               spec.sft_turns, lambda last: _nothing()))
            dev.track(model, opt)
            return model, opt
        self.engine = e.make_engine(spec.engine, size.ckpt, dev.device, dev.gpu, spec.seed, size.engine_memory)
        self.engine.generate(t.prompts(size.task, spec.seed, 10**6, 2), 2, 1)  # warm: kernels, first allocations
        if isinstance(self.engine, e.HfEngine):
            report.state_bytes = sum(p.numel() * p.element_size() for p in self.engine.model.parameters())
            dev.track(self.engine.model, None)
        elif dev.gpu is not None:
            report.adapter = "rota_vllm"
        return self.engine, None

    def push_target(self, model: Any) -> Any:
        return model.push_target() if self.engine is not None else model

    def free(self, model: Any, opt: Any, dev: DeviceTurns) -> None:
        """At the end of the run, so that the next job granted has the room before this process exits: the
        trainer's and the hf engine's tensors are freed with the state held; a vLLM engine sleeps at level 2
        (weights and KV cache freed), through rota when it is tracked (:meth:`DeviceTurns.discard`)."""
        if self.engine is None or isinstance(self.engine, e.HfEngine):
            with dev.holding():
                free_device_state(model if self.engine is None else self.engine.model, opt)
        elif self.engine.tracked is not None:
            dev.discard(frozenset({"weights", "kv_cache"}))
        else:
            self.engine.llm.sleep(level=2)

    # ------------------------------------------------------------------ engine

    def take(self, engine: Any, push: WeightPush) -> Any:
        if isinstance(engine, e.HfEngine):
            push.read_into(engine.model)
            return engine.model
        push.read_with(engine.load)
        return None

    def rollout(self, engine: Any, step: int, device: str) -> Any:
        questions = t.prompts(self.size.task, self.spec.seed, step, self.size.prompts)
        return questions, engine.generate(questions, self.size.group, e.sample_seed(self.spec.seed, step))

    def judge(self, rollout: Any, step: int) -> tuple[Any, float]:
        questions, completions = rollout
        g = self.size.group
        rewards = torch.tensor([t.reward(questions[i // g], c) for i, c in enumerate(completions)])
        tokens, mask = m.rollout_batch(completions, questions, g)
        return (tokens, mask, rewards), float(rewards.mean())

    def held_out(self) -> Any:
        return t.prompts(self.size.task, self.spec.seed + 1, 10**7, EVAL_QUESTIONS)

    def evaluate(self, engine: Any, held: Any, device: str) -> float:
        completions = engine.generate(held, 1, 0, greedy=True)
        return sum(t.reward(q, c) for q, c in zip(held, completions, strict=True)) / len(held)

    # ------------------------------------------------------------------ trainer

    def rl_step(self, model: Any, opt: Any, payload: Any, device: str) -> float:
        tokens, mask, rewards = payload
        dev = next(model.parameters()).device
        return m.grpo_step(model, opt, tokens.to(dev), mask.to(dev), rewards.to(dev), self.size.group)

    def sft_data(self, step: int) -> Any:
        return m.examples(self.size.task, self.spec.seed, step, self.size.batch)

    def sft_step(self, model: Any, opt: Any, data: Any, turn: Any) -> float:
        tokens, mask = data
        return m.sft_step(model, opt, tokens, mask, self.spec.sft_turns, turn)


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()
