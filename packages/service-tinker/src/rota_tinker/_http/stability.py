"""Stability records: what a sampler saw and drew, kept for StableReinforce training (``stable_reinforce``).

A sample request with ``record_stability_info`` (the SDK's ``SamplingClient`` made with
``record_stability_info=True``) leaves one record per sampled sequence, under the
``sequence_id`` the SDK stamps on it: the prompt, the sampled tokens and the sampler's
logprob of each. A ``stable_reinforce`` request names those sequences through its data's
provenance (``Datum.with_provenance``); :meth:`StabilityRecords.loss_inputs` checks every
claim against the record (each input token the datum says came from a prompt or a sample,
and each target it says was sampled, is that token) and turns it into what the loss reads
(:func:`rota_tinker._worker.models.datum_loss`): the recorded logprobs on sampled target rows and a
mask of those rows.

Why server-side records: the loss's importance weights then use what the sampler really
computed, not numbers the caller sends, and a datum cannot attribute tokens to a sequence
that never produced them.

Records belong to the tenant and the training session that sampled them (another one's id
is unknown to a caller), live for :data:`RECORD_TTL_S` after their last use (the Tinker
docs' one day, restarted by each training request naming them), end with their session,
and are bounded per tenant by :data:`MAX_RECORDED_TOKENS` (the least recently used go
first; a training request naming a dropped one is a 400 saying so). Each record also costs
:data:`RECORD_COST_TOKENS` of that budget, what keeping it costs beyond its tokens: records of
one token each once held ~1.25 GiB per tenant at the bound. Every operation touches only the
records it names, the tenant's oldest, or the session's: one tenant's millions of records once
held the lock that every tenant's ``stable_reinforce`` and sample results need for 1.3-1.6 s
per further record (each scanned them all). Called by :mod:`rota_tinker._http.service`; numpy only.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field

import numpy as np

from rota_tinker._http.formats import BadRequest, Span

RECORD_TTL_S = 86400.0  # the Tinker docs: trainable for one day after sampling, restarted by each use
# prompt + sampled tokens recorded per tenant: 8 bytes a prompt token (a request's samples share one copy but each
# counts it), 12 a sampled one with its logprob
MAX_RECORDED_TOKENS = 4_000_000
# what one record costs beyond its tokens, in tokens of that budget: its object, three arrays' headers and the
# index entries, ~780 bytes in CPython 3.11, about what 64 sampled tokens cost (12 bytes each); so a tenant
# at its bound holds ~12 bytes per budget token, ~48 MB (tests/security/test_tinker_stability.py measures it)
RECORD_COST_TOKENS = 64


@dataclass
class _Record:
    tenant: str
    session: str
    prompt: np.ndarray  # int64, shared by the samples of one request
    tokens: np.ndarray  # int64 sampled tokens
    logprobs: np.ndarray  # float32, the sampler's logprob of each sampled token
    used: float = field(default_factory=time.monotonic)

    @property
    def size(self) -> int:
        """Its cost against the tenant's budget, in tokens."""
        return self.prompt.size + self.tokens.size + RECORD_COST_TOKENS


