"""The sampling routes of :class:`rota_tinker._http.service._Api` (a mixin): sampling sessions and asample, with
the checks of a sample request's parameters and stops."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from rota_tinker._config import BaseModelSpec, ServiceConfig, Tenant
from rota_tinker._hf import HfModelSpec
from rota_tinker._http import checkpoints as _checkpoints
from rota_tinker._http import formats as _formats
from rota_tinker._http.formats import BadRequest, field_of
from rota_tinker._http.handles import Future, off_request_thread
from rota_tinker._http.server import Reply
from rota_tinker._http.state import (
    _PATH,
    SEED_BOUNDS,
    _json,
    _SamplingSession,
    _State,
    _Weights,
)
from rota_tinker._worker.common import MAX_NEW_TOKENS, MAX_SAMPLES, MAX_TOPK, MIN_TEMPERATURE

log = logging.getLogger("rota_tinker._http.service")

MAX_STOPS = 16
MAX_STOP_CHARS = 256


def _stops(stop: Any, base: BaseModelSpec | HfModelSpec) -> tuple[list[int], list[str]]:
    """``SamplingParams.stop`` -> (stop token ids, stop strings).

    ``None``: the model's end-of-sequence tokens; ``[]``: no stop; a string or a list of strings:
    matched on the decoded text by the model's own tokenizer; a list of ids: those tokens.
    """
    if stop is None:
        return list(getattr(base, "eos_ids", ())), []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or len(items) > MAX_STOPS:
        raise BadRequest(f"sampling_params.stop must be a string or a list of at most {MAX_STOPS} strings or token "
                         "ids")
    if all(isinstance(s, str) for s in items) and items:
        if getattr(base, "tokenizer_id", None) is None:
            raise BadRequest(f"sampling_params.stop as strings needs a tokenizer; base model {base.name!r} has none "
                             "in its folder: give stop token ids (a list of integers)")
        bad = [i for i, s in enumerate(items) if not 1 <= len(s) <= MAX_STOP_CHARS]
        if bad:
            raise BadRequest(f"sampling_params.stop[{bad[0]}] must have 1-{MAX_STOP_CHARS} characters")
        return [], list(items)
    for i, s in enumerate(items):
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < base.vocab:
            raise BadRequest(f"sampling_params.stop[{i}] is {str(s)[:40]!r}: give all strings or all token ids of the "
                             f"base model's vocabulary of {base.vocab} tokens [0, {base.vocab})")
    return list(items), []



def result_bound(num: int, params: dict[str, Any], outputs: dict[str, Any], prompt_len: int) -> int:
    """The most bytes a sample's encoded ``SampleResponse`` can take (rota_tinker._http.formats.sample_response):
    what rota_tinker._http.budget reserves for it when it is accepted. Per sampled token its id and logprob (4 bytes
    each) and its top-k (8 bytes a column); at the prompt what it asked for; protobuf's tags and lengths on top."""
    k = outputs.get("topk_sample") or 0
    sequence = 64 + params["max_tokens"] * (8 + 8 * k)
    prompt = 4 * prompt_len if outputs.get("prompt_logprobs") else 0
    prompt += 8 * (outputs.get("topk_prompt") or 0) * prompt_len
    target = outputs.get("target")
    prompt += 4 * int(target.size) if target is not None else 0
    prompt += 12 * (outputs.get("alt_k") or 0) * prompt_len
    return num * sequence + prompt + 512


