"""The training routes of :class:`rota_tinker._http.service._Api` (a mixin): models, forward_backward, optim_step,
sampler weights."""

from __future__ import annotations

import logging
import secrets
import threading
from typing import Any

from rota_tinker._config import STATE_BYTES_PER_PARAM, BaseModelSpec, ServiceConfig, Tenant
from rota_tinker._hf import HfModelSpec
from rota_tinker._http import checkpoints as _checkpoints
from rota_tinker._http import formats as _formats
from rota_tinker._http.budget import JSON_RESULT_BYTES
from rota_tinker._http.formats import CONFLICT, NOT_IMPLEMENTED, BadRequest, field_of
from rota_tinker._http.handles import Future, off_request_thread
from rota_tinker._http.server import Reply, Request
from rota_tinker._http.state import (
    _NAME,
    EPHEMERAL_KEEP,
    PROTO,
    SEED_BOUNDS,
    _json,
    _Model,
    _start_quietly,
    _State,
    _Weights,
)

log = logging.getLogger("rota_tinker._http.service")


class TrainingRoutes:
    """create_model, unload_model, get_info, forward_backward, optim_step, save_weights_for_sampler."""

    state: _State
    config: ServiceConfig

    def _base(self, name: Any) -> BaseModelSpec | HfModelSpec:
        spec = self.config.base_models.get(name) if isinstance(name, str) else None
        if spec is None:
            shown = repr(name[:140]) if isinstance(name, str) else type(name).__name__
            searched = (f"; searched {list(self.config.model_dirs)} for Hugging Face snapshots (hub cache "
                        "models--ORG--NAME/snapshots/REV or plain folders ORG/NAME with config.json; nothing is "
                        "downloaded: put the snapshot in one of them)") if self.config.model_dirs else ""
            raise BadRequest(f"base_model {shown} is not served here; choose one of {sorted(self.config.base_models)}"
                             f"{searched}", status=404)
        return spec

    def _model_bytes(self, base: BaseModelSpec | HfModelSpec, lora: dict[str, Any] | None) -> int:
        """Estimated state of a model: 16 bytes per trainable parameter, plus 4 per parameter of a private base."""
        if lora is None:
            return STATE_BYTES_PER_PARAM * base.params()
        private = 0 if self.config.share_lora_base else 4 * base.params()
        return STATE_BYTES_PER_PARAM * base.lora_params(lora["rank"], lora["targets"]) + private

    def _create_model(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        sid = self._session(tenant, body)
        field_of(body, "model_seq_id", int)
        base = self._base(field_of(body, "base_model", str))
        opt = field_of(body, "optimizer_config", dict, required=False, default={"type": "adamw"})
        if opt.get("type", "adamw") != "adamw":
            raise BadRequest("optimizer_config type is not implemented by this service; use adamw (the default)",
                             status=NOT_IMPLEMENTED)
        lora_cfg = field_of(body, "lora_config", dict, required=False)
        lora = None
        if lora_cfg is not None:
            rank = field_of(lora_cfg, "rank", int, bounds=(1, min(256, base.dim)))
            seed = field_of(lora_cfg, "seed", int, required=False, bounds=SEED_BOUNDS)
            targets = {g: field_of(lora_cfg, f"train_{g}", bool, required=False, default=True)
                       for g in ("mlp", "attn", "unembed")}
            if not any(targets.values()):
                raise BadRequest("lora_config trains nothing; set at least one of train_mlp, train_attn, "
                                 "train_unembed")
            lora = {"rank": rank, "seed": secrets.randbelow(2**31) if seed is None else seed, "targets": targets}
        model_id = self.state.new_id(f"{tenant.name}-model")
        fut = self._start_model(tenant, sid, model_id, base, lora, _checkpoints.user_metadata(
            body.get("user_metadata")), {"model_id": model_id, "type": "create_model"})
        return self._future_reply(fut, model_id)

    def _start_model(self, tenant: Tenant, sid: str, model_id: str, base: BaseModelSpec | HfModelSpec,
                     lora: dict[str, Any] | None, metadata: dict[str, str] | None, answer: dict[str, Any],
                     load: dict[str, Any] | None = None) -> Future:
        """Create model ``model_id`` in the tenant's trainer (from checkpoint ``load`` if given); its future."""
        state = self.state
        model = _Model(model_id, tenant.name, base, lora, sid, self._model_bytes(base, lora))
        with state.lock:
            if model_id in state.models or model_id in state.creating:
                raise BadRequest(f"model {model_id[:140]!r} exists already; use a new model_seq_id", status=CONFLICT)
            state.check_quota(tenant.name, models=1, nbytes=model.bytes)
            state.creating[model_id] = model
        try:
            fut = state.future(tenant.name, "CreateModel", sid, result_bytes=JSON_RESULT_BYTES)
        except BadRequest:  # the key's queued units or results are at their bounds: nothing is being created
            with state.lock:
                state.creating.pop(model_id, None)
            raise
        trainer = state.trainer_of(model)

        def done(result: Any) -> None:
            with state.lock:
                state.creating.pop(model_id, None)
                live = sid in state.sessions
                if live:
                    state.models[model_id] = model
                    state.runs.record(model, metadata, state.sessions[sid].project_id)
            if not live:  # its session ended meanwhile: nothing may keep the model
                state.unload(model, state.future(tenant.name, "UnloadModel"))
            fut.succeed(json=answer)

        def failed() -> None:
            with state.lock:
                state.creating.pop(model_id, None)

        fut.add_done_callback(lambda: failed() if fut.error is not None else None)

        def start() -> None:
            """The trainer starts beside the holder."""
            threading.Thread(target=_start_quietly, args=(trainer,), name=f"rota-tinker-start-{trainer.name}",
                             daemon=True).start()
            try:
                shared = state.shared_base(base, lora is not None)
            except RuntimeError as e:
                fut.fail(f"the shared base {base.name!r} is not available: {e}", "server")
                return
            args = {"model_id": model_id, "base": base, "lora": lora, "shared_base": shared, "load": load}
            if trainer.spec.role == "batch":  # it holds many tenants' models: their folders are named by tenant
                args["tenant"] = tenant.name
            trainer.submit(fut, "create", args, done, restart=True)

        off_request_thread(fut, "create_model", start)
        log.info("tenant %s: model %s (%s, %s%s)", tenant.name, model_id, base.name,
                 f"lora rank {lora['rank']}" if lora else "full-parameter", ", from a checkpoint" if load else "")
        return fut

    def _unload_model(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        """Free a model and its ephemeral sampler weights: the quota at once, the memory in its trainer's next turn."""
        m = self._model(tenant, field_of(body, "model_id", str))
        fut = self.state.future(tenant.name, "UnloadModel", result_bytes=JSON_RESULT_BYTES)
        self.state.unload(m, fut)
        log.info("tenant %s: unload_model %s", tenant.name, m.model_id)
        return self._future_reply(fut, m.model_id)

    def _get_info(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        m = self._model(tenant, field_of(body, "model_id", str))
        hf = isinstance(m.base, HfModelSpec)
        return _json({"type": "get_info", "model_id": m.model_id, "model_name": m.base.name,
                      "is_lora": m.lora is not None, "lora_rank": m.lora["rank"] if m.lora else None,
                      "model_data": {"arch": "hf-causal-lm" if hf else "rota-tinylm", "model_name": m.base.name,
                                     "tokenizer_id": m.base.tokenizer_id if hf else None}})

    def _forward_backward(self, req: Request, tenant: Tenant, body: bytes) -> Reply:
        ctype = req.header("content-type").split(";")[0].strip().lower()
        if ctype != PROTO:
            raise BadRequest(f"forward_backward takes Content-Type {PROTO} (the tinker SDK's "
                             f"ForwardBackwardRequest protobuf), not {ctype[:60] or '(none)'!r}", status=415)
        fb = _formats.parse_forward_backward(_formats.decompress(body, req.header("content-encoding"),
                                                                 self.config.max_body_bytes))
        m = self._model(tenant, fb.model_id)
        tokens = sum(d.tokens.size for d in fb.data)
        if tokens > self.config.max_request_tokens:
            raise BadRequest(f"this request carries {tokens} tokens over its {len(fb.data)} data; the service takes "
                             f"at most {self.config.max_request_tokens} per forward/forward_backward request "
                             "(--max-request-tokens): split the batch into several requests (the tinker SDK "
                             "does so by itself)")
        data = []
        for i, d in enumerate(fb.data):
            _formats.token_ids(d.tokens, m.base.vocab, f"data[{i}].model_input")
            inputs = {**d.inputs, "target_tokens": _formats.token_ids(d.inputs["target_tokens"], m.base.vocab,
                                                                      f"data[{i}].loss_fn_inputs['target_tokens']")}
            if d.tokens.size > m.base.max_len:
                raise BadRequest(f"data[{i}] has {d.tokens.size} tokens; base model {m.base.name!r} takes at most "
                                 f"{m.base.max_len}")
            if fb.loss_fn == "stable_reinforce":  # the sampler's records, checked against the datum's provenance
                inputs = self.state.stability.loss_inputs(tenant.name, m.session_id, i, d.tokens, inputs,
                                                          d.provenance)
            data.append((d.tokens, inputs))
        # its result: a float32 logprob per token, the data's tensors and the message around them
        fut = self.state.future(tenant.name, "ForwardBackward", m.session_id,
                                result_bytes=8 * tokens + 64 * len(data) + 1024)

        def done(result: Any) -> None:
            self.state.usage_counts.note(tenant.name, "training", tokens, m.base.name, m.session_id)
            fut.succeed(proto=_formats.forward_backward_output(result["logprobs"], result["metrics"]))

        self.state.trainer_of(m).submit(
            fut, "forward_backward",
            {"model_id": m.model_id, "loss_fn": fb.loss_fn, "forward_only": fb.forward_only, "data": data,
             "loss_config": fb.loss_config}, done)
        return self._future_reply(fut, m.model_id)

    def _optim_step(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        m = self._model(tenant, field_of(body, "model_id", str))
        if body.get("optimizer_params") is not None:
            raise BadRequest("optimizer_params (non-Adam optimizers) are not implemented by this service; send "
                             "AdamParams", status=NOT_IMPLEMENTED)
        p = field_of(body, "adam_params", dict)
        adam = {k: field_of(p, k, float, required=False, default=d) for k, d in
                (("learning_rate", 1e-4), ("beta1", 0.9), ("beta2", 0.95), ("eps", 1e-12), ("weight_decay", 0.0),
                 ("grad_clip_norm", 0.0))}
        if adam["learning_rate"] < 0 or adam["eps"] <= 0 or adam["weight_decay"] < 0 or adam["grad_clip_norm"] < 0:
            raise BadRequest(f"adam_params {adam} out of range: learning_rate, weight_decay and grad_clip_norm must "
                             "be >= 0 and eps > 0")
        if not (0 <= adam["beta1"] < 1 and 0 <= adam["beta2"] < 1):
            raise BadRequest(f"adam_params beta1={adam['beta1']}, beta2={adam['beta2']} must be within [0, 1)")
        fut = self.state.future(tenant.name, "OptimStep", m.session_id, result_bytes=JSON_RESULT_BYTES)
        self.state.trainer_of(m).submit(
            fut, "optim_step", {"model_id": m.model_id, "adam": adam},
            lambda result: fut.succeed(json={"metrics": result["metrics"]}))
        return self._future_reply(fut, m.model_id)

    def _save_for_sampler(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        state = self.state
        m = self._model(tenant, field_of(body, "model_id", str))
        name = field_of(body, "path", str, required=False)
        ephemeral = name is None
        if name is None:
            field_of(body, "sampling_session_seq_id", int)
            name = f"ephemeral-{secrets.token_hex(6)}"
        elif not _NAME.fullmatch(name):
            raise BadRequest(f"path {name[:80]!r} is not a valid checkpoint name: use 1-64 letters, digits, '.', '_', "
                             "'-', starting with a letter or digit")
        tinker_path = f"tinker://{m.model_id}/sampler_weights/{name}"
        expires = _checkpoints.ttl(body)
        metadata = _checkpoints.user_metadata(body.get("user_metadata"))
        nbytes = 4 * (m.base.params() if m.lora is None else m.base.lora_params(m.lora["rank"], m.lora["targets"]))
        with state.lock:
            if tinker_path in state.weights:
                raise BadRequest(f"{tinker_path} exists; save under another name or delete it first", status=CONFLICT)
            state.check_quota(tenant.name, nbytes=nbytes, sessions=1 if ephemeral else 0)
        fut = state.future(tenant.name, "SaveWeightsForSampler", m.session_id, result_bytes=JSON_RESULT_BYTES)

        def done(result: Any) -> None:
            w = _Weights(tinker_path, tenant.name, m.base, result["file"], m.lora is not None, int(result["bytes"]),
                         ephemeral, user_metadata=metadata, expires=expires)
            older: list[str] = []
            with state.lock:
                state.weights[tinker_path] = w
                if ephemeral:
                    m.ephemeral.append(tinker_path)
                    older, m.ephemeral[:] = m.ephemeral[:-EPHEMERAL_KEEP], m.ephemeral[-EPHEMERAL_KEEP:]
            for path in older:
                state.delete_weights(path)
            if ephemeral:
                sid = self._new_sampling_session(tenant, m.base, w.file, tinker_path, w.lora, m.session_id)
                fut.succeed(json={"type": "save_weights_for_sampler", "sampling_session_id": sid})
            else:
                state.runs.audit.note(tenant.name, "checkpoint_create", tinker_path=tinker_path, model_id=m.model_id)
                state.usage_counts.note(tenant.name, "checkpoint", 1, m.base.name, m.session_id)
                fut.succeed(json={"type": "save_weights_for_sampler", "path": tinker_path})

        state.trainer_of(m).submit(
            fut, "save_for_sampler", {"model_id": m.model_id, "name": name, "base": m.base}, done)
        return self._future_reply(fut, m.model_id)
