"""Sampling: the sample requests of one turn decoded together as one batch, each with its own parameters.

Used by the sampler worker (:class:`rota_tinker._worker.roles.Sampler`), one call per model: a single
request and several queued ones go through the same :func:`sample`. Every request contributes
its ``num_samples`` rows; prompts of different lengths are left-padded, and an attention mask
and position ids counted from each row's first real token keep each row to its own tokens.
Each request keeps its own temperature, top-k, top-p, ``max_tokens``, stop tokens and strings
and its own seeded ``torch.Generator``, drawn in the same order as when it runs alone.

A batch decodes a step at a time (:class:`Decoding`): the batched LoRA worker interleaves its steps with other
tenants' training (:mod:`rota_tinker._worker.passes`), and a step computes a bounded number of positions (a long
prompt is fed to a cached model in chunks). What one request brings cannot fail the others: its parameters are
checked where they are read (:func:`check_params`), and a row whose draw fails (logits that are not finite, from
weights that diverged) fails that request alone while the others go on.

Whether a row's logits are bit-identical alone and in a padded batch depends on the kernels
(a batched matmul may sum in another order): the service's tests check it for the tiny models
on CPU; on other devices expect the last bits of logprobs to differ, and so, rarely, a token
drawn at a near tie.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rota_tinker._worker.common import MAX_TOPK, MIN_TEMPERATURE, UserError
from rota_tinker._worker.models import lora_compute_dtype, lora_in_base_precision

__all__ = ["Decoding", "check_params", "decode_batches", "needs_prompt_logits", "sample"]

MASK_LOGPROB = -99999.0  # the SDK's filler for a top-k cell that holds nothing (tinker.types.topk_logprobs)


def check_params(params: dict[str, Any]) -> None:
    """Refuse sampling parameters that no row can be decoded with (the HTTP front end checks them first; a worker
    checks again where it reads them, so one request's numbers never reach a batch it shares).

    :raises UserError: naming the parameter and its bounds.
    """
    def number(name: str, default: float) -> float:
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise UserError(f"sampling_params.{name}={str(value)[:40]} must be a finite number")
        return float(value)

    temperature = number("temperature", 1.0)
    if temperature != 0 and not temperature >= MIN_TEMPERATURE:
        raise UserError(f"sampling_params.temperature={temperature:g} must be 0 (greedy) or at least "
                        f"{MIN_TEMPERATURE:g}")
    if not 0 < number("top_p", 1.0) <= 1:
        raise UserError(f"sampling_params.top_p={params.get('top_p')} must be within (0, 1]")
    for name, lo, hi in (("top_k", -1, 2**31), ("max_tokens", 1, 2**31), ("topk_sample", 0, MAX_TOPK),
                         ("topk_prompt", 0, MAX_TOPK), ("alt_k", 0, MAX_TOPK)):
        value = params.get(name) or (lo if name != "top_k" else -1)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi or (name == "top_k"
                                                                                             and value == 0):
            raise UserError(f"sampling_params.{name}={str(value)[:40]} must be an integer within [{lo}, {hi}]"
                            + (" other than 0" if name == "top_k" else ""))


def needs_prompt_logits(params: dict[str, Any]) -> bool:
    """Whether a request asks for anything computed at its prompt positions (so its batch keeps every logit)."""
    return bool(params.get("prompt_logprobs") or params.get("topk_prompt") or params.get("alt_k")
                or params.get("target") is not None)


class _Decoder:
    """Next-token logits of a batch of rows that grow together, their prompts left-padded to one width.

    A Hugging Face model (it has a ``config``) keeps its KV cache between steps, and takes its prompts in chunks
    (:meth:`prefill`); the test transformer recomputes the whole batch every step. Rows that have finished are fed
    a masked filler token.
    """

    def __init__(self, model: nn.Module, prompts: list[torch.Tensor], device: torch.device) -> None:
        self.model = model
        self.cached = getattr(model, "config", None) is not None
        self.lora_dtype = lora_compute_dtype(model)  # once, not at every token
        width = max(len(p) for p in prompts)
        self.seqs = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
        self.mask = torch.zeros_like(self.seqs)
        for row, p in enumerate(prompts):
            self.seqs[row, width - len(p):] = p
            self.mask[row, width - len(p):] = 1
        self.past: Any = None
        self.fed = 0  # columns of the prompts in the KV cache so far (a cached model)

    def lengths(self) -> list[int]:
        """Each row's real tokens (prompt and sampled)."""
        return self.mask.sum(1).tolist()

    def prefill(self, max_positions: int, keep_rows: list[int]) -> tuple[int, torch.Tensor | None,
                                                                         torch.Tensor | None]:
        """Feed the next chunk of the prompts: a cached model at most ``max_positions`` positions (rows x columns,
        at least one column), the test transformer all of them. Returns (positions computed; float32 logits of
        ``keep_rows`` at every position of the chunk, on the CPU, or None; each row's last logits once the whole
        prompt is in, else None)."""
        rows, width = self.seqs.shape
        a = self.fed
        b = min(width, a + max(1, max_positions // rows)) if self.cached else width
        logits = self._forward(slice(a, b), every_position=bool(keep_rows))
        self.fed = b
        kept = logits[keep_rows].float().cpu() if keep_rows else None
        last = logits[:, -1].float().cpu() if b == width else None
        return rows * ((b - a) if self.cached else width), kept, last

    def next_logits(self) -> tuple[int, torch.Tensor]:
        """``[rows, vocab]`` float32 logits of each row's next token, on the CPU; and the positions computed."""
        rows, width = self.seqs.shape
        logits = self._forward(slice(width - 1, width), every_position=False)
        return (rows if self.cached else rows * width), logits[:, -1].float().cpu()

    def _forward(self, columns: slice, every_position: bool) -> torch.Tensor:
        positions = (self.mask.cumsum(1) - 1).clamp(min=0)
        with lora_in_base_precision(self.model, self.lora_dtype):  # as the trainer computes them
            if self.cached:
                out = self.model(self.seqs[:, columns], attention_mask=self.mask[:, :columns.stop],
                                 position_ids=positions[:, columns], past_key_values=self.past, use_cache=True,
                                 logits_to_keep=0 if every_position else 1)
                self.past = out.past_key_values
                return out.logits
            return self.model(self.seqs, attention_mask=self.mask, position_ids=positions)

    def append(self, tokens: list[int], alive: list[bool]) -> None:
        """One more token per row (a finished row's is masked out)."""
        dev = self.seqs.device
        self.seqs = torch.cat([self.seqs, torch.tensor(tokens, device=dev).unsqueeze(1)], dim=1)
        self.mask = torch.cat([self.mask, torch.tensor(alive, dtype=torch.long, device=dev).unsqueeze(1)], dim=1)

    def release(self) -> None:
        """Let the KV cache go (the batch is done)."""
        self.past = None


@dataclass
class _Request:
    """One sample request in a decode batch: its rows ``first .. first + n - 1`` and its own parameters."""

    first: int
    n: int
    prompt: torch.Tensor
    params: dict[str, Any]
    gen: torch.Generator
    toks: list[list[int]] = field(init=False)  # per row: the tokens drawn so far
    lps: list[list[float]] = field(init=False)  # per row: their logprobs
    reasons: list[str] = field(init=False)  # per row: "" while decoded, then "stop", "length" (or "error")
    topk: list[list[tuple[np.ndarray, np.ndarray]]] = field(init=False)  # per row, per token: its top-k
    error: Exception | None = field(init=False, default=None)  # what failed this request (its rows only)

    def __post_init__(self) -> None:
        p = self.params
        check_params(p)
        self.temperature = float(p.get("temperature", 1.0))
        self.top_k, self.top_p = int(p.get("top_k", -1)), float(p.get("top_p", 1.0))
        self.max_tokens = int(p.get("max_tokens") or 16)
        self.stop, self.stop_strings = set(p.get("stop_tokens") or ()), list(p.get("stop_strings") or ())
        self.toks, self.lps = [[] for _ in range(self.n)], [[] for _ in range(self.n)]
        self.reasons = [""] * self.n
        self.topk_sample = int(p.get("topk_sample") or 0)
        self.topk = [[] for _ in range(self.n)]

    def fail(self, e: Exception, logits: torch.Tensor | None = None) -> None:
        """This request fails (its rows stop); the batch's other requests go on."""
        rows = slice(self.first, self.first + self.n)
        if logits is not None and not bool(torch.isfinite(logits[rows]).all()):
            e = UserError(f"sampling failed: this request's logits are not finite ({type(e).__name__}: "
                          f"{str(e)[:200]}); the weights it samples from may have diverged")
        self.error, self.reasons = e, ["error"] * self.n

    def step(self, logits: torch.Tensor, logp: torch.Tensor, lengths: list[int], max_len: int,
             tokenizer: Any) -> list[int]:
        """Pick the next token of each of this request's rows (0 for a finished one), in row order; a failure
        fails this request alone."""
        if self.error is not None:
            return [0] * self.n
        try:
            return self._step(logits, logp, lengths, max_len, tokenizer)
        except Exception as e:
            self.fail(e, logits)
            return [0] * self.n

    def _step(self, logits: torch.Tensor, logp: torch.Tensor, lengths: list[int], max_len: int,
              tokenizer: Any) -> list[int]:
        out = []
        for i, row in enumerate(range(self.first, self.first + self.n)):
            if not self.reasons[i] and lengths[row] >= max_len:  # the prompt fills the context already
                self.reasons[i] = "length"
            if self.reasons[i]:
                out.append(0)
                continue
            t = _pick(logits[row], self.temperature, self.top_k, self.top_p, self.gen)
            self.toks[i].append(t)
            self.lps[i].append(float(logp[row, t]))
            if self.topk_sample:
                self.topk[i].append(_topk(logp[row], self.topk_sample))
            out.append(t)
            if t in self.stop or (self.stop_strings and _stopped_by_text(tokenizer, self.toks[i], self.stop_strings)):
                self.reasons[i] = "stop"
            elif len(self.toks[i]) >= self.max_tokens or lengths[row] + 1 >= max_len:
                self.reasons[i] = "length"
        return out

    def result(self, prompt_out: dict[str, Any], rows: int) -> dict[str, Any] | Exception:
        if self.error is not None:
            return self.error
        seqs = [(np.asarray(t, np.int32), np.asarray(lp, np.float32), r, _stack(k, self.topk_sample))
                for t, lp, r, k in zip(self.toks, self.lps, self.reasons, self.topk, strict=True)]
        return {"sequences": seqs, "prompt_logprobs": None, **prompt_out, "rows": rows}


class Decoding:
    """One decode batch of ``requests`` (``{"prompt", "params", "num_samples", "seed"}`` each), a step at a time.

    Each :meth:`step` is one forward of the model: the next chunk of the prompts, or the next token of every row;
    ``around()`` is entered around it (the batched LoRA worker puts its rows' adapters in place there). Once
    :attr:`done`, :meth:`results` gives each request's result (see :func:`sample`) or the exception that failed
    that request alone. ``steps`` and ``positions`` count what it computed.

    :raises UserError: a request's parameters are out of bounds (:func:`check_params`; callers check each request
        first, so one that fails does not take the others with it).
    """

    def __init__(self, model: nn.Module, requests: list[dict[str, Any]], device: torch.device, max_len: int,
                 tokenizer: Any = None, around: Callable[[], AbstractContextManager[Any]] | None = None) -> None:
        self.reqs, first = [], 0
        for r in requests:
            prompt = torch.as_tensor(np.asarray(r["prompt"]), dtype=torch.long, device=device)
            self.reqs.append(_Request(first, r["num_samples"], prompt, r["params"],
                                      torch.Generator(device="cpu").manual_seed(r["seed"])))
            first += r["num_samples"]
        self.rows, self.seeds = first, [r["seed"] for r in requests]
        self.max_len, self.tokenizer = max_len, tokenizer
        self.around = around or nullcontext
        self.decoder = _Decoder(model, [q.prompt for q in self.reqs for _ in range(q.n)], device)
        self.want = [needs_prompt_logits(q.params) for q in self.reqs]
        self.keep_rows = [q.first for q, want in zip(self.reqs, self.want, strict=True) if want]
        self.prompt_chunks: list[torch.Tensor] = []  # the kept rows' logits at every prompt position, by chunk
        self.prompt_outs: list[dict[str, Any]] = [{} for _ in self.reqs]
        self.prefilled, self.done = False, False
        self.steps = self.positions = 0
        self.seconds = 0.0  # spent in its steps
        self.pinned: list[str] = []  # what its caller holds for it until it ends (the batched worker's weights)

    def step(self, max_positions: int = 1 << 62) -> int:
        """One forward (a prompt chunk of at most ``max_positions`` positions, or a token of every row) and the
        draws that follow it; the positions it computed."""
        t0 = time.monotonic()
        with self.around(), torch.no_grad():
            if not self.prefilled:
                n, kept, last = self.decoder.prefill(max_positions, self.keep_rows)
                if kept is not None:
                    self.prompt_chunks.append(kept)
                if last is not None:
                    self.prefilled = True
                    self._prompt_outputs()
                    self._draw(last)
            else:
                n, logits = self.decoder.next_logits()
                self._draw(logits)
        self.steps += 1
        self.positions += n
        self.seconds += time.monotonic() - t0
        return n

    def _prompt_outputs(self) -> None:
        if not self.prompt_chunks:
            return
        every = torch.cat(self.prompt_chunks, dim=1)  # [kept rows, width, vocab]
        self.prompt_chunks = []
        k = 0
        for j, (q, want) in enumerate(zip(self.reqs, self.want, strict=True)):
            if not want:
                continue
            try:
                self.prompt_outs[j] = _prompt_outputs(every[k], q.prompt.cpu(), q.params, self.seeds[j])
            except Exception as e:  # this request alone
                q.fail(e, every[k])
            k += 1

    def _draw(self, logits: torch.Tensor) -> None:
        logp = F.log_softmax(logits, dim=-1)
        lengths = self.decoder.lengths()
        nxt = [t for q in self.reqs for t in q.step(logits, logp, lengths, self.max_len, self.tokenizer)]
        alive = [not reason for q in self.reqs for reason in q.reasons]
        if any(alive):
            self.decoder.append(nxt, alive)
        else:
            self.done = True
            self.decoder.release()

    def results(self) -> list[dict[str, Any] | Exception]:
        return [q.result(out, self.rows) for q, out in zip(self.reqs, self.prompt_outs, strict=True)]


def sample(model: nn.Module, requests: list[dict[str, Any]], device: torch.device, max_len: int,
           tokenizer: Any = None) -> list[dict[str, Any] | Exception]:
    """Decode ``requests`` (``{"prompt", "params", "num_samples", "seed"}`` each) as one batch; a result each, or the
    exception that failed that request alone.

    A result is ``{"sequences": [(tokens, logprobs, "stop" | "length", top-k or None), ...], "rows": rows of the
    decode batch}`` plus what :func:`_prompt_outputs` gives for the prompt. ``params``:
    temperature (0: greedy), top_k, top_p, max_tokens, stop_tokens, stop_strings (matched on the
    text ``tokenizer`` decodes; the token completing one is kept); the outputs asked for: prompt_logprobs,
    topk_prompt (k), topk_sample (k: each sampled token's top-k, ``(ids [n, k], logprobs [n, k])``), target
    (``[len(prompt) - 1, K]`` ids, -1 for none), alt_k, last_n. No row grows past ``max_len``.
    """
    decoding = Decoding(model, requests, device, max_len, tokenizer)
    while not decoding.done:
        decoding.step()
    return decoding.results()


def decode_batches(requests: list[dict[str, Any]], max_logit_rows: int) -> list[list[int]]:
    """``requests`` (by index, in order) in as few consecutive decode batches as fit: a batch that computes prompt
    logprobs has logits at every prompt position of every row, so its rows x prompt width stays within
    ``max_logit_rows`` (a single request always makes a batch); others are not split."""
    def logit_rows(batch: list[int]) -> int:
        if not any(needs_prompt_logits(requests[i]["params"]) for i in batch):
            return 0
        return sum(requests[i]["num_samples"] for i in batch) * max(len(requests[i]["prompt"]) for i in batch)

    batches: list[list[int]] = []
    for i in range(len(requests)):
        if batches and logit_rows([*batches[-1], i]) <= max_logit_rows:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def _prompt_outputs(logits: torch.Tensor, prompt: torch.Tensor, params: dict[str, Any], seed: int) -> dict[str, Any]:
    """What a request asks for at its prompt positions, from its row's ``[width, vocab]`` logits (prompt
    right-aligned). Position ``i`` of ``own`` is the distribution of prompt token ``i + 1``.

    * ``prompt_logprobs``: ``[len(prompt)]`` log p(prompt[t] | prompt[:t]), NaN where not scored (the first token;
      with ``last_n`` all but the last ``last_n``);
    * ``topk_prompt``: ``(ids, logprobs)``, each ``[len(prompt), k]``, best first; unscored positions (as above)
      and columns past the vocabulary hold token 0 and :data:`MASK_LOGPROB`;
    * ``target_prompt_logprobs``: the logprobs of the ``[len(prompt) - 1, K]`` ids asked for (0.0 where -1);
    * ``prompt_alt``: ``(tokens, logprobs)``, each ``[len(prompt) - 1, alt_k]``: draws with replacement at the
      request's temperature (greedy at 0) and the model's logprob of each; they come from a generator of their
      own (seeded like the request), so the sampled rows are the same with and without them.
    """
    n = len(prompt)
    scaled_logits = logits[logits.shape[0] - n:-1]
    own = F.log_softmax(scaled_logits, dim=-1)
    last_n = params.get("last_n")
    skip = n - int(last_n) if last_n else 1  # positions before this are not scored (position 0 never is)
    out: dict[str, Any] = {}
    if params.get("prompt_logprobs"):
        picked = torch.gather(own, 1, prompt[1:].unsqueeze(1)).squeeze(1).numpy()
        lps = np.concatenate([[np.nan], picked]).astype(np.float32)
        lps[:skip] = np.nan
        out["prompt_logprobs"] = lps
    k = int(params.get("topk_prompt") or 0)
    if k:
        ids, vals = _topk(own, k)
        ids = np.concatenate([np.zeros((1, k), np.int32), ids])
        vals = np.concatenate([np.full((1, k), MASK_LOGPROB, np.float32), vals])
        ids[:skip], vals[:skip] = 0, MASK_LOGPROB
        out["topk_prompt"] = (ids, vals)
    target = params.get("target")
    if target is not None:
        want = torch.as_tensor(target, dtype=torch.long)
        got = torch.gather(own, 1, want.clamp(min=0)).masked_fill(want < 0, 0.0)
        out["target_prompt_logprobs"] = got.numpy().astype(np.float32)
    alt_k = int(params.get("alt_k") or 0)
    if alt_k:
        temperature = float(params.get("temperature", 1.0))
        if temperature <= 0:
            toks = own.argmax(-1, keepdim=True).expand(-1, alt_k).contiguous()
        else:
            gen = torch.Generator(device="cpu").manual_seed(seed)
            toks = torch.multinomial(F.softmax(scaled_logits / temperature, dim=-1), alt_k, replacement=True,
                                     generator=gen)
        out["prompt_alt"] = (toks.numpy().astype(np.int64), torch.gather(own, 1, toks).numpy().astype(np.float32))
    return out


def _topk(logp: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best (id, logprob) of each row of ``logp`` (``[..., vocab]``), best first; past the vocabulary,
    token 0 with :data:`MASK_LOGPROB`."""
    vals, ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    pad = k - ids.shape[-1]
    ids_np, vals_np = ids.numpy().astype(np.int32), vals.numpy().astype(np.float32)
    if pad:
        ids_np = np.concatenate([ids_np, np.zeros((*ids_np.shape[:-1], pad), np.int32)], axis=-1)
        vals_np = np.concatenate([vals_np, np.full((*vals_np.shape[:-1], pad), MASK_LOGPROB, np.float32)], axis=-1)
    return ids_np, vals_np


def _stack(rows: list[tuple[np.ndarray, np.ndarray]], k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """A sequence's per-token top-k as two ``[tokens, k]`` matrices (None when not asked for)."""
    if not k:
        return None
    if not rows:
        return np.zeros((0, k), np.int32), np.zeros((0, k), np.float32)
    return np.stack([r[0] for r in rows]), np.stack([r[1] for r in rows])


def _stopped_by_text(tokenizer: Any, toks: list[int], stops: list[str]) -> bool:
    """Whether the text of ``toks`` contains a stop string (the token that completes one is kept)."""
    text = tokenizer.decode(toks, skip_special_tokens=False)
    return any(s in text for s in stops)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, gen: torch.Generator) -> int:
    """One token from one row of logits: greedy at temperature 0, else top-k / top-p filtered, seeded."""
    if temperature <= 0:
        return int(torch.argmax(logits))
    scaled = logits / temperature
    if top_k > 0:
        kth = torch.topk(scaled, min(top_k, scaled.numel())).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = F.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sp, idx = torch.sort(probs, descending=True)
        keep = torch.cumsum(sp, 0) - sp < top_p
        probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
    return int(torch.multinomial(probs, 1, generator=gen))