class StabilityRecords:
    """The records of every tenant, oldest use first; thread-safe."""

    def __init__(self, max_tokens: int = MAX_RECORDED_TOKENS, ttl_s: float = RECORD_TTL_S) -> None:
        self.max_tokens, self.ttl_s = max_tokens, ttl_s
        self._lock = threading.Lock()
        self._records: OrderedDict[str, _Record] = OrderedDict()  # every tenant's, least recently used first
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}  # tenant -> its record ids, least recently used first
        self._by_session: dict[str, set[str]] = {}  # session -> its record ids
        self._tokens: dict[str, int] = {}  # tenant -> recorded tokens (with each record's cost)
        self.trained: Counter[str] = Counter()  # tenant -> data trained on with records (a metric; tests read it)

    def record(self, tenant: str, session: str, sequence_ids: list[str], prompt: np.ndarray,
               sequences: list[tuple[list[int], list[float]]]) -> None:
        """Keep one record per sampled sequence (its tokens and the sampler's logprobs of them)."""
        shared = np.asarray(prompt, dtype=np.int64)
        with self._lock:
            for sid, (tokens, logprobs) in zip(sequence_ids, sequences, strict=True):
                rec = _Record(tenant, session, shared, np.asarray(tokens, dtype=np.int64),
                              np.asarray(logprobs, dtype=np.float32))
                self._drop(sid)
                self._records[sid] = rec
                self._by_tenant.setdefault(tenant, OrderedDict())[sid] = None
                self._by_session.setdefault(session, set()).add(sid)
                self._tokens[tenant] = self._tokens.get(tenant, 0) + rec.size
            self._expire(tenant)

    def end_session(self, session: str) -> None:
        """Drop the records of a session that ended."""
        with self._lock:
            for sid in list(self._by_session.get(session, ())):
                self._drop(sid)

    def count(self, tenant: str) -> int:
        """Records the tenant holds (tests, metrics)."""
        with self._lock:
            return len(self._by_tenant.get(tenant, ()))

    def loss_inputs(self, tenant: str, session: str, i: int, tokens: np.ndarray,
                    inputs: dict[str, np.ndarray], provenance: tuple[list[Span], list[Span]] | None
                    ) -> dict[str, np.ndarray]:
        """What ``stable_reinforce`` reads for datum ``i``: ``target_tokens``, ``advantages``, the recorded
        ``logprobs`` of its sampled target rows (0 elsewhere) and ``sampled_mask`` (1 on those rows).

        Every run of its provenance is checked against the named record; a prompt row must have advantage 0 (the
        loss trains sampled tokens only). BadRequest names the datum, the run and the fix.
        """
        if provenance is None:
            raise BadRequest(f"data[{i}] has no provenance; stable_reinforce needs to know which sampled sequence "
                             "each token came from: sample with record_stability_info=True and attach "
                             "Datum.with_provenance(...) naming SampledSequence.sequence_id")
        input_spans, target_spans = provenance
        targets, adv = inputs["target_tokens"], inputs["advantages"]
        sampler_lp = np.zeros(targets.size, np.float32)
        mask = np.zeros(targets.size, np.float32)
        with self._lock:
            self._expire(tenant)
            self._claims(tenant, session, f"data[{i}].model_input_spans", input_spans, tokens, prompt_tokens=True)
            records = self._claims(tenant, session, f"data[{i}].loss_fn_input_spans", target_spans, targets,
                                   prompt_tokens=False)
            pos = 0
            for span, rec in zip(target_spans, records, strict=True):
                rows = slice(pos, pos + span.length)
                if span.sampled:
                    sampler_lp[rows] = rec.logprobs[span.offset:span.offset + span.length]
                    mask[rows] = 1.0
                elif np.any(adv[rows] != 0):
                    k = pos + int(np.argmax(adv[rows] != 0))
                    raise BadRequest(f"data[{i}].loss_fn_inputs['advantages'][{k}] is {float(adv[k])!r} on a "
                                     "prompt token; stable_reinforce trains sampled tokens only: give prompt rows "
                                     "advantage 0")
                pos += span.length
            now = time.monotonic()
            for rec_id in {s.sequence_id for s in (*input_spans, *target_spans)}:
                self._records[rec_id].used = now
                self._records.move_to_end(rec_id)
                self._by_tenant[tenant].move_to_end(rec_id)
            self.trained[tenant] += 1
        return {"target_tokens": targets, "advantages": adv, "logprobs": sampler_lp, "sampled_mask": mask}

    def _claims(self, tenant: str, session: str, where: str, spans: list[Span], values: np.ndarray, *,
                prompt_tokens: bool) -> list[_Record]:
        """Each run's record, after checking that the run's tokens are the recorded ones (a prompt run's only when
        ``prompt_tokens``: target rows over a prompt are padding the loss does not read; the cookbook sends 0s)."""
        out, pos = [], 0
        for k, span in enumerate(spans):
            rec = self._records.get(span.sequence_id)
            if rec is None or rec.tenant != tenant or rec.session != session:
                raise BadRequest(f"{where}[{k}] names sequence {span.sequence_id!r}, which this session has no "
                                 "stability record of: sample in the same session with record_stability_info=True "
                                 f"(records last {self.ttl_s / 3600:g} h after their last use, and end with their "
                                 "session)")
            source = rec.tokens if span.sampled else rec.prompt
            what = "sampled tokens" if span.sampled else "prompt"
            if span.offset + span.length > source.size:
                raise BadRequest(f"{where}[{k}] claims positions [{span.offset}, {span.offset + span.length}) of "
                                 f"sequence {span.sequence_id!r}'s {what}, which has {source.size}")
            got = values[pos:pos + span.length]
            want = source[span.offset:span.offset + span.length]
            if (span.sampled or prompt_tokens) and not np.array_equal(got, want):
                j = int(np.argmax(got != want))
                raise BadRequest(f"{where}[{k}]: token {int(got[j])} at position {pos + j} is not token "
                                 f"{int(want[j])} at position {span.offset + j} of sequence {span.sequence_id!r}'s "
                                 f"{what}; provenance must name the tokens as they were sampled")
            out.append(rec)
            pos += span.length
        return out

    def _drop(self, sid: str) -> None:
        rec = self._records.pop(sid, None)
        if rec is None:
            return
        self._tokens[rec.tenant] -= rec.size
        mine, session = self._by_tenant[rec.tenant], self._by_session[rec.session]
        del mine[sid]
        session.discard(sid)
        if not mine:
            del self._by_tenant[rec.tenant], self._tokens[rec.tenant]
        if not session:
            del self._by_session[rec.session]

    def _expire(self, tenant: str) -> None:
        """Drop records unused for ``ttl_s`` and, past the tenant's budget, its least recently used ones."""
        deadline = time.monotonic() - self.ttl_s
        while self._records:
            sid, rec = next(iter(self._records.items()))
            if rec.used > deadline:
                break
            self._drop(sid)
        while self._tokens.get(tenant, 0) > self.max_tokens:
            self._drop(next(iter(self._by_tenant[tenant])))
