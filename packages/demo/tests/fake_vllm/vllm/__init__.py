"""A fake of ``vllm.LLM`` for CPU tests of ``rota demo --engine vllm`` (a fake, not vLLM: no paged attention,
no scheduler, no kernels of its own), put first on ``PYTHONPATH`` by the test only.

Why: no GPU runs in CI, and vLLM refuses sleep mode on CPU, so the demo's vLLM path (its engine class, the bf16
weight push through ``rota_vllm``'s ``update_weights``, parks and restores through ``rota_vllm.track`` inside
the worker loops) would otherwise run only on the GPU machine. What it keeps of vLLM's behaviour, as the demo
and rota_vllm use it:

* ``LLM(model=checkpoint, dtype=..., seed=..., enable_sleep_mode=True, gpu_memory_utilization=...)`` loads the
  Hugging Face checkpoint (``Qwen3ForCausalLM``) in that dtype;
* ``generate(prompts, sampling_params, use_tqdm)``: prompts as ``{"prompt_token_ids": [...]}``, one
  ``SamplingParams`` per prompt; each request samples from its own generator seeded by ``params.seed``
  (greedy at temperature 0) and stops at ``stop_token_ids`` (not returned; ``finish_reason`` "stop") or after
  ``max_tokens`` ("length"); the same batch gives the same tokens;
* ``sleep(level)``: level 1 keeps a host copy of the weights, level 2 nothing; then every parameter is
  overwritten with NaN in place, as a slept engine's device memory is gone (a weight read back that was not
  kept, or a generate while asleep, shows as NaN); ``wake_up(tags)`` puts back level 1's copy; vLLM maps the
  weights at the same addresses, so the fake keeps the same storages;
* ``collective_rpc(fn, args)`` runs ``fn(worker, *args)`` on its one worker, whose ``model_runner.model`` has
  ``load_weights(weights=[(Hugging Face name, tensor)])``; ``reset_prefix_cache()`` answers True;
* ``FAKE_VLLM_FAIL_GENERATE=N`` (tests only): each engine's N-th ``generate`` raises, as an engine that ran out of
  device memory would.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

__version__ = "0.26.0"
__all__ = ["LLM", "SamplingParams"]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    detokenize: bool = True


class _Model(torch.nn.Module):
    """The worker's model: the checkpoint's module, and vLLM's ``load_weights`` by Hugging Face names."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def load_weights(self, weights: Any) -> set[str]:
        own = self.hf.state_dict()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in own:
                    raise KeyError(f"fake vllm: no weight {name!r} in the model")
                own[name].copy_(tensor)
        return {name for name, _ in weights}


class LLM:
    def __init__(self, model: str, *, dtype: str = "bfloat16", seed: int = 0, enable_sleep_mode: bool = False,
                 gpu_memory_utilization: float = 0.9, **_: Any) -> None:
        from transformers import Qwen3ForCausalLM

        hf = Qwen3ForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype), attn_implementation="eager")
        hf.eval().requires_grad_(False)
        for p in hf.parameters():  # storages of its own, not the file's memory map (a tie is one parameter)
            p.data = p.data.clone()
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=_Model(hf)), device=torch.device("cpu"))
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(enable_sleep_mode=enable_sleep_mode),
            cache_config=SimpleNamespace(gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=None)))
        self.asleep: set[str] = set()  # the tags a sleep took and no wake_up has given back yet
        self._backup: dict[str, torch.Tensor] | None = None
        self._generates = 0  # FAKE_VLLM_FAIL_GENERATE=N: the N-th generate raises, as a real engine's OOM would

    @property
    def _hf(self) -> torch.nn.Module:
        return self.worker.model_runner.model.hf

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        if isinstance(method, str):
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]
        return [method(self.worker, *args, **(kwargs or {}))]

    def reset_prefix_cache(self) -> bool:
        return True

    def sleep(self, level: int = 1) -> None:
        if self.asleep:
            return
        params = dict(self._hf.named_parameters())
        self._backup = {n: p.detach().clone() for n, p in params.items()} if level == 1 else None
        with torch.no_grad():
            for p in params.values():
                p.fill_(math.nan)
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        woken = self.asleep & set(tags if tags is not None else self.asleep)
        if "weights" in woken and self._backup is not None:
            with torch.no_grad():
                for n, p in self._hf.named_parameters():
                    p.copy_(self._backup[n])
            self._backup = None
        self.asleep -= woken

    def generate(self, prompts: list[dict], sampling_params: Any = None, use_tqdm: bool = False) -> list[Any]:
        if self.asleep:
            raise RuntimeError(f"fake vllm: generate while {sorted(self.asleep)} sleep (wake_up first)")
        self._generates += 1
        if self._generates == int(os.environ.get("FAKE_VLLM_FAIL_GENERATE") or 0):
            raise RuntimeError("fake vllm: CUDA out of memory (FAKE_VLLM_FAIL_GENERATE)")
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params or SamplingParams()] \
            * len(prompts)
        outs: list[Any] = [None] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_length.setdefault(len(p["prompt_token_ids"]), []).append(i)
        for rows in by_length.values():
            for i, (ids, reason) in zip(rows, self._sample([prompts[i]["prompt_token_ids"] for i in rows],
                                                          [params[i] for i in rows]), strict=True):
                outs[i] = SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, finish_reason=reason)])
        return outs

    def _sample(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], str]]:
        gens = [torch.Generator().manual_seed(sp.seed) if sp.seed is not None else None for sp in params]
        ids = torch.tensor(prompts)
        new: list[list[int]] = [[] for _ in prompts]
        done: list[str | None] = [None] * len(prompts)
        with torch.no_grad():
            for _ in range(max(sp.max_tokens for sp in params)):
                logits = self._hf(input_ids=ids).logits[:, -1].float()
                if not torch.isfinite(logits).all():
                    raise RuntimeError("fake vllm: the weights hold NaN (read after a sleep that did not keep them)")
                picks = []
                for r, sp in enumerate(params):
                    if sp.temperature == 0:
                        tok = int(logits[r].argmax())
                    else:
                        probs = torch.softmax(logits[r] / sp.temperature, dim=-1)
                        tok = int(torch.multinomial(probs, 1, generator=gens[r]))
                    picks.append(tok)
                    if done[r] is None:
                        if tok in sp.stop_token_ids:
                            done[r] = "stop"
                        else:
                            new[r].append(tok)
                            if len(new[r]) >= sp.max_tokens:
                                done[r] = "length"
                if all(d is not None for d in done):
                    break
                ids = torch.cat([ids, torch.tensor(picks).unsqueeze(1)], dim=1)
        return [(n, d or "length") for n, d in zip(new, done, strict=True)]
