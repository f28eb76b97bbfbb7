"""``off_turn(fn)``: run a host-side function (a slow reward: a sandbox, a judge over HTTP) without the turn.

Who calls it: a TRL script wraps its reward function, ``reward_funcs=[rota_trl.off_turn(judge)]``. TRL calls
reward functions inside the optimizer step, while :class:`rota_trl.RotaCallback` holds the job's turn; the
wrapper gives the turn back for the call and takes it again after, so another job computes meanwhile. The
state stays resident unless the orchestrator parks it for the next holder (then the re-acquire restores it).

Which callback: the one whose training runs in the calling thread (TRL calls synchronous reward functions
there), else the only one training in this process (asynchronous reward functions run on TRL's event-loop
thread). With several trainers in one process, bind it: ``callback.off_turn(fn)``. Outside training (no
callback active) the function just runs. Several calls at once (TRL gathers async rewards concurrently)
release once and take the turn again when the last one returns.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rota_trl._callback import RotaCallback

__all__ = ["OffTurn", "active_callback", "off_turn", "register_active", "unregister_active"]

_lock = threading.Lock()
_active: list[RotaCallback] = []  # callbacks between on_train_begin and on_train_end, in this process
_local = threading.local()  # .callback: the one training in this thread


class Releaser(Protocol):
    """What :class:`OffTurn` needs of a callback: give the turn back, take it again (both idempotent)."""

    def give_turn(self) -> bool: ...

    def take_turn(self) -> None: ...


def register_active(callback: RotaCallback) -> None:
    """Called by the callback at ``on_train_begin``, in the training thread."""
    with _lock:
        if callback not in _active:
            _active.append(callback)
    _local.callback = callback


def unregister_active(callback: RotaCallback) -> None:
    """Called by the callback when training ends (or it is closed)."""
    with _lock:
        if callback in _active:
            _active.remove(callback)
    if getattr(_local, "callback", None) is callback:
        _local.callback = None


def active_callback() -> RotaCallback | None:
    """The callback :func:`off_turn` gives the turn of: this thread's, else the process's only one.

    :raises RuntimeError: several trainers train in this process and none in this thread.
    """
    mine = getattr(_local, "callback", None)
    if mine is not None:
        return mine
    with _lock:
        if len(_active) > 1:
            names = ", ".join(repr(c.tenant) for c in _active)
            raise RuntimeError(f"rota_trl.off_turn: {len(_active)} trainers train in this process ({names}) and "
                               "none in this thread; bind the function to one: callback.off_turn(fn)")
        return _active[0] if _active else None


class OffTurn:
    """Counts the calls running off the turn for one callback: the first gives the turn, the last takes it.

    ``intervals`` records (start, end) of every call in ``time.monotonic()`` seconds (the clock rota's turn
    events use), so a timeline can show what ran off the turn.
    """

    KEEP = 10_000  # intervals kept: a long job must not grow without bound

    def __init__(self, owner: Releaser) -> None:
        self.owner = owner
        self.intervals: list[tuple[float, float]] = []
        self._cv = threading.Condition()
        self._inside = 0
        self._released = False

    def enter(self) -> float:
        with self._cv:
            self._inside += 1
            if self._inside == 1:
                self._released = self.owner.give_turn()
        return time.monotonic()

    def leave(self, started: float) -> None:
        with self._cv:
            self._inside -= 1
            if len(self.intervals) < self.KEEP:
                self.intervals.append((started, time.monotonic()))
            if self._inside == 0 and self._released:
                self._released = False
                self.owner.take_turn()

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run off this owner's turn (a coroutine function stays one)."""
        return _wrap(fn, lambda: self)


def _wrap(fn: Callable[..., Any], find: Callable[[], OffTurn | None]) -> Callable[..., Any]:
    if not callable(fn):
        raise TypeError(f"off_turn needs a callable (a reward function), got {type(fn).__name__}")
    call = getattr(fn, "__call__", None)  # noqa: B004 - a callable class instance may carry the async
    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(call):
        @functools.wraps(fn)
        async def run_async(*args: Any, **kwargs: Any) -> Any:
            gate = find()
            if gate is None:
                return await fn(*args, **kwargs)
            started = await asyncio.to_thread(gate.enter)  # a blocking RPC: not on the event loop
            try:
                return await fn(*args, **kwargs)
            finally:
                await asyncio.to_thread(gate.leave, started)

        run_async.__name__ = getattr(fn, "__name__", type(fn).__name__)  # TRL names its reward metrics so
        return run_async

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        gate = find()
        if gate is None:
            return fn(*args, **kwargs)
        started = gate.enter()
        try:
            return fn(*args, **kwargs)
        finally:
            gate.leave(started)

    run.__name__ = getattr(fn, "__name__", type(fn).__name__)  # a callable instance has none: its class's
    return run


def off_turn(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a reward function, sync or async) run without the job's turn; same name and signature.

    The turn is given back when it is called inside a training step and taken again (restoring the state if
    it was parked) before it returns. Exceptions pass through, after the turn is taken again.
    """
    def find() -> OffTurn | None:
        callback = active_callback()
        return callback.gate if callback is not None else None

    return _wrap(fn, find)
