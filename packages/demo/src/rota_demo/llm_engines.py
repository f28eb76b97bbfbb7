"""The LLM mode's inference engines, one per job, in the job's engine process (``rota demo --engine ...``).

* ``hf``: a **stand-in for an inference engine**, not vLLM: the trainer's own model class
  (``Qwen3ForCausalLM.from_pretrained`` of the same checkpoint, fp32, eager attention) running transformers'
  ``generate``. rota parks it like any torch tenant (``rota_fsdp.track`` of the model, no optimizer). It is what
  runs on CPU and in CI.
* ``vllm``: ``vllm.LLM`` in-process (``enable_sleep_mode=True``, bf16, eager, no prefix cache, tokenizer skipped:
  prompts go as token ids), tracked with ``rota_vllm.track``; new weights arrive through
  ``TrackedLLM.update_weights`` (``collective_rpc`` into each worker's ``load_weights``). Needs a GPU and vLLM
  (0.26.0 on the H200); it cannot run on CPU (vLLM refuses sleep mode there: :func:`sleep_mode_available`), but
  for the CPU tests' fake of ``vllm.LLM``.

Determinism (the time-sliced run must equal the dedicated one step for step): every rollout is seeded from
(job seed, step) only. ``hf`` reseeds torch's global generator (``torch.manual_seed``, all devices) right before
each ``generate``: nothing else in the engine process draws from it, and a park or restore copies bytes without
touching it, so the same weights give the same samples. ``vllm`` sends one request per sample with
``SamplingParams(seed=...)`` (vLLM's per-request generator) and the same batch in every mode; its kernels are
deterministic for the same batch on the same device, which the CUDA-tier test checks rather than assumes.
Evaluation is greedy in both.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from rota_demo import llm_tasks as t

__all__ = ["ENGINES", "PUSH_DTYPE", "HfEngine", "VllmEngine", "VllmMissing", "make_engine", "preload",
           "sleep_mode_available"]

ENGINES = ("hf", "vllm")
#: the dtype weights travel in from the trainer to each engine: vLLM holds bf16 weights (its load rounds fp32 to
#: bf16 as the trainer's copy into a bf16 buffer does), so half the host buffer and copy; hf keeps fp32
PUSH_DTYPE: dict[str, str | None] = {"hf": None, "vllm": "bfloat16"}


class VllmMissing(RuntimeError):
    """``--engine vllm`` without vLLM importable."""


def sleep_mode_available() -> bool:
    """Whether the installed vLLM offers sleep mode on this machine's platform (vLLM's own answer: on CUDA only;
    the CPU tests' fake answers yes); False without vLLM."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return bool(current_platform.is_sleep_mode_available())


def preload(engine: str, role: str) -> None:
    """Import what a worker of the LLM mode builds with, before its set-up turn: a build runs inside a turn, which
    holds the device for the whole group, and on the H100 host about 23 s of each engine's set-up turn passed
    before vLLM's first line, mostly importing it (transformers' Qwen3 costs a trainer a few seconds more).
    Imports only: no CUDA, no model. Without vLLM nothing is raised here; the build says what is missing
    (:class:`VllmMissing`)."""
    from transformers import Qwen3ForCausalLM  # noqa: F401  (the trainer's model; every engine's push target)

    if engine == "vllm" and role == "sampler":
        _vllm_env()
        with contextlib.suppress(ImportError):
            from vllm import LLM, SamplingParams  # noqa: F401  (vllm's own attributes load lazily: these do)

            import rota_vllm  # noqa: F401


