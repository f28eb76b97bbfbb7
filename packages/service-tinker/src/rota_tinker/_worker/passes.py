"""The batched LoRA worker's loop: passes, each a bounded share of every tenant's queued work.

Why passes: one maximal sample (64 x 1,024 tokens) or a backlog of one tenant's units once ran whole before
another tenant's 0.05 s step (41.6 s and 2.34 s). Here the worker (:class:`rota_tinker._worker.batch.BatchTrainer`)
takes work in **passes**. Between two passes it reads every unit that has arrived into its tenant's queue (a
tenant is an API key; the HTTP front end caps how many units one key has queued), and each pass runs:

1. at the head of each tenant's queue, up to :data:`OPS_PER_PASS` model operations (create, unload, checkpoints);
2. **training**: first the ``optim_step`` units at the head of a queue (their ``forward_backward`` ran in an
   earlier pass; the SDK sends one right behind its forward_backward, so it often arrives during that pass),
   each answered at once; then of every tenant, in round-robin order, its oldest ``forward_backward`` units up to
   ``lora_batch_tokens`` tokens (its first unit always, cut by datum when larger: the rest comes in its next
   passes), with the ``optim_step`` units right behind them, all tenants' parts as one batched pass (at most
   :data:`BATCH_TOKENS` in all: a tenant left out goes first in the next pass);
3. **sampling**: queued ``sample`` units start one new decode batch (round-robin over tenants; a tenant is in
   at most one batch in flight, with at most :data:`TENANT_ROWS` rows), and the batches in flight take at most
   :data:`DECODE_STEPS` decode steps in all, round-robin, each step computing at most ``lora_batch_tokens``
   positions (a long prompt goes in over several steps).

So a unit waits for the pass in progress when it arrives, then runs in the next one, behind nothing but its own
tenant's earlier units: another tenant's sample costs it at most :data:`DECODE_STEPS` steps a pass, another's
backlog at most ``lora_batch_tokens`` tokens a pass. Each reply's timing says so: ``pass`` (the pass it finished
in), ``passes`` (passes that ran from its arrival to its reply) and ``decode_steps`` (decode steps run meanwhile).

The worker keeps its rota turn while it has device work and the policy lets it (it yields between passes),
and releases it when idle. A stop message ends it at once: queued units are dropped (their futures fail).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from rota_tinker._worker.common import MICRO_BATCH_TOKENS, UserError
from rota_tinker._worker.loop import Loop, Stop, WorkUnit, failed_reply
from rota_tinker._worker.multilora import Unit

log = logging.getLogger("rota_tinker.worker")

__all__ = ["BATCH_TOKENS", "DECODE_STEPS", "OPS_PER_PASS", "TENANT_ROWS", "BatchLoop"]

BATCH_TOKENS = 1 << 20  # training tokens of one pass, all tenants together (micro-batches bound its memory)
DECODE_STEPS = 8  # decode steps (prompt chunks or tokens) of all sample batches in one pass
TENANT_ROWS = 64  # rows of one tenant's samples in flight (one request of 64 samples)
OPS_PER_PASS = 4  # model operations of one tenant run at the head of one pass
LINGER_S = 0.005  # a lone forward_backward waits this long for the optim_step the SDK sends right behind it


@dataclass(eq=False)  # one unit is one object: queues find and drop it by identity
class _Queued:
    """A unit in its tenant's queue; a ``forward_backward`` keeps the data it has left and what its parts gave."""

    rid: str
    op: str
    args: dict[str, Any]
    timing: dict[str, float]
    owner: str
    seen_pass: int  # passes run before it arrived
    seen_steps: int  # decode steps run before it arrived
    todo: list[Any] = field(default_factory=list)  # forward_backward: data not run yet
    logprobs: list[Any] = field(default_factory=list)
    loss: float = 0.0
    alone: bool = False  # a sample whose shared batch failed: it decodes in a batch of its own

    def tokens(self, data: list[Any] | None = None) -> int:
        return sum(len(t) for t, _ in (self.todo if data is None else data))


