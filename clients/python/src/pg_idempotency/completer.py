"""Completers: finish the keys of a scope that a crashed or stalled attempt
left pending, instead of waiting for the client to retry (extension 1.8).

::

    with completer(pool, scope="orders", handler=finish_order,
                   listen_conninfo="host=db-primary dbname=shop") as c:
        serve_forever()

A key claimed with ``keep_request=True`` stores its request. When its
attempt dies, its lease ends (or its session-bound owner's session does)
and the sweep notifies ``idempotency_abandoned`` with the scope; the
completer, listening on a connection of its own, takes such keys over with
``idem_claim_abandoned`` (up to ``concurrency`` at once) and runs the
handler on each, from its last recovery point with the stored request. A
slow poll backs the notification up, and runs alone while the LISTEN
connection is down. ``stop()`` takes over nothing more and waits for the
running handlers.

This module owns the LISTEN connection, the poll and the batches. Running a
taken-over key (the heartbeat, checkpoints, the finish or the release) is
the job classes' (``jobs.Idempotent`` and ``AsyncIdempotent``), so that a
handler written for ``idempotent()`` sees the same job here; the handler's
return value is stored as a job's value (``kind="job"``) or, for keys of the
HTTP middlewares, as the response a retry replays (``kind="http"``).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import sys
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import (Any, Awaitable, Callable, Dict, Literal, Mapping, Optional, Set, Tuple,
                    Type, Union, overload)

import psycopg
from psycopg.rows import tuple_row
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from ._core import (COMPLETER_EXTENSION, RELEASE_SQL, ClaimRow, Duration, KeyLostError,
                    ServerInfo, afetch_one, error_envelope, http_envelope, is_lost,
                    remember_option, to_seconds, to_timedelta, too_large_envelope,
                    value_envelope)
from .asgi import FRAMING_HEADERS, default_store_policy
from .hooks import Hook, Hooks
from .jobs import (DEFAULT_LEASE, AsyncIdempotent, AsyncJob, Idempotent, Job, Retryable,
                   _AsyncRunner, _SyncRunner)

__all__ = ["Completer", "AsyncCompleter", "completer", "CHANNEL"]

log = logging.getLogger("pg_idempotency")

#: The channel every sweep that resets keys notifies, with the scope as payload.
CHANNEL = "idempotency_abandoned"
DEFAULT_POLL_INTERVAL = 60.0
#: idem_claim_abandoned takes at most this many keys in one call.
MAX_KEYS = 10000
# The LISTEN connection is tried again after 1 s, then twice as long each
# time, up to 30 s.
_RECONNECT_FIRST = 1.0
_RECONNECT_MOST = 30.0

CLAIM_ABANDONED_SQL = """
SELECT a.key, a.token, a.attempt, a.request, a.phase, a.phase_data
  FROM idempotency.idem_claim_abandoned(scope    => %(scope)s,
                                        max_keys => %(max_keys)s::int,
                                        lease    => %(lease)s::interval) AS a"""

# An HTTP key's finish: the envelope goes as text that PostgreSQL parses, so
# that a JSON body is stored as the handler's bytes say.
_HTTP_FINISH_SQL = """
SELECT idempotency.idem_finish(key           => %(key)s,
                               token         => %(token)s,
                               response_code => %(code)s::int,
                               response_body => %(body)s::jsonb,
                               scope         => %(scope)s,
                               status        => %(status)s,
                               retention     => %(retention)s::interval{remember})"""
_HTTP_FINISH = {False: _HTTP_FINISH_SQL.replace("{remember}", ""),
                True: _HTTP_FINISH_SQL.replace(
                    "{remember}", ",\n                               remember      => "
                                  "%(remember)s::interval")}

#: What the completer stores a handler's value as: a job's value, or an HTTP response.
Kind = Literal["job", "http"]


def http_result(out: Any, max_response_size: int) -> Optional[Tuple[str, str, int]]:
    """What a handler of HTTP keys returns, ``{"status": ..., "headers": ...,
    "body": ...}``, as the finish stores it: (envelope text, status, response
    code), or None when the status releases the key (a 5xx, as in the
    middlewares). A body is bytes, text (str) or any other JSON value; over
    ``max_response_size`` the response is stored without it."""
    status = out.get("status") if isinstance(out, Mapping) else None
    if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
        raise TypeError("the handler of a completer of HTTP keys (kind=\"http\") must return "
                        "{\"status\": ..., \"headers\": ..., \"body\": ...} with an HTTP status")
    decision = default_store_policy(status)
    if decision == "release":
        return None
    headers: Dict[str, str] = {}
    for name, value in (out.get("headers") or {}).items():
        lower = str(name).lower()
        if value is not None and lower not in FRAMING_HEADERS:
            headers[lower] = (", ".join(str(v) for v in value)
                              if isinstance(value, (list, tuple)) else str(value))
    body = out.get("body")
    data = b""
    if status not in (204, 304) and body is not None:
        if isinstance(body, (bytes, bytearray, memoryview)):
            data = bytes(body)
            headers.setdefault("content-type", "application/octet-stream")
        elif isinstance(body, str):
            data = body.encode("utf-8")
            headers.setdefault("content-type", "text/plain; charset=utf-8")
        else:
            data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
            headers.setdefault("content-type", "application/json; charset=utf-8")
    envelope, _ = http_envelope(headers, data, headers.get("content-type"))
    if len(envelope.encode("utf-8")) > max_response_size:
        envelope = too_large_envelope(headers)
    return envelope, decision, status


def _claim_row(row: Tuple[Any, ...]) -> Tuple[str, Any, ClaimRow]:
    """(key, request, the row as a claim's) of a row of idem_claim_abandoned."""
    key, token, attempt, request, phase, phase_data = row
    return key, request, ClaimRow("claimed", token, attempt, None, None, None, None,
                                  phase, phase_data)


class _Options:
    """A completer's options, checked once."""

    def __init__(self, handler: Callable[..., Any], scope: str, concurrency: int,
                 lease: Duration, poll_interval: Duration, retention: Optional[Duration],
                 remember: Optional[Duration], retryable: Optional[Retryable], kind: str,
                 hooks: Hooks, logger: Optional[logging.Logger]) -> None:
        if not callable(handler):
            raise TypeError("completer() needs handler: the function that finishes a key")
        if not isinstance(scope, str):
            raise TypeError(f"scope must be a str, not {type(scope).__name__}")
        if (not isinstance(concurrency, int) or isinstance(concurrency, bool)
                or not 1 <= concurrency <= MAX_KEYS):
            raise ValueError(f"concurrency must be a whole number from 1 to {MAX_KEYS}, "
                             f"got {concurrency!r}")
        if to_seconds(lease) <= 0:
            raise ValueError(f"lease must be more than 0 seconds, got {lease!r}")
        if to_seconds(poll_interval) <= 0:
            raise ValueError(f"poll_interval must be more than 0 seconds, got {poll_interval!r}")
        if retention is not None and to_seconds(retention) <= 0:
            raise ValueError(f"retention must be more than 0 seconds, got {retention!r}")
        if kind not in ("job", "http"):
            raise ValueError(f"kind must be 'job' or 'http', got {kind!r}")
        remember_option(remember)
        self.handler = handler
        self.scope = scope
        self.concurrency = concurrency
        self.lease = lease
        self.poll_interval = to_seconds(poll_interval)
        self.retention = retention
        self.remember = remember
        self.retryable = retryable
        self.kind = kind
        self.hooks = hooks
        self.log = logger or log

    def attempt_kwargs(self, request: Any) -> Dict[str, Any]:
        """The job class's options for one taken-over key. Its own hooks stay
        silent: the completer tells its hooks what happened."""
        return dict(request=request, scope=self.scope, lease=self.lease,
                    retention=self.retention, retryable=self.retryable,
                    remember=self.remember, hooks=Hooks(self.log))


def _http_finish_params(owner: Union[Idempotent, AsyncIdempotent], job: Union[Job, AsyncJob],
                        envelope: str, decision: str, code: int) -> Dict[str, Any]:
    """The parameters of an HTTP key's finish (``_HTTP_FINISH``)."""
    return {"key": owner.key, "token": job._token, "code": code, "body": envelope,
            "scope": owner.scope, "status": decision,
            "retention": to_timedelta(owner._retention), "remember": owner._remember}


def _handler_value(job: Union[Job, AsyncJob], value: Any) -> None:
    """What a handler's return makes the job's value: the value it returned,
    or, when it returned None, what it gave ``set_result()`` (a handler written
    for the block of ``idempotent()``)."""
    if not job._finished and job._failure is None and value is not None:
        job.value = value


def _conninfo_of(pool: Any, listen_conninfo: Optional[str]) -> Tuple[str, Dict[str, Any]]:
    """The LISTEN connection's conninfo and connect() arguments: the given one,
    or the pool's own (right only when the pool reaches the server directly,
    not through a transaction pooler)."""
    if listen_conninfo is not None:
        return listen_conninfo, {"autocommit": True}
    kwargs = {k: v for k, v in (getattr(pool, "kwargs", None) or {}).items()
              if k not in ("autocommit", "row_factory", "prepare_threshold")}
    kwargs["autocommit"] = True
    return getattr(pool, "conninfo", "") or "", kwargs


# ---- sync ------------------------------------------------------------------------


class _SyncAttempt(Idempotent):
    """A taken-over key run as a job: it settles as the block of
    ``idempotent()`` does, except that an HTTP key stores a response, and it
    records how it settled (``settled``) and raises what the store refused."""

    def __init__(self, pool: ConnectionPool, key: str, *, kind: str, info: ServerInfo,
                 **kw: Any) -> None:
        super().__init__(pool, key, **kw)
        self._kind = kind
        self._info = info
        self.settled: Optional[str] = None

    def _settle_clean(self, job: Job) -> None:
        if job._finished:
            self.settled = "succeeded"
            return
        if job._lost_state is not None:
            raise KeyLostError(key=self.key, scope=self.scope, sqlstate=job._lost_state)
        if job._failure is not None:
            self._store(error_envelope(job._failure), "failed")
            self.settled = "failed"
        elif self._kind == "http":
            stored = http_result(job.value, self._info.max_response_size)
            if stored is None:
                self._release(job)
            else:
                envelope, decision, code = stored
                self._finish_http(job, envelope, decision, code)
        else:
            self._store(value_envelope(job.value), "succeeded")
            self.settled = "succeeded"
        job._finished = True

    def _settle_error(self, job: Job, exc: BaseException) -> None:
        if job._lost_state is not None:
            raise KeyLostError(key=self.key, scope=self.scope, sqlstate=job._lost_state)
        if not isinstance(exc, Exception) or self._retryable(exc):
            self._release(job)
        else:
            self._store(error_envelope(exc), "failed")
            self.settled = "failed"

    def _release(self, job: Job) -> None:
        try:
            self._runner.token_call(RELEASE_SQL, {"key": self.key, "token": job._token,
                                                  "scope": self.scope})
        except psycopg.Error as e:
            if is_lost(e):
                raise KeyLostError(key=self.key, scope=self.scope, sqlstate=e.sqlstate) from e
            raise
        self.settled = "released"

    def _finish_http(self, job: Job, envelope: str, decision: str, code: int) -> None:
        params = _http_finish_params(self, job, envelope, decision, code)
        try:
            self._runner.token_call(_HTTP_FINISH[self._remember is not None], params)
        except psycopg.Error as e:
            if is_lost(e):
                raise KeyLostError(key=self.key, scope=self.scope, sqlstate=e.sqlstate) from e
            raise
        self.settled = decision


class Completer:
    """The completer of one scope, on a psycopg ``ConnectionPool``; handlers
    run in threads, up to ``concurrency`` at once. See ``completer()``."""

    def __init__(self, pool: ConnectionPool, *, handler: Callable[[Job], Any],
                 scope: str = "", concurrency: int = 1, lease: Duration = DEFAULT_LEASE,
                 poll_interval: Duration = DEFAULT_POLL_INTERVAL,
                 retention: Optional[Duration] = None, remember: Optional[Duration] = None,
                 retryable: Optional[Retryable] = None, kind: Kind = "job",
                 listen_conninfo: Union[str, None, Literal[False]] = None,
                 on_claim: Optional[Hook] = None, on_finish: Optional[Hook] = None,
                 on_error: Optional[Hook] = None,
                 logger: Optional[logging.Logger] = None) -> None:
        if not isinstance(pool, ConnectionPool):
            raise TypeError(f"Completer needs a ConnectionPool, not {type(pool).__name__}")
        if inspect.iscoroutinefunction(handler):
            raise TypeError("an async handler needs an AsyncConnectionPool (AsyncCompleter)")
        self._opts = _Options(handler, scope, concurrency, lease, poll_interval, retention,
                              remember, retryable, kind,
                              Hooks(logger or log, on_claim=on_claim, on_finish=on_finish,
                                    on_error=on_error), logger)
        self._pool = pool
        self._listen: Optional[Tuple[str, Dict[str, Any]]] = (
            None if listen_conninfo is False else _conninfo_of(pool, listen_conninfo))
        self._info: Optional[ServerInfo] = None
        self._lock = threading.Lock()          # running, backlog
        self._pump_lock = threading.Lock()     # one batch of claims at a time
        self._running: Set["Future[None]"] = set()
        self._backlog = False
        self._started = False
        self._stopping = threading.Event()
        self._wake = threading.Event()
        self._listening = False
        self._listen_tried = threading.Event()
        # a channel of this completer's own, on which stop() wakes the LISTEN thread
        self._stop_channel = "pg_idempotency_completer_" + uuid.uuid4().hex
        self._executor: Optional[ThreadPoolExecutor] = None
        self._loop_thread: Optional[threading.Thread] = None
        self._listen_thread: Optional[threading.Thread] = None

    @property
    def running(self) -> int:
        """The handlers running now."""
        with self._lock:
            return len(self._running)

    @property
    def listening(self) -> bool:
        """Whether the LISTEN connection is up (False: the completer only polls)."""
        return self._listening

    def start(self) -> None:
        """Check the extension (1.8 or later, else ``MisconfiguredError``),
        listen, and take over what is abandoned now. Returns once the first
        LISTEN was tried (a failed one is tried again in the background while
        the poll goes on)."""
        if self._started:
            raise RuntimeError("this completer was already started")
        self._started = True
        self._info = _SyncRunner(self._pool).info(COMPLETER_EXTENSION, " (completer)")
        self._executor = ThreadPoolExecutor(max_workers=self._opts.concurrency,
                                            thread_name_prefix="pg-idempotency-completer")
        if self._listen is not None:
            self._listen_thread = threading.Thread(target=self._listen_loop, daemon=True,
                                                   name="pg-idempotency-completer-listen")
            self._listen_thread.start()
            self._listen_tried.wait()
        if not self._listening:
            self._wake.set()
        self._loop_thread = threading.Thread(target=self._loop, daemon=True,
                                             name="pg-idempotency-completer")
        self._loop_thread.start()

    def poll(self) -> int:
        """Take over what is abandoned now; returns the number of keys taken over."""
        if not self._started or self._stopping.is_set():
            return 0
        return self._pump()

    def stop(self) -> None:
        """Take over nothing more, close the LISTEN connection, and return once
        every running handler has settled its key."""
        if not self._started or self._stopping.is_set():
            return
        self._stopping.set()
        self._wake.set()
        if self._listen_thread is not None and self._listen_thread.is_alive():
            self._wake_listener()
            self._listen_thread.join()
        if self._loop_thread is not None:
            self._loop_thread.join()
        with self._pump_lock:       # a batch in flight hands its keys to the executor first
            pass
        if self._executor is not None:
            self._executor.shutdown(wait=True)

    def __enter__(self) -> "Completer":
        self.start()
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.stop()

    # ---- taking keys over

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._opts.poll_interval)
            self._wake.clear()
            if not self._stopping.is_set():
                self._pump()

    def _pump(self) -> int:
        """Take over up to the free slots' worth of abandoned keys, again while
        a batch comes back full."""
        opts = self._opts
        taken = 0
        with self._pump_lock:
            try:
                while not self._stopping.is_set():
                    with self._lock:
                        want = opts.concurrency - len(self._running)
                        if want <= 0:
                            self._backlog = True
                            break
                    with self._pool.connection() as conn:
                        cur = conn.cursor(row_factory=tuple_row)
                        cur.execute(CLAIM_ABANDONED_SQL, {
                            "scope": opts.scope, "max_keys": want,
                            "lease": to_timedelta(opts.lease)}, prepare=False)
                        rows = cur.fetchall()
                        if not conn.autocommit:
                            conn.commit()
                    # claimed is owned: each row runs, even if stop() came meanwhile
                    for row in rows:
                        self._start(row)
                    taken += len(rows)
                    with self._lock:
                        self._backlog = len(rows) == want
                    if len(rows) < want:
                        break
            except psycopg.Error as e:
                opts.log.warning("pg-idempotency: the completer of scope %r could not take "
                                 "over abandoned keys; it tries again at the next "
                                 "notification or poll (%s s): %s", opts.scope,
                                 opts.poll_interval, e)
        return taken

    def _start(self, row: Tuple[Any, ...]) -> None:
        assert self._executor is not None
        with self._lock:
            future = self._executor.submit(self._run, row)
            self._running.add(future)
        future.add_done_callback(self._done)

    def _done(self, future: "Future[None]") -> None:
        with self._lock:
            self._running.discard(future)
            again = self._backlog
        if again and not self._stopping.is_set():
            self._wake.set()

    def _run(self, row: Tuple[Any, ...]) -> None:
        """Run the handler for one taken-over key, from its recovery point with
        its stored request, and settle the key."""
        opts = self._opts
        key, request, claim = _claim_row(row)
        assert self._info is not None
        event: Dict[str, Any] = dict(request=request, token=str(claim.token),
                                     attempt=claim.attempt)
        opts.hooks.emit("claim", key, opts.scope, phase=claim.phase, **event)
        attempt = _SyncAttempt(self._pool, key, kind=opts.kind, info=self._info,
                               **opts.attempt_kwargs(request))
        job = attempt._adopt(claim)
        exc_info: Tuple[Any, Any, Any] = (None, None, None)
        try:
            _handler_value(job, opts.handler(job))
        except BaseException:
            exc_info = sys.exc_info()
        handler_error = exc_info[1]
        try:
            attempt.__exit__(*exc_info)
        except Exception as e:
            opts.log.warning("pg-idempotency: the completer could not settle key %r (scope "
                             "%r): %s", key, opts.scope, e)
            opts.hooks.emit("error", key, opts.scope, error=e, **event)
            return
        if handler_error is not None:
            opts.log.warning("pg-idempotency: the completer's handler of key %r (scope %r) "
                             "raised %r; the key was %s", key, opts.scope, handler_error,
                             attempt.settled)
        opts.hooks.emit("finish", key, opts.scope, status=attempt.settled,
                        error=handler_error, **event)

    # ---- the LISTEN connection

    def _listen_loop(self) -> None:
        assert self._listen is not None
        conninfo, kwargs = self._listen
        delay = _RECONNECT_FIRST
        opts = self._opts
        while not self._stopping.is_set():
            conn: Optional[psycopg.Connection[Any]] = None
            try:
                conn = psycopg.Connection.connect(conninfo, **kwargs)
                conn.execute(f"LISTEN {CHANNEL}")
                conn.execute(f'LISTEN "{self._stop_channel}"')
                self._listening = True
                delay = _RECONNECT_FIRST
                # what was notified while nobody listened is lost: look now
                self._wake.set()
                self._listen_tried.set()
                # stop() notifies the stop channel after it sets _stopping: seen
                # not set here, its notification comes after this LISTEN
                if self._stopping.is_set():
                    return
                for n in conn.notifies():
                    if self._stopping.is_set():
                        break
                    if n.channel == CHANNEL and n.payload == opts.scope:
                        self._wake.set()
            except Exception as e:
                if not self._stopping.is_set():
                    opts.log.warning("pg-idempotency: the completer's LISTEN connection (scope "
                                     "%r) failed; it polls every %s s until it is back: %s",
                                     opts.scope, opts.poll_interval, e)
            finally:
                self._listening = False
                self._listen_tried.set()
                if conn is not None:
                    conn.close()
            if self._stopping.wait(delay):
                return
            delay = min(delay * 2, _RECONNECT_MOST)

    def _wake_listener(self) -> None:
        """End the LISTEN thread's wait for notifications: a notification on
        this completer's own channel, from any session of the database (the
        pool's, else one of the LISTEN connection's settings)."""
        notify = f'NOTIFY "{self._stop_channel}"'
        try:
            with self._pool.connection() as conn:
                conn.execute(notify, prepare=False)
                if not conn.autocommit:
                    conn.commit()
            return
        except psycopg.Error as e:
            self._opts.log.warning("pg-idempotency: could not wake the completer's LISTEN "
                                   "connection through the pool: %s", e)
        assert self._listen is not None
        conninfo, kwargs = self._listen
        try:
            with psycopg.Connection.connect(conninfo, **kwargs) as conn:
                conn.execute(notify)
        except psycopg.Error as e:      # the LISTEN connection then fails on its own
            self._opts.log.warning("pg-idempotency: could not wake the completer's LISTEN "
                                   "connection: %s", e)