class SamplingRoutes:
    """create_sampling_session, samplers/{id}, asample."""

    state: _State
    config: ServiceConfig

    def _new_sampling_session(self, tenant: Tenant, base: BaseModelSpec, key: str, model_path: str | None,
                              shareable: bool, parent: str) -> str:
        state = self.state
        sid = state.new_id(f"{tenant.name}-sampler")
        with state.lock:
            state.sampling[sid] = _SamplingSession(sid, tenant.name, base, key, model_path, shareable, parent)
        return sid

    @staticmethod
    def copied_weights(item: _Weights, path: str, folder: str, expires: float | None) -> _Weights:
        """Sampler weights copied by copy_weights (rota_tinker._http.projects): the same weights in another folder."""
        return _Weights(path, item.tenant, item.base, folder, item.lora, item.bytes, expires=expires)

    def _weights_for(self, tenant: Tenant, model_path: str) -> _Weights:
        """The weights a sampler loads for ``model_path``: sampler weights, or a training checkpoint (its folder
        holds the same files plus the optimizer state, which the sampler does not read)."""
        if _checkpoints.TRAINING_PATH.fullmatch(model_path):
            ck = self._checkpoint(tenant, model_path)
            return _Weights(ck.path, ck.tenant, ck.base, ck.folder, ck.lora is not None, ck.bytes, ephemeral=True)
        if not _PATH.fullmatch(model_path):
            raise BadRequest(f"model_path {model_path[:140]!r} is not a weights path; use the path "
                             "save_weights_for_sampler or save_state returned (tinker://MODEL/sampler_weights/NAME or "
                             "tinker://MODEL/weights/NAME)")
        w = self._owned(self.state.weights, model_path, "sampler weights", tenant)
        if _checkpoints.expired(w):
            raise BadRequest(f"sampler weights {model_path!r} have expired (their TTL passed)", status=404)
        return w

    def _create_sampling_session(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        parent = self._session(tenant, body)
        field_of(body, "sampling_session_seq_id", int)
        model_path = field_of(body, "model_path", str, required=False)
        base_name = field_of(body, "base_model", str, required=False)
        if model_path is not None:
            w = self._weights_for(tenant, model_path)
            if base_name is not None and base_name != w.base.name:
                raise BadRequest(f"base_model {base_name[:140]!r} differs from {w.base.name!r} of {model_path!r}; "
                                 "leave base_model out")
            base, key, shareable = w.base, w.file, w.lora
        elif base_name is not None:
            base = self._base(base_name)
            key, shareable = f"base:{base.name}", True
        else:
            raise BadRequest("give model_path (weights saved for the sampler) or base_model")
        with self.state.lock:
            self.state.check_quota(tenant.name, sessions=1)
        sid = self._new_sampling_session(tenant, base, key, model_path, shareable, parent)
        return _json({"type": "create_sampling_session", "sampling_session_id": sid})

    def _get_sampler(self, tenant: Tenant, sampler_id: str) -> Reply:
        s = self._owned(self.state.sampling, sampler_id, "sampler", tenant)
        return _json({"sampler_id": s.session_id, "base_model": s.base.name, "model_path": s.model_path})

    def _asample(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        state = self.state
        sid = field_of(body, "sampling_session_id", str, required=False)
        session = None
        if sid is not None:
            field_of(body, "seq_id", int)
            s = self._owned(state.sampling, sid, "sampling session", tenant)
            base, key, shareable, session = s.base, s.key, s.shareable, s.parent
        elif body.get("model_path") is not None:
            w = self._weights_for(tenant, field_of(body, "model_path", str))
            base, key, shareable = w.base, w.file, w.lora
        else:
            base = self._base(field_of(body, "base_model", str))
            key, shareable = f"base:{base.name}", True
        record = field_of(body, "record_stability_info", bool, required=False, default=False)
        if record and session is None:
            raise BadRequest("record_stability_info=true is taken only with a sampling_session_id (records belong "
                             "to the training session that sampled them): sample through the SDK's SamplingClient, "
                             "which makes one")
        num = field_of(body, "num_samples", int, required=False, default=1, bounds=(1, MAX_SAMPLES))
        prompt = _formats.prompt_tokens(body.get("prompt"), base.vocab)
        if prompt.size >= base.max_len:
            raise BadRequest(f"prompt has {prompt.size} tokens; base model {base.name!r} takes fewer than "
                             f"{base.max_len}")
        outputs = self._prompt_outputs(body, prompt.size, base.vocab)
        sp = field_of(body, "sampling_params", dict)
        params = self._sampling_params(sp, base)
        params.update(outputs)
        seed = params.pop("seed")
        seed = secrets.randbelow(2**31) if seed is None else seed
        fut = state.future(tenant.name, "Sample", session,
                           result_bytes=result_bound(num, params, outputs, prompt.size))
        seq_ids = [f"{fut.request_id}:{i}" for i in range(num)]
        sampler = state.sampler_of(tenant.name, base, shareable)

        def send() -> None:
            try:
                shared = state.shared_base(base, shareable)
            except RuntimeError as e:
                fut.fail(f"the shared base {base.name!r} is not available: {e}", "server")
                return
            sampler.submit(
                fut, "sample", {"key": key, "base": base, "prompt": prompt, "params": params, "num_samples": num,
                                "seed": seed, "shared_base": shared, "owner": tenant.name},
                lambda result: self._sampled(fut, tenant, result, prompt.size, base.name, session,
                                             (seq_ids, prompt) if record else None), restart=True)

        sharing = shareable and state.config.share_lora_base
        if sampler.running and (not sharing or state.holder(base).running):
            send()
        else:  # a worker to start first (seconds), as create_model's
            off_request_thread(fut, "sample", send)
        return self._future_reply(fut, None, sample_sequence_ids=seq_ids)

    def _sampled(self, fut: Future, tenant: Tenant, result: dict[str, Any], prompt_len: int, base: str,
                 session: str | None, record: tuple[list[str], Any] | None = None) -> None:
        if record is not None and session is not None:  # record_stability_info: kept for stable_reinforce
            seq_ids, prompt = record
            self.state.stability.record(tenant.name, session, seq_ids, prompt,
                                        [(seq[0], seq[1]) for seq in result["sequences"]])
        usage = self.state.usage_counts
        usage.note(tenant.name, "sampling_prefill", prompt_len, base, session)
        usage.note(tenant.name, "sampling_sample", sum(len(seq[0]) for seq in result["sequences"]), base, session)
        fut.succeed(proto=_formats.sample_response(result))

    @staticmethod
    def _prompt_outputs(body: dict[str, Any], prompt_len: int, vocab: int) -> dict[str, Any]:
        """The outputs a sample request asks for besides its samples (see rota_tinker._worker.sampling.sample)."""
        out: dict[str, Any] = {"prompt_logprobs": field_of(body, "prompt_logprobs", bool, required=False,
                                                           default=False)}
        for wire, key in (("topk_prompt_logprobs", "topk_prompt"), ("topk_sample_logprobs", "topk_sample"),
                          ("prompt_alt_tokens_k", "alt_k")):
            out[key] = field_of(body, wire, int, required=False, default=0, bounds=(0, MAX_TOPK))
        if (out["topk_prompt"] or out["alt_k"]) and prompt_len < 2:
            raise BadRequest("topk_prompt_logprobs and prompt_alt_tokens_k need a prompt of at least 2 tokens")
        last_n = field_of(body, "prompt_logprobs_last_n", int, required=False, bounds=(1, max(1, prompt_len - 1)))
        if last_n is not None:
            if not (out["prompt_logprobs"] or out["topk_prompt"]):
                raise BadRequest("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
            if prompt_len < 2:
                raise BadRequest("prompt_logprobs_last_n needs a prompt of at least 2 tokens")
            out["last_n"] = last_n
        if body.get("target_prompt_logprobs") is not None:
            out["target"] = _formats.target_ids(body["target_prompt_logprobs"], prompt_len, vocab, MAX_TOPK)
        return out

    @staticmethod
    def _sampling_params(sp: dict[str, Any], base: BaseModelSpec | HfModelSpec) -> dict[str, Any]:
        max_tokens = field_of(sp, "max_tokens", int, required=False, default=16)
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise BadRequest(f"sampling_params.max_tokens={max_tokens} must be within [1, {MAX_NEW_TOKENS}]")
        temperature = field_of(sp, "temperature", float, required=False, default=1.0)
        top_k = field_of(sp, "top_k", int, required=False, default=-1)
        top_p = field_of(sp, "top_p", float, required=False, default=1.0)
        if temperature != 0 and not temperature >= MIN_TEMPERATURE:  # logits / 1e-300 overflow float32
            raise BadRequest(f"sampling_params.temperature={temperature:g} must be 0 (greedy) or at least "
                             f"{MIN_TEMPERATURE:g}")
        if not (0 < top_p <= 1):
            raise BadRequest(f"sampling_params.top_p={top_p} must be within (0, 1]")
        if top_k == 0 or top_k < -1:
            raise BadRequest(f"sampling_params.top_k={top_k} must be -1 (no limit) or >= 1")
        stop_tokens, stop_strings = _stops(sp.get("stop"), base)
        seed = field_of(sp, "seed", int, required=False, bounds=SEED_BOUNDS)
        return {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "stop_tokens": stop_tokens, "stop_strings": stop_strings, "seed": seed}