def _vllm_env() -> None:
    """The in-process engine's settings, unless the caller set them (bench/engines/vllm-0.26.0.toml's env)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: collective_rpc runs here
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")


def sample_seed(seed: int, step: int, index: int = 0) -> int:
    """The seed of one rollout (hf: the whole batch; vllm: sample ``index`` of it)."""
    return (seed * 1_000_003 + step * 10_007 + index) % (2**31 - 1)


class HfEngine:
    """transformers' ``generate`` on the trainer's model class: the CPU stand-in for an inference engine."""

    name = "hf"

    def __init__(self, path: str, device: str) -> None:
        import torch
        from transformers import Qwen3ForCausalLM

        from rota_demo.llm_models import own_storages

        self.model = own_storages(Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                                   attn_implementation="eager",
                                                                   device_map=device)).eval()
        self.model.requires_grad_(False)

    def push_target(self) -> Any:
        """What the weight push binds to: the model itself (same class and dtype as the trainer's)."""
        return self.model

    def generate(self, questions: list[str], n: int, seed: int, *, greedy: bool = False) -> list[list[int]]:
        """``n`` completions per question (question-major), each up to ``MAX_NEW`` tokens."""
        import torch

        dev = next(self.model.parameters()).device
        ids = torch.tensor([[t.BOS, *t.encode(q)] for q in questions], device=dev).repeat_interleave(n, 0)
        torch.manual_seed(seed)  # generate samples from the global generator: reseeded for every rollout
        with torch.no_grad():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=not greedy,
                                      temperature=1.0 if not greedy else None, top_k=0 if not greedy else None,
                                      top_p=1.0 if not greedy else None, max_new_tokens=t.MAX_NEW,
                                      eos_token_id=t.EOS, pad_token_id=t.PAD)
        return [row[t.PROMPT_LEN:] for row in out.cpu().tolist()]


def _load_on_worker(worker: Any, named: list[tuple[str, Any]]) -> None:
    """Inside a vLLM worker (``collective_rpc``), with no rota tenant (the dedicated run): load the weights."""
    worker.model_runner.model.load_weights(weights=named)


class VllmEngine:
    """``vllm.LLM`` in this process, tracked by rota when the job shares the device."""

    name = "vllm"

    def __init__(self, path: str, gpu: Any, seed: int, memory: float) -> None:
        _vllm_env()
        try:
            import vllm
        except ImportError as exc:
            raise VllmMissing(f"--engine vllm needs vLLM on a CUDA machine ({exc}); pip install vllm (0.26.0 is "
                              "staged for the H200 by bench/stage_wheels.py), or use --engine hf, the "
                              "transformers stand-in") from None
        self._vllm = vllm
        self.path = path
        self.llm = vllm.LLM(model=path, skip_tokenizer_init=True, enable_sleep_mode=True, dtype="bfloat16",
                            seed=seed, enforce_eager=True, enable_prefix_caching=False,
                            gpu_memory_utilization=memory, max_model_len=t.PROMPT_LEN + t.MAX_NEW + 8,
                            max_num_seqs=256)
        self.tracked = None
        if gpu is not None:
            import rota_vllm

            self.tracked = rota_vllm.track(gpu, self.llm)

    def push_target(self) -> Any:
        """The trainer's model on the meta device: the push buffer's layout (trainer's state dict) without memory."""
        import torch
        from transformers import AutoConfig, Qwen3ForCausalLM

        with torch.device("meta"):
            return Qwen3ForCausalLM._from_config(AutoConfig.from_pretrained(self.path), dtype=torch.float32)

    def load(self, named: list[tuple[str, Any]]) -> None:
        """New weights (host tensors of the push buffer, HF names) into every worker's model."""
        if self.tracked is not None:
            self.tracked.update_weights(named)
        else:
            self.llm.collective_rpc(_load_on_worker, args=(named,))

    def generate(self, questions: list[str], n: int, seed: int, *, greedy: bool = False) -> list[list[int]]:
        sp = self._vllm.SamplingParams
        params = [sp(n=1, temperature=0.0 if greedy else 1.0, top_p=1.0, seed=None if greedy else seed + i,
                     max_tokens=t.MAX_NEW, stop_token_ids=[t.EOS], detokenize=False)
                  for i in range(len(questions) * n)]
        prompts = [{"prompt_token_ids": [t.BOS, *t.encode(q)]} for q in questions for _ in range(n)]
        outs = self.llm.generate(prompts, sampling_params=params, use_tqdm=False)
        comps = []
        for o in outs:
            ids = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and t.EOS not in ids:  # stopped at EOS, not returned with it
                ids.append(t.EOS)
            comps.append(ids)
        return comps


def make_engine(engine: str, path: str, device: str, gpu: Any, seed: int, memory: float) -> HfEngine | VllmEngine:
    if engine == "hf":
        return HfEngine(path, device)
    if engine == "vllm":
        return VllmEngine(path, gpu, seed, memory)
    raise ValueError(f"engine {engine!r}: choose from {', '.join(ENGINES)}")