# ---- async -----------------------------------------------------------------------


class _AsyncAttempt(AsyncIdempotent):
    """``_SyncAttempt`` for asyncio."""

    def __init__(self, pool: AsyncConnectionPool, key: str, *, kind: str, info: ServerInfo,
                 **kw: Any) -> None:
        super().__init__(pool, key, **kw)
        self._kind = kind
        self._info = info
        self.settled: Optional[str] = None

    async def _settle_clean(self, job: AsyncJob) -> None:
        if job._finished:
            self.settled = "succeeded"
            return
        if job._lost_state is not None:
            raise KeyLostError(key=self.key, scope=self.scope, sqlstate=job._lost_state)
        if job._failure is not None:
            await self._store(error_envelope(job._failure), "failed")
            self.settled = "failed"
        elif self._kind == "http":
            stored = http_result(job.value, self._info.max_response_size)
            if stored is None:
                await self._release(job)
            else:
                envelope, decision, code = stored
                await self._finish_http(job, envelope, decision, code)
        else:
            await self._store(value_envelope(job.value), "succeeded")
            self.settled = "succeeded"
        job._finished = True

    async def _settle_error(self, job: AsyncJob, exc: BaseException) -> None:
        if job._lost_state is not None:
            raise KeyLostError(key=self.key, scope=self.scope, sqlstate=job._lost_state)
        if not isinstance(exc, Exception) or self._retryable(exc):
            await self._release(job)
        else:
            await self._store(error_envelope(exc), "failed")
            self.settled = "failed"

    async def _release(self, job: AsyncJob) -> None:
        try:
            await self._runner.token_call(RELEASE_SQL, {"key": self.key, "token": job._token,
                                                        "scope": self.scope})
        except psycopg.Error as e:
            if is_lost(e):
                raise KeyLostError(key=self.key, scope=self.scope, sqlstate=e.sqlstate) from e
            raise
        self.settled = "released"

    async def _finish_http(self, job: AsyncJob, envelope: str, decision: str,
                           code: int) -> None:
        params = _http_finish_params(self, job, envelope, decision, code)
        try:
            await self._runner.token_call(_HTTP_FINISH[self._remember is not None], params)
        except psycopg.Error as e:
            if is_lost(e):
                raise KeyLostError(key=self.key, scope=self.scope, sqlstate=e.sqlstate) from e
            raise
        self.settled = decision


