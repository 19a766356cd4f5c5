"""The application's hooks: ``on_claim``, ``on_replay``, ``on_conflict``,
``on_mismatch``, ``on_expired`` and ``on_error``, called with a ``HookEvent`` for each answer
the middleware or a job gives (metrics, logs, traces); a completer has
``on_claim``, ``on_finish`` and ``on_error``.

A hook observes and never decides: one that raises is logged and the answer
stays what it was. A hook may be a coroutine function where an event loop runs
(the ASGI middleware, async jobs): its coroutine is scheduled, not awaited, and
its failure logged; in a sync job it is closed unrun, with a warning.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

__all__ = ["HookEvent", "Hook", "Hooks"]

NAMES = ("claim", "replay", "conflict", "mismatch", "expired", "error", "finish")


@dataclass(frozen=True)
class HookEvent:
    """What a hook is told. ``request``: the ``IdempotencyRequest`` (HTTP) or
    the job's request payload. ``token`` and ``attempt`` where there is an
    attempt; ``status`` on a replay (the HTTP status, or "succeeded"/"failed"
    for a job); on an expired key ``status`` ("succeeded"/"failed") and
    ``response_code`` (the stored HTTP status, None for a job's key);
    ``retry_after`` on a conflict; ``error`` on an error. A completer's
    events: ``phase`` (the recovery point it resumes from) on a claim, and on
    a finish ``status`` ("succeeded", "failed" or "released") and ``error``
    (the handler's, when it raised)."""
    kind: str
    key: str
    scope: str
    request: Any = None
    token: Optional[str] = None
    attempt: Optional[int] = None
    status: Any = None
    cached: bool = False
    retry_after: Optional[int] = None
    error: Optional[BaseException] = None
    response_code: Optional[int] = None
    phase: Optional[str] = None


Hook = Callable[[HookEvent], Any]


class Hooks:
    """The hooks of one middleware or job, checked when it is built."""

    def __init__(self, logger: logging.Logger, **hooks: Optional[Hook]) -> None:
        self._log = logger
        self._tasks: "set[asyncio.Task[Any]]" = set()   # scheduled hooks, kept until done
        self._hooks: dict[str, Optional[Hook]] = {}
        for name in NAMES:
            fn = hooks.get(f"on_{name}")
            if fn is not None and not callable(fn):
                raise TypeError(f"on_{name} must be callable, got {type(fn).__name__}")
            self._hooks[name] = fn

    def emit(self, kind: str, key: str, scope: str, **fields: Any) -> None:
        fn = self._hooks[kind]
        if fn is None:
            return
        try:
            result = fn(HookEvent(kind=kind, key=key, scope=scope, **fields))
        except Exception:  # a hook's failure never changes the answer
            self._log.exception("pg-idempotency: the on_%s hook failed; the answer is unchanged",
                                kind)
            return
        if inspect.isawaitable(result):
            self._schedule(kind, result)

    def _schedule(self, kind: str, awaitable: Any) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            if inspect.iscoroutine(awaitable):
                awaitable.close()
            self._log.warning("pg-idempotency: the on_%s hook returned an awaitable outside an "
                              "event loop (a sync job); it did not run", kind)
            return
        task = loop.create_task(awaitable)
        self._tasks.add(task)

        def done(t: "asyncio.Task[Any]") -> None:
            self._tasks.discard(t)
            if not t.cancelled() and t.exception() is not None:
                self._log.error("pg-idempotency: the on_%s hook failed; the answer is "
                                "unchanged", kind, exc_info=t.exception())
        task.add_done_callback(done)
