"""Transitions that outlive their caller, and grant futures whose caller may be gone."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

_T = TypeVar("_T")


def whole(fn: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
    """Run a transition to its end even if the caller is cancelled part-way.

    A transition changes a group in memory and then awaits ``store.commit``. A gRPC
    handler cancelled at that await (its client went away) would leave memory, the
    store and the waiters disagreeing: a holder removed but nobody granted next.
    Shielded, the transition always finishes; only the caller stops waiting.
    """

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> _T:
        task = asyncio.ensure_future(fn(*args, **kwargs))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved if nobody awaits it
        return await asyncio.shield(task)

    return wrapper


def fail(fut: asyncio.Future, exc: BaseException) -> None:
    """Fail a grant future whose caller may be gone (then nobody would read the error)."""
    fut.set_exception(exc)
    fut.exception()  # marks it retrieved: no "exception was never retrieved" noise