class AsyncCompleter:
    """The completer of one scope, on a psycopg ``AsyncConnectionPool``;
    handlers run as tasks, up to ``concurrency`` at once. See ``completer()``."""

    def __init__(self, pool: AsyncConnectionPool, *,
                 handler: Callable[[AsyncJob], Union[Any, Awaitable[Any]]],
                 scope: str = "", concurrency: int = 1, lease: Duration = DEFAULT_LEASE,
                 poll_interval: Duration = DEFAULT_POLL_INTERVAL,
                 retention: Optional[Duration] = None, remember: Optional[Duration] = None,
                 retryable: Optional[Retryable] = None, kind: Kind = "job",
                 listen_conninfo: Union[str, None, Literal[False]] = None,
                 on_claim: Optional[Hook] = None, on_finish: Optional[Hook] = None,
                 on_error: Optional[Hook] = None,
                 logger: Optional[logging.Logger] = None) -> None:
        if not isinstance(pool, AsyncConnectionPool):
            raise TypeError(f"AsyncCompleter needs an AsyncConnectionPool, not "
                            f"{type(pool).__name__}")
        self._opts = _Options(handler, scope, concurrency, lease, poll_interval, retention,
                              remember, retryable, kind,
                              Hooks(logger or log, on_claim=on_claim, on_finish=on_finish,
                                    on_error=on_error), logger)
        self._pool = pool
        self._listen: Optional[Tuple[str, Dict[str, Any]]] = (
            None if listen_conninfo is False else _conninfo_of(pool, listen_conninfo))
        self._info: Optional[ServerInfo] = None
        self._running: Set["asyncio.Task[None]"] = set()
        self._backlog = False
        self._started = False
        self._stopping = False
        self._listening = False
        # made in start(), inside the event loop
        self._wake: Optional[asyncio.Event] = None
        self._pump_lock: Optional[asyncio.Lock] = None
        self._loop_task: Optional["asyncio.Task[None]"] = None
        self._listen_task: Optional["asyncio.Task[None]"] = None
        self._stopped: Optional["asyncio.Future[None]"] = None

    @property
    def running(self) -> int:
        """The handlers running now."""
        return len(self._running)

    @property
    def listening(self) -> bool:
        """Whether the LISTEN connection is up (False: the completer only polls)."""
        return self._listening

    async def start(self) -> None:
        """See ``Completer.start``."""
        if self._started:
            raise RuntimeError("this completer was already started")
        self._started = True
        self._wake = asyncio.Event()
        self._pump_lock = asyncio.Lock()
        self._info = await _AsyncRunner(self._pool).info(COMPLETER_EXTENSION, " (completer)")
        if self._listen is not None:
            tried = asyncio.Event()
            self._listen_task = asyncio.ensure_future(self._listen_loop(tried))
            await tried.wait()
        if not self._listening:
            self._wake.set()
        self._loop_task = asyncio.ensure_future(self._loop())

    async def poll(self) -> int:
        """See ``Completer.poll``."""
        if not self._started or self._stopping:
            return 0
        return await self._pump()

    async def stop(self) -> None:
        """See ``Completer.stop``."""
        if not self._started:
            return
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
            return
        self._stopped = asyncio.get_running_loop().create_future()
        self._stopping = True
        assert self._wake is not None and self._pump_lock is not None
        self._wake.set()
        if self._listen_task is not None:
            self._listen_task.cancel()
            await asyncio.gather(self._listen_task, return_exceptions=True)
        if self._loop_task is not None:
            await self._loop_task
        async with self._pump_lock:     # a batch in flight starts its keys' tasks first
            pass
        while self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        self._stopped.set_result(None)

    async def __aenter__(self) -> "AsyncCompleter":
        await self.start()
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]],
                        exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        await self.stop()

    # ---- taking keys over

    async def _loop(self) -> None:
        assert self._wake is not None
        while not self._stopping:
            try:
                await asyncio.wait_for(self._wake.wait(), self._opts.poll_interval)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            if not self._stopping:
                await self._pump()

    async def _pump(self) -> int:
        """See ``Completer._pump``."""
        opts = self._opts
        assert self._pump_lock is not None
        taken = 0
        async with self._pump_lock:
            try:
                while not self._stopping:
                    want = opts.concurrency - len(self._running)
                    if want <= 0:
                        self._backlog = True
                        break
                    async with self._pool.connection() as conn:
                        cur = conn.cursor(row_factory=tuple_row)
                        await cur.execute(CLAIM_ABANDONED_SQL, {
                            "scope": opts.scope, "max_keys": want,
                            "lease": to_timedelta(opts.lease)}, prepare=False)
                        rows = await cur.fetchall()
                        if not conn.autocommit:
                            await conn.commit()
                    # claimed is owned: each row runs, even if stop() came meanwhile
                    for row in rows:
                        task = asyncio.ensure_future(self._run(row))
                        self._running.add(task)
                        task.add_done_callback(self._done)
                    taken += len(rows)
                    self._backlog = len(rows) == want
                    if len(rows) < want:
                        break
            except psycopg.Error as e:
                opts.log.warning("pg-idempotency: the completer of scope %r could not take "
                                 "over abandoned keys; it tries again at the next "
                                 "notification or poll (%s s): %s", opts.scope,
                                 opts.poll_interval, e)
        return taken

    def _done(self, task: "asyncio.Task[None]") -> None:
        self._running.discard(task)
        if self._backlog and not self._stopping and self._wake is not None:
            self._wake.set()

    async def _run(self, row: Tuple[Any, ...]) -> None:
        """See ``Completer._run``."""
        opts = self._opts
        key, request, claim = _claim_row(row)
        assert self._info is not None
        event: Dict[str, Any] = dict(request=request, token=str(claim.token),
                                     attempt=claim.attempt)
        opts.hooks.emit("claim", key, opts.scope, phase=claim.phase, **event)
        attempt = _AsyncAttempt(self._pool, key, kind=opts.kind, info=self._info,
                                **opts.attempt_kwargs(request))
        job = await attempt._adopt(claim)
        exc_info: Tuple[Any, Any, Any] = (None, None, None)
        try:
            value = opts.handler(job)
            if inspect.isawaitable(value):
                value = await value
            _handler_value(job, value)
        except BaseException:
            exc_info = sys.exc_info()
        handler_error = exc_info[1]
        try:
            await attempt.__aexit__(*exc_info)
        except Exception as e:
            opts.log.warning("pg-idempotency: the completer could not settle key %r (scope "
                             "%r): %s", key, opts.scope, e)
            opts.hooks.emit("error", key, opts.scope, error=e, **event)
            return
        if handler_error is not None:
            opts.log.warning("pg-idempotency: the completer's handler of key %r (scope %r) "
                             "raised %r; the key was %s", key, opts.scope, handler_error,
                             attempt.settled)
        opts.hooks.emit("finish", key, opts.scope, status=attempt.settled,
                        error=handler_error, **event)

    # ---- the LISTEN connection

    async def _listen_loop(self, tried: asyncio.Event) -> None:
        assert self._listen is not None and self._wake is not None
        conninfo, kwargs = self._listen
        delay = _RECONNECT_FIRST
        opts = self._opts
        wake = self._wake
        while not self._stopping:
            conn: Optional[psycopg.AsyncConnection[Any]] = None
            try:
                conn = listener = await psycopg.AsyncConnection.connect(conninfo, **kwargs)
                await listener.execute(f"LISTEN {CHANNEL}")
                self._listening = True
                delay = _RECONNECT_FIRST
                # what was notified while nobody listened is lost: look now
                wake.set()
                tried.set()
                async for n in listener.notifies():
                    if n.channel == CHANNEL and n.payload == opts.scope:
                        wake.set()
            except Exception as e:
                if not self._stopping:
                    opts.log.warning("pg-idempotency: the completer's LISTEN connection (scope "
                                     "%r) failed; it polls every %s s until it is back: %s",
                                     opts.scope, opts.poll_interval, e)
            finally:
                self._listening = False
                tried.set()
                if conn is not None:
                    await conn.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RECONNECT_MOST)