class BatchLoop(Loop):
    """The batched LoRA worker's loop (see the module docs)."""

    def __init__(self, worker: Any, gpu: Any, conn: Connection, working: Any = None) -> None:
        super().__init__(worker, gpu, conn, 1, working)
        self.tokens = max(1, worker.spec.lora_batch_tokens)
        self.train: dict[str, deque[_Queued]] = {}  # tenant -> its units other than samples, in arrival order
        self.samples: dict[str, deque[_Queued]] = {}  # tenant -> its sample units, in arrival order
        self.order: deque[str] = deque()  # tenants in round-robin order
        self.decodings: deque[tuple[Any, list[_Queued]]] = deque()  # sample batches in flight, next to step first
        self.model_owner: dict[str, str] = {}  # model id -> tenant, from its create (before the worker holds it)
        self.turn: Any = None  # the turn held, if any
        self.started: dict[str, float] | None = None  # the turn's acquisition, for the first unit that runs in it
        self.passes = 0
        self.decode_steps = 0

    # ------------------------------------------------------------------ the loop

    def run(self) -> None:
        try:
            while True:
                self._drain(block=not self._busy())
                self._run_unturned()
                if self._device_work():
                    self._pass()
                elif self.turn is not None:
                    self._release([])
        except Stop:
            return

    def _busy(self) -> bool:
        return bool(self.decodings) or any(self.train.values()) or any(self.samples.values())

    def _device_work(self) -> bool:
        return self._busy()

    def _drain(self, block: bool) -> None:
        """Every unit that has arrived, into its tenant's queue (one blocking read first when ``block``)."""
        if block:
            self._enqueue(self.recv())
        while self.conn.poll(0):
            self._enqueue(self.recv())

    def _enqueue(self, unit: WorkUnit) -> None:
        rid, op, args, timing = unit
        if op == "create":
            owner = str(args.get("tenant", ""))
            self.model_owner[args["model_id"]] = owner
        elif "model_id" in args:
            owner = self.model_owner.get(args["model_id"]) or self.worker.owner_of(args["model_id"]) or ""
        else:
            owner = str(args.get("owner", ""))
        q = _Queued(rid, op, args, timing, owner, self.passes, self.decode_steps)
        if op == "forward_backward":
            q.todo = list(args["data"])
        (self.samples if op == "sample" else self.train).setdefault(owner, deque()).append(q)
        if owner not in self.order:
            self.order.append(owner)

    def _run_unturned(self) -> None:
        """Units at the head of a queue that need no device (dropping a model this worker never held) run now."""
        for queue in self.train.values():
            while queue and queue[0].op not in self.worker.BATCHED_OPS and not self.worker.needs_turn(
                    queue[0].op, queue[0].args):
                q = queue.popleft()
                self._done(q, self.call(q.op, q.args, q.timing))

    # ------------------------------------------------------------------ a pass

    def _pass(self) -> None:
        if self.turn is None and not self._begin():
            return
        self._drain(block=False)
        self._linger()
        self.passes += 1
        order = list(self.order)
        finished: list[tuple[_Queued, tuple[Any, ...]]] = []
        self._model_ops(order, finished)
        self._leading_optim_steps(order)
        left_out = self._training(order, finished)
        self._sampling(order, finished)
        self.order.rotate(-1)  # the next pass starts with the next tenant,
        for owner in reversed(left_out):  # but those a full pass left out go first
            self.order.remove(owner)
            self.order.appendleft(owner)
        if not self._device_work() or not self.turn.may_continue():
            self._release(finished)
        for q, outcome in finished:
            self._done(q, outcome)

    def _begin(self) -> bool:
        """Take the turn; if it cannot be had, every queued unit fails with why (the next unit tries again)."""
        own = self.own
        assert own is not None
        t0 = time.monotonic()
        try:
            started = own.begin()
        except Exception as e:
            log.error("batched worker: could not get a turn: %s", e)
            outcome = ("err", f"could not get a turn on the device: {type(e).__name__}: {e}", "server")
            for queue in (*self.train.values(), *self.samples.values()):
                while queue:
                    self._done(queue.popleft(), outcome)
            while self.decodings:
                decoding, units = self.decodings.popleft()
                self.worker.close_decoding(decoding)
                for q in units:
                    self._done(q, outcome)
            return False
        self.turn, self.started = own, {"acquire_s": time.monotonic() - t0, **started}
        return True

    def _release(self, finished: list[tuple[_Queued, tuple[Any, ...]]]) -> None:
        timing = finished[-1][0].timing if finished else {}
        self.end_turn(self.turn, timing)
        self.turn, self.started = None, None

    def _joins(self, q: _Queued) -> None:
        """``q`` runs in this turn for the first time: its share of the turn's acquisition (the first unit's)."""
        if "new_turn" in q.timing:
            return
        if self.started is not None:
            q.timing.update(self.started)
            self.started = None
        else:
            q.timing.update(acquire_s=0.0, new_turn=0.0, **self.turn.queued())

    def _linger(self) -> None:
        """A lone forward_backward and nothing else to do: give its optim_step a moment to arrive."""
        waiting = [q for queue in self.train.values() for q in queue]
        if (len(waiting) == 1 and waiting[0].op == "forward_backward" and not self.decodings
                and not any(self.samples.values()) and self.conn.poll(LINGER_S)):
            self._drain(block=False)

    def _model_ops(self, order: list[str], finished: list[tuple[_Queued, tuple[Any, ...]]]) -> None:
        for owner in order:
            queue = self.train.get(owner)
            for _ in range(OPS_PER_PASS):
                if not queue or queue[0].op in self.worker.BATCHED_OPS:
                    break
                q = queue.popleft()
                self._joins(q)
                finished.append((q, self.call(q.op, q.args, q.timing)))

    def _leading_optim_steps(self, order: list[str]) -> None:
        """The optim_steps at the head of a queue (their forward_backward ran in an earlier pass: one that arrives
        during a pass is at the head of the next), run and answered now, before the batched pass: behind it, every
        step of a busy worker took two passes (on an H100 at N = 32, 1.9 s where a pass took 0.9 s)."""
        for owner in order:
            queue = self.train.get(owner)
            while queue and queue[0].op == "optim_step":
                q = queue.popleft()
                self._joins(q)
                outcome = self.call(q.op, q.args, q.timing)
                q.timing["batch_units"] = 1.0
                self._done(q, outcome)

    def _training(self, order: list[str], finished: list[tuple[_Queued, tuple[Any, ...]]]) -> list[str]:
        """Every tenant's share of forward_backward as one batched pass, then the optim_steps behind them; the
        tenants a full pass left out."""
        parts: list[Unit] = []
        optims: list[_Queued] = []
        total, left_out = 0, []
        outcomes: dict[int, tuple[Any, ...]] = {}
        for owner in order:
            taken = self._share(self.train.get(owner) or deque(), total)
            if taken is None:
                left_out.append(owner)
                continue
            for q, data in taken[0]:
                if self.worker.owner_of(q.args["model_id"]) is None:  # its create failed, or it was unloaded:
                    q.todo = []  # it fails alone (in the batched pass it would fail every tenant's parts)
                    outcomes[id(q)] = failed_reply("forward_backward", UserError(
                        f"model {q.args['model_id']!r} is not loaded (its creation failed or it was unloaded)"))
                    optims.append(q)
                    continue
                parts.append(Unit(q.args["model_id"], data, q.args["loss_fn"], q.args.get("loss_config"),
                                  q.args["forward_only"], key=q))
                total += q.tokens(data)
            optims += taken[1]
        if not parts and not optims:
            return left_out
        t0 = time.monotonic()
        units = list(dict.fromkeys([p.key for p in parts] + optims))
        for q in units:
            self._joins(q)
        if parts:
            try:
                for part, result in zip(parts, self.worker.train(parts), strict=True):
                    part.key.logprobs.extend(result["logprobs"])
                    part.key.loss += result["metrics"]["loss:sum"]
            except Exception as e:  # a failed pass fails every unit in it, as a failed unit in a trainer
                for part in parts:
                    part.key.todo = []
                    outcomes[id(part.key)] = failed_reply("forward_backward", e)
        for q in optims:
            if id(q) not in outcomes:
                outcomes[id(q)] = self.call(q.op, q.args, q.timing)
        spent = time.monotonic() - t0
        for q in units:
            q.timing.update(compute_s=spent, batch_units=float(len(units)))
            if q.op == "forward_backward" and q.todo:
                continue  # the rest of it comes in its tenant's next passes
            self.train[q.owner].remove(q)
            outcome = outcomes.get(id(q)) or ("ok", {"logprobs": q.logprobs, "metrics": {"loss:sum": q.loss}})
            finished.append((q, outcome))
        return left_out

    def _share(self, queue: deque[_Queued], total: int) -> tuple[list[tuple[_Queued, list[Any]]],
                                                                list[_Queued]] | None:
        """A tenant's share of this pass: its oldest forward_backward data within ``lora_batch_tokens`` and the
        optim_steps right behind them (in queue order: a model's optim_step waits for its forward_backward parts,
        and its next forward_backward for its optim_step); None if the pass is too full to take its first part."""
        fbs: list[tuple[_Queued, list[Any]]] = []
        optims: list[_Queued] = []
        spent, stepped = 0, set()
        for q in queue:
            if q.op == "optim_step":
                optims.append(q)
                stepped.add(q.args["model_id"])
                continue
            if q.op != "forward_backward" or q.args["model_id"] in stepped:
                break
            data: list[Any] = []
            for datum in q.todo:
                if (data or spent) and spent + len(datum[0]) > self.tokens:
                    break
                data.append(datum)
                spent += len(datum[0])
            if not data:
                break
            if total and total + q.tokens(data) > BATCH_TOKENS and not fbs:
                return None
            fbs.append((q, data))
            q.todo = q.todo[len(data):]
            if q.todo:  # cut: its rest (and what is behind it) in the next pass
                break
        return fbs, optims

    # ------------------------------------------------------------------ sampling

    def _sampling(self, order: list[str], finished: list[tuple[_Queued, tuple[Any, ...]]]) -> None:
        self._admit(order, finished)
        steps = 0
        while self.decodings and steps < DECODE_STEPS:
            decoding, units = self.decodings[0]
            self.decodings.rotate(-1)
            try:
                decoding.step(self.tokens)
            except Exception as e:  # the batch's forward failed: each of its requests goes on alone
                self._split(decoding, units, e, finished)
                continue
            finally:
                steps += 1
                self.decode_steps += 1
            if decoding.done:
                self.decodings.remove((decoding, units))
                self.worker.close_decoding(decoding)
                for q, result in zip(units, decoding.results(), strict=True):
                    if isinstance(result, dict):
                        result["timing"] = {"batch_units": float(len(units)), "decode_rows": float(result.pop("rows"))}
                    q.timing["compute_s"] = decoding.seconds
                    finished.append((q, failed_reply("sample", result) if isinstance(result, Exception)
                                     else ("ok", result)))

    def _split(self, decoding: Any, units: list[_Queued], e: Exception,
               finished: list[tuple[_Queued, tuple[Any, ...]]]) -> None:
        self.decodings.remove((decoding, units))
        self.worker.close_decoding(decoding)
        if len(units) == 1:
            finished.append((units[0], failed_reply("sample", e)))
            return
        log.warning("a decode batch of %d samples failed (%s: %s); each decodes alone", len(units),
                    type(e).__name__, e)
        for q in reversed(units):
            q.alone = True
            self.samples[q.owner].appendleft(q)

    def _admit(self, order: list[str], finished: list[tuple[_Queued, tuple[Any, ...]]]) -> None:
        """Queued samples start one new decode batch: one unit of each tenant in turn (a tenant already decoding
        waits for its batch to end), while rows, pinned weights and prompt logits fit."""
        busy = {q.owner for _, units in self.decodings for q in units}
        chosen: list[_Queued] = []
        rows: dict[str, int] = {}
        keys: set[str] = set()
        progress = True
        while progress:
            progress = False
            for owner in order:
                queue = self.samples.get(owner)
                if not queue or owner in busy:
                    continue
                q = queue[0]
                if chosen and (q.alone or chosen[0].alone):
                    continue
                n = int(q.args["num_samples"])
                if not self.worker.can_pin(keys | {q.args["key"]}) or (chosen and (
                        rows.get(owner, 0) + n > TENANT_ROWS or not self._fits(chosen, q))):
                    continue
                chosen.append(queue.popleft())
                rows[owner] = rows.get(owner, 0) + n
                keys.add(q.args["key"])
                progress = True
        if not chosen:
            return
        for q in chosen:
            self._joins(q)
        try:
            decoding, errors = self.worker.open_decoding([q.args for q in chosen])
        except Exception as e:
            decoding, errors = None, [e] * len(chosen)
        units = []
        for q, error in zip(chosen, errors, strict=True):
            if error is None:
                units.append(q)
            else:
                finished.append((q, failed_reply("sample", error)))
        if decoding is not None:
            self.decodings.appendleft((decoding, units))  # its prompt goes in first

    @staticmethod
    def _fits(chosen: list[_Queued], q: _Queued) -> bool:
        """Whether ``q`` may join: a batch computing prompt logprobs has logits at every prompt position of every
        row, so its rows x prompt width stays within MICRO_BATCH_TOKENS (as the sampler's decode batches)."""
        from rota_tinker._worker.sampling import needs_prompt_logits

        batch = [*chosen, q]
        if not any(needs_prompt_logits(u.args["params"]) for u in batch):
            return True
        rows = sum(int(u.args["num_samples"]) for u in batch)
        return rows * max(len(u.args["prompt"]) for u in batch) <= MICRO_BATCH_TOKENS

    # ------------------------------------------------------------------ replies

    def _done(self, q: _Queued, outcome: tuple[Any, ...]) -> None:
        if q.op == "unload":
            self.model_owner.pop(q.args["model_id"], None)
        if outcome[0] == "ok" and isinstance(outcome[1], dict) and "timing" in outcome[1]:
            q.timing.update(outcome[1].pop("timing"))
        q.timing.update({"pass": float(self.passes), "passes": float(self.passes - q.seen_pass),
                         "decode_steps": float(self.decode_steps - q.seen_steps)})
        self.reply(q.rid, outcome, q.timing)