# ---- the entry point -------------------------------------------------------------


@overload
def completer(pool: ConnectionPool, *, handler: Callable[[Job], Any], scope: str = ...,
              concurrency: int = ..., lease: Duration = ..., poll_interval: Duration = ...,
              retention: Optional[Duration] = ..., remember: Optional[Duration] = ...,
              retryable: Optional[Retryable] = ..., kind: Kind = ...,
              listen_conninfo: Union[str, None, Literal[False]] = ...,
              on_claim: Optional[Hook] = ..., on_finish: Optional[Hook] = ...,
              on_error: Optional[Hook] = ...,
              logger: Optional[logging.Logger] = ...) -> Completer: ...


@overload
def completer(pool: AsyncConnectionPool, *,
              handler: Callable[[AsyncJob], Union[Any, Awaitable[Any]]], scope: str = ...,
              concurrency: int = ..., lease: Duration = ..., poll_interval: Duration = ...,
              retention: Optional[Duration] = ..., remember: Optional[Duration] = ...,
              retryable: Optional[Retryable] = ..., kind: Kind = ...,
              listen_conninfo: Union[str, None, Literal[False]] = ...,
              on_claim: Optional[Hook] = ..., on_finish: Optional[Hook] = ...,
              on_error: Optional[Hook] = ...,
              logger: Optional[logging.Logger] = ...) -> AsyncCompleter: ...


def completer(pool: Union[ConnectionPool, AsyncConnectionPool], **options: Any
              ) -> Union[Completer, AsyncCompleter]:
    """A completer of one scope, not started yet: ``with`` / ``start()`` for a
    ``ConnectionPool`` (``Completer``: handlers in threads), ``async with`` /
    ``await start()`` for an ``AsyncConnectionPool`` (``AsyncCompleter``).
    Needs extension 1.8.

    ``handler(job)``: finishes one taken-over key. ``job`` is what the block
    of ``idempotent()`` gets (``key``, ``scope``, ``token``, ``attempt``,
    ``phase`` and ``phase_data`` from the last recovery point,
    ``checkpoint()``, ``set_result()``, ``fail()``), with ``request`` the
    request the original claim stored (``keep_request=True``); inside it
    ``current_job()`` is that job. Its return value is stored as the job's
    value (``kind="job"``), or is the response to store (``kind="http"``:
    ``{"status": 201, "headers": {...}, "body": ...}``, the middlewares'
    status policy deciding, so a 5xx releases the key). An exception releases
    the key when ``retryable`` says so (by default always), else it is stored
    as the key's failure.

    ``scope``: whose abandoned keys (default ""). ``concurrency``: handlers
    at once, and so the most keys one ``idem_claim_abandoned`` takes (default
    1). ``lease``: each takeover's lease, renewed every lease/3 while the
    handler runs (default 30 s). ``poll_interval``: seconds between polls,
    the fallback for a missed notification and while LISTEN is down (default
    60). ``retention``, ``remember``: None (default) keeps what the original
    claim set. ``listen_conninfo``: the conninfo of the LISTEN connection,
    which must reach the server directly (PgBouncer in transaction mode does
    not deliver notifications), while the pool may go through a pooler;
    default the pool's own conninfo; False: poll only. ``on_claim``,
    ``on_finish``, ``on_error``: hooks (``HookEvent``) for a key taken over,
    settled (``status`` "succeeded", "failed" or "released"; ``error`` the
    handler's), or failing in the store (a lost key too).
    """
    if isinstance(pool, AsyncConnectionPool):
        return AsyncCompleter(pool, **options)
    if isinstance(pool, ConnectionPool):
        return Completer(pool, **options)
    raise TypeError(f"completer() needs a psycopg ConnectionPool or AsyncConnectionPool, "
                    f"not {type(pool).__name__}")
