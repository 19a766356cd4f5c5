"""Idempotent jobs and queue consumers: ``idempotent()`` and ``idempotent_job()``.

::

    with idempotent(pool, msg.id, request=msg.payload, scope="ledger") as job:
        if not job.replayed:
            job.set_result(book(msg))
    ack(msg)

The claim runs on ``__enter__``. ``claimed``: the block runs while a heartbeat
extends the lease every lease/3; a clean exit stores the result; an exception
releases the key (the next delivery runs again) when ``retryable(exc)`` says so
(by default for every exception), else stores it as failed; either way it
propagates. ``replay`` of a success: the block runs with ``job.replayed`` true
and ``job.value`` the stored value. ``replay`` of a failure raises
``StoredFailureError``, ``in_progress`` ``InProgressError``, ``mismatch``
``MismatchError``, ``expired`` (a key whose result is gone but which the
server remembers: the work ran) ``ExpiredError``, all before the block runs.

Two modes, chosen by the connection handed in:

* a pool, or a connection outside a transaction: every call commits on its
  own (claim, work, finish), the shape for work outside the database;
* a connection inside a transaction (``with conn.transaction():``): claim, the
  block and the finish join that transaction and commit or roll back with it.
  The block runs in a savepoint so that an exception undoes the block's writes
  but still releases or stores the failure in the transaction. No heartbeat:
  an uncommitted claim is invisible to other sessions anyway.

Recovery points: ``job.checkpoint(phase, data)`` records a completed step; an
attempt that takes the key over finds it in ``job.phase`` and
``job.phase_data`` and resumes from there.  It commits on its own in the
first mode (or in the caller's transaction on ``conn``), and with the
transaction in the second.

``session_bound=True`` ties the claim to the server session that made it, so
that the key is free at once when that session ends (the process died)
instead of after the lease.  Through a pool, that session is a pool
connection held for the whole attempt.

``keep_request=True`` stores the request with the key while it is pending,
so that a completer (``completer.py``) can finish the job if this process
dies; the completer runs the taken-over key through the same attempt
classes (``_adopt``), so that a block's code sees the same job in both.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import logging
import threading
from types import TracebackType
from typing import (Any, Awaitable, Callable, NoReturn, Optional, Tuple, Type, TypeVar,
                    Union, cast, overload)

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from ._core import (CHECKPOINT_EXTENSION, CHECKPOINT_SQL, COMPLETER_EXTENSION, EXTEND_SQL,
                    FINISH_SQL, MIN_EXTENSION, RELEASE_SQL, REMEMBER_EXTENSION, SERVER_INFO_SQL,
                    ClaimRow,
                    Duration, ExpiredError, InProgressError, KeyLostError, MismatchError,
                    ServerInfo, StoredFailureError, acall_with_retry, afetch_one,
                    call_with_retry, claim_sql, envelope_error, envelope_value, error_envelope,
                    is_lost, keep_request_option, known_server_info, released_before,
                    remember_option,
                    remember_server_info, require_version, server_info, to_seconds,
                    to_timedelta, value_envelope)

__all__ = ["Job", "AsyncJob", "Idempotent", "AsyncIdempotent", "idempotent",
           "idempotent_job", "current_job", "Retryable"]

from .hooks import Hook, Hooks

log = logging.getLogger("pg_idempotency")

SyncDB = Union["psycopg.Connection[Any]", ConnectionPool]
AsyncDB = Union["psycopg.AsyncConnection[Any]", AsyncConnectionPool]

#: Which exceptions release the key (retry runs again) instead of storing a
#: failure: a predicate, or a tuple of exception classes.
Retryable = Union[Callable[[BaseException], bool], Tuple[Type[BaseException], ...]]

DEFAULT_LEASE: Duration = 30.0

_current: contextvars.ContextVar[Optional["_JobBase"]] = contextvars.ContextVar(
    "pg_idempotency_job", default=None)


def current_job() -> Optional["_JobBase"]:
    """The job whose block (or decorated function) is running in this context."""
    return _current.get()


def _retryable_predicate(retryable: Optional[Retryable]) -> Callable[[BaseException], bool]:
    if retryable is None:
        return lambda exc: True
    if isinstance(retryable, tuple):
        classes = retryable
        return lambda exc: isinstance(exc, classes)
    return retryable


def _claim_statement(owner: "Union[Idempotent, AsyncIdempotent]") -> Tuple[str, dict[str, Any]]:
    """The claim an ``idempotent()`` block makes: its SQL and parameters."""
    request = owner._request
    return (claim_sql(owner._session_bound, owner._remember is not None, owner._keep_request),
            {"key": owner.key, "request": None if request is None else Jsonb(request),
             "scope": owner.scope, "lease": to_timedelta(owner._lease),
             "retention": to_timedelta(owner._retention), "wait": to_timedelta(owner._wait),
             "remember": owner._remember})


def _finish_statement(owner: "Union[Idempotent, AsyncIdempotent]", token: Optional[int],
                      envelope: Any, status: str,
                      code: Optional[int] = None) -> Tuple[str, dict[str, Any]]:
    """The finish that stores ``envelope`` as the key's result (with the
    HTTP status ``code``, None for a job): its SQL and parameters."""
    return (FINISH_SQL[owner._remember is not None],
            {"key": owner.key, "token": token, "code": code, "body": Jsonb(envelope),
             "scope": owner.scope, "status": status,
             "retention": to_timedelta(owner._retention), "remember": owner._remember})


def _report_error(owner: "Union[Idempotent, AsyncIdempotent]", error: BaseException,
                  job: "Optional[_JobBase]" = None) -> None:
    """Tell on_error that the store failed (the claim, or the settling of
    ``job``'s attempt)."""
    fields = {} if job is None else {"token": str(job._token), "attempt": job.attempt}
    owner._hooks.emit("error", owner.key, owner.scope, request=owner._request, error=error,
                      **fields)


class _JobBase:
    """What the block sees: the claim's outcome and the result to store."""

    key: str
    scope: str
    #: True: the key was settled earlier; ``value`` is the stored value and the
    #: work must not run again.
    replayed: bool
    #: The stored value (replay) or the value set with ``set_result``.
    value: Any
    #: 1 for the key's first attempt; more means an earlier attempt may have run partly.
    attempt: Optional[int]
    #: The fencing token of this attempt, as a decimal string (pass it
    #: downstream as it is); None on replay.
    token: Optional[str]
    #: The step an earlier attempt completed (its last ``checkpoint``), when
    #: this attempt took the key over: resume after it. None on a first
    #: attempt, when no attempt recorded one, and on replay. Not changed by
    #: this attempt's own checkpoints.
    phase: Optional[str]
    #: What that checkpoint recorded to resume from (any JSON value), or None.
    phase_data: Any
    #: The job's payload: the ``request`` given to ``idempotent()`` (None
    #: without one), or the request a completer found stored with the key.
    request: Any

    def __init__(self, *, key: str, scope: str, replayed: bool, value: Any,
                 attempt: Optional[int], token: Optional[int],
                 phase: Optional[str] = None, phase_data: Any = None,
                 request: Any = None) -> None:
        self.key = key
        self.scope = scope
        self.request = request
        self.replayed = replayed
        self.value = value
        self.attempt = attempt
        # the token as the statements take it (a bigint) and as user code gets it
        self._token = token
        self.token = None if token is None else str(token)
        self.phase = phase
        self.phase_data = phase_data
        self._failure: Optional[BaseException] = None
        self._finished = False
        self._lost_state: Optional[str] = None      # SQLSTATE that told us

    def set_result(self, value: Any) -> None:
        """Store ``value`` (any JSON value) when the block exits cleanly."""
        self._check_owner("set_result")
        self.value = value
        self._failure = None

    def fail(self, error: BaseException) -> None:
        """Store ``error`` as this key's failure when the block exits cleanly,
        without raising it (every later attempt gets ``StoredFailureError``)."""
        self._check_owner("fail")
        self._failure = error

    @property
    def lost(self) -> bool:
        """True once the heartbeat (or a checkpoint) learned that another
        attempt owns the key: stop working, nothing will be stored."""
        return self._lost_state is not None

    def raise_if_lost(self) -> None:
        if self._lost_state is not None:
            raise KeyLostError(key=self.key, scope=self.scope, sqlstate=self._lost_state)

    def _checkpoint_params(self, phase: str, data: Any) -> dict[str, Any]:
        self._check_owner("checkpoint")
        if not isinstance(phase, str):
            raise TypeError(f"checkpoint() needs a phase name (str), not {type(phase).__name__}")
        return {"key": self.key, "token": self._token, "phase": phase,
                "data": None if data is None else Jsonb(data), "scope": self.scope}

    def _checkpoint_failed(self, err: psycopg.Error) -> NoReturn:
        """A checkpoint the server refused: a lost key raises KeyLostError (and
        the block's exit does not try to settle the key again)."""
        if is_lost(err):
            if not self._finished:
                self._lost_state = err.sqlstate or ""
            raise KeyLostError(key=self.key, scope=self.scope, sqlstate=err.sqlstate) from err
        raise err

    def _check_owner(self, what: str) -> None:
        if self.replayed:
            raise RuntimeError(f"{what}() on a replayed key: the result is already stored")
        if self._finished:
            raise RuntimeError(f"{what}() after finish(): the result is already stored")

    def __repr__(self) -> str:
        return (f"<{type(self).__name__} key={self.key!r} scope={self.scope!r} "
                f"replayed={self.replayed} attempt={self.attempt} token={self.token} "
                f"phase={self.phase!r}>")


class Job(_JobBase):
    """The sync block's view of its key."""

    def __init__(self, owner: "Idempotent", **kw: Any) -> None:
        super().__init__(**kw)
        self._owner = owner

    def finish(self, value: Any = None, *, conn: Optional["psycopg.Connection[Any]"] = None
               ) -> None:
        """Store ``value`` now rather than at the end of the block.

        Pass ``conn`` inside your own transaction to commit your writes and
        the stored result together: if the claim was lost this raises
        ``KeyLostError``, and your transaction rolls back with it.
        """
        self._check_owner("finish")
        self.value = value
        # a beat in flight would make the finish answer 55P03 (an extend and a
        # finish of one key at once): let it end first
        self._owner._stop_heartbeat(join=True)
        self._owner._store(value_envelope(value), "succeeded", conn=conn)
        self._finished = True

    def checkpoint(self, phase: str, data: Any = None, *,
                   conn: Optional["psycopg.Connection[Any]"] = None) -> None:
        """Record that this attempt completed the step ``phase`` (e.g.
        ``"charge_created"``), with ``data`` (any JSON value) for the attempt
        that takes the key over if this one dies: it gets them as ``phase`` and
        ``phase_data``. A later checkpoint replaces this one.

        Where it commits: on ``conn`` inside your transaction, together with
        the step's writes (or neither); in the transaction mode, with that
        transaction; otherwise at once, on its own. Raises ``KeyLostError`` if
        another attempt owns the key.
        """
        params = self._checkpoint_params(phase, data)
        owner = self._owner
        owner._runner.info(CHECKPOINT_EXTENSION, " (checkpoint())")
        with owner._beat_lock:
            try:
                owner._runner.token_call(CHECKPOINT_SQL, params, conn=conn)
            except psycopg.Error as e:
                self._checkpoint_failed(e)
            owner._note_open_checkpoint(conn)


class AsyncJob(_JobBase):
    """The async block's view of its key."""

    def __init__(self, owner: "AsyncIdempotent", **kw: Any) -> None:
        super().__init__(**kw)
        self._owner = owner

    async def finish(self, value: Any = None, *,
                     conn: Optional["psycopg.AsyncConnection[Any]"] = None) -> None:
        """Store ``value`` now; see ``Job.finish``."""
        self._check_owner("finish")
        self.value = value
        # a beat in flight would make the finish answer 55P03: let it end first
        await self._owner._stop_heartbeat()
        await self._owner._store(value_envelope(value), "succeeded", conn=conn)
        self._finished = True

    async def checkpoint(self, phase: str, data: Any = None, *,
                         conn: Optional["psycopg.AsyncConnection[Any]"] = None) -> None:
        """Record a completed step; see ``Job.checkpoint``."""
        params = self._checkpoint_params(phase, data)
        owner = self._owner
        await owner._runner.info(CHECKPOINT_EXTENSION, " (checkpoint())")
        async with owner._beat_lock:
            try:
                await owner._runner.token_call(CHECKPOINT_SQL, params, conn=conn)
            except psycopg.Error as e:
                self._checkpoint_failed(e)
            owner._note_open_checkpoint(conn)


def _still_open(conn: Union["psycopg.Connection[Any]", "psycopg.AsyncConnection[Any]", None]
                ) -> bool:
    """True while ``conn`` is in a transaction (or running a statement)."""
    return (conn is not None and not conn.closed
            and conn.info.transaction_status != TransactionStatus.IDLE)


def _needs(owner: "Union[Idempotent, AsyncIdempotent]") -> Tuple[Tuple[int, ...], str]:
    """The extension version a claim needs, and what needs it."""
    if owner._keep_request:
        return COMPLETER_EXTENSION, " (keep_request)"
    if owner._remember is not None:
        return REMEMBER_EXTENSION, " (remember)"
    if owner._session_bound:
        return CHECKPOINT_EXTENSION, " (session_bound=True)"
    return MIN_EXTENSION, ""


def _announce(hooks: Hooks, row: ClaimRow, key: str, scope: str, request: Any) -> None:
    """Tell the application's hooks the claim's outcome."""
    if row.outcome == "claimed":
        hooks.emit("claim", key, scope, request=request, token=str(row.token),
                   attempt=int(row.attempt or 1))
    elif row.outcome == "replay":
        hooks.emit("replay", key, scope, request=request, status=row.status)
    elif row.outcome == "in_progress":
        hooks.emit("conflict", key, scope, request=request, retry_after=int(row.retry_after or 1))
    elif row.outcome == "mismatch":
        hooks.emit("mismatch", key, scope, request=request)
    elif row.outcome == "expired":
        hooks.emit("expired", key, scope, request=request, status=row.status,
                   response_code=row.response_code)


def _claim_outcome(row: ClaimRow, key: str, scope: str) -> None:
    """Raise for the outcomes that never run the block."""
    if row.outcome == "in_progress":
        raise InProgressError(key=key, scope=scope, retry_after=int(row.retry_after or 1))
    if row.outcome == "mismatch":
        raise MismatchError(key=key, scope=scope)
    if row.outcome == "expired":
        raise ExpiredError(key=key, scope=scope, status=str(row.status),
                           response_code=row.response_code)
    if row.outcome == "replay" and row.status == "failed":
        name, message = envelope_error(row.response_body)
        raise StoredFailureError(key=key, scope=scope, name=name, message=message,
                                 body=row.response_body, response_code=row.response_code)
    if row.outcome not in ("claimed", "replay"):
        raise RuntimeError(f"unexpected claim outcome {row.outcome!r}")


# ---- sync -----------------------------------------------------------------------


class _SyncRunner:
    """Runs one statement on a pool or on the caller's connection."""

    def __init__(self, db: SyncDB) -> None:
        self.db = db
        self._beat_conn: Optional[psycopg.Connection[Any]] = None
        self._held: Optional[contextlib.ExitStack] = None

    def claim(self, sql: str, params: dict[str, Any], hold: bool) -> Tuple[Any, ...]:
        """The claim. ``hold`` (a session-bound claim through a pool): on a pool
        connection that is kept until ``release_held()``, so that the session
        the key is bound to lives exactly as long as the attempt; back in the
        pool, an idle connection may be closed (and the key freed) while the
        work still runs."""
        if not hold or not isinstance(self.db, ConnectionPool):
            return self.one(sql, params)
        stack = contextlib.ExitStack()
        with stack:
            c = stack.enter_context(self.db.connection())
            row = _exec_committed(c, sql, params)
            self._held = stack.pop_all()
        return row

    def info(self, need: Tuple[int, ...], what: str = "") -> ServerInfo:
        """The extension's version, read once per pool or connection and
        checked against ``need``: MisconfiguredError names the fix."""
        info = known_server_info(self.db)
        if info is None:
            info = server_info(self.one(SERVER_INFO_SQL, {}))
            remember_server_info(self.db, info)
        require_version(info, need, what)
        return info

    def release_held(self) -> None:
        """Give the claim's connection (if held) back to the pool."""
        held, self._held = self._held, None
        if held is not None:
            try:
                held.close()
            except psycopg.Error as e:     # a connection that died: the pool replaces it
                log.warning("could not return the session-bound claim's connection: %s", e)

    def in_transaction(self) -> bool:
        return (isinstance(self.db, psycopg.Connection)
                and self.db.info.transaction_status != TransactionStatus.IDLE)

    def one(self, sql: str, params: dict[str, Any],
            conn: Optional["psycopg.Connection[Any]"] = None) -> Tuple[Any, ...]:
        if conn is not None:
            return _exec(conn, sql, params)
        if isinstance(self.db, ConnectionPool):
            with self.db.connection() as c:
                return _exec(c, sql, params)
        return _exec_committed(self.db, sql, params)

    def token_call(self, sql: str, params: dict[str, Any],
                   conn: Optional["psycopg.Connection[Any]"] = None) -> Tuple[Any, ...]:
        """A token statement (finish, release), tried again after a transient
        failure unless it runs in the caller's transaction, which that failure
        aborted."""
        if conn is not None or self.in_transaction():
            return self.one(sql, params, conn=conn)
        return call_with_retry(lambda: self.one(sql, params))

    def beat(self, sql: str, params: dict[str, Any]) -> None:
        """The heartbeat's statement: on the pool, or on a connection of its own,
        so that it never lands in a transaction the block has open on the
        caller's connection."""
        if isinstance(self.db, ConnectionPool):
            call_with_retry(lambda: self.one(sql, params))
            return
        if self._beat_conn is None:
            info = self.db.info
            kwargs: dict[str, Any] = {"autocommit": True}
            if info.password:
                kwargs["password"] = info.password
            self._beat_conn = psycopg.Connection.connect(info.dsn, **kwargs)
        beat_conn = self._beat_conn
        call_with_retry(lambda: _exec(beat_conn, sql, params))

    def close(self) -> None:
        self.release_held()
        if self._beat_conn is not None:
            self._beat_conn.close()
            self._beat_conn = None


def _exec_committed(c: "psycopg.Connection[Any]", sql: str,
                    params: dict[str, Any]) -> Tuple[Any, ...]:
    """One statement on ``c``: in the caller's transaction if one is open,
    else committed on its own."""
    if c.autocommit or c.info.transaction_status != TransactionStatus.IDLE:
        return _exec(c, sql, params)
    with c.transaction():
        return _exec(c, sql, params)


def _exec(conn: "psycopg.Connection[Any]", sql: str, params: dict[str, Any]) -> Tuple[Any, ...]:
    cur = conn.cursor(row_factory=tuple_row)
    try:
        cur.execute(sql, params, prepare=False)
        row = cur.fetchone()
    finally:
        cur.close()
    assert row is not None
    return row


class _SyncHeartbeat:
    def __init__(self, beat: Callable[[], None], interval: float,
                 on_lost: Callable[[str], None]) -> None:
        self._beat = beat
        self._interval = interval
        self._on_lost = on_lost
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pg-idempotency-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self._beat()
            except psycopg.Error as e:
                if is_lost(e):
                    self._on_lost(e.sqlstate or "")
                    return
                # a transient failure (connection, 55P03): the next beat tries again
                log.warning("idempotency heartbeat failed: %s", e)
            except Exception:     # keep beating whatever the cause
                log.exception("idempotency heartbeat failed")

    def stop(self, join: bool = True) -> None:
        self._stop.set()
        if join and threading.current_thread() is not self._thread:
            self._thread.join()


class Idempotent:
    """Sync context manager returned by ``idempotent()`` for a psycopg
    ``Connection`` or ``ConnectionPool``."""

    def __init__(self, db: SyncDB, key: str, *, request: Any = None, scope: str = "",
                 lease: Duration = DEFAULT_LEASE, retention: Optional[Duration] = None,
                 wait: Duration = 0, retryable: Optional[Retryable] = None,
                 session_bound: bool = False, remember: Optional[Duration] = None,
                 keep_request: bool = False, hooks: Optional[Hooks] = None) -> None:
        self._runner = _SyncRunner(db)
        self.key = key
        self.scope = scope
        self._request = request
        self._lease = lease
        self._retention = retention
        self._wait = wait
        self._retryable = _retryable_predicate(retryable)
        self._session_bound = bool(session_bound)
        self._remember = remember_option(remember)
        self._keep_request = keep_request_option(keep_request)
        self._hooks = hooks if hooks is not None else Hooks(log)
        self._job: Optional[Job] = None
        self._heartbeat: Optional[_SyncHeartbeat] = None
        # A beat and a checkpoint never overlap, and no beat runs while a
        # checkpoint waits in the caller's open transaction (_open_checkpoint):
        # an extend would wait for that transaction, and finish(conn=...) in
        # it would wait for the extend, forever.
        self._beat_lock = threading.Lock()
        self._open_checkpoint: Optional[psycopg.Connection[Any]] = None
        self._savepoint: Optional[contextlib.ExitStack] = None
        self._ctx_token: Optional[contextvars.Token[Optional[_JobBase]]] = None

    def __enter__(self) -> Job:
        tx_mode = self._runner.in_transaction()
        try:
            self._runner.info(*_needs(self))
            row = ClaimRow(*self._runner.claim(*_claim_statement(self),
                                                   hold=self._session_bound))
        except Exception as e:
            _report_error(self, e)
            raise
        if row.outcome != "claimed":
            self._runner.release_held()
        _announce(self._hooks, row, self.key, self.scope, self._request)
        _claim_outcome(row, self.key, self.scope)
        return self._adopt(row, tx_mode)

    def _adopt(self, row: ClaimRow, tx_mode: bool = False) -> Job:
        """Make ``row`` (a claim's outcome, or a key a completer took over)
        this block's job: on ``claimed``, the savepoint or the heartbeat."""
        replayed = row.outcome == "replay"
        job = Job(self, key=self.key, scope=self.scope, replayed=replayed,
                  value=envelope_value(row.response_body) if replayed else None,
                  attempt=row.attempt, token=row.token, phase=row.phase,
                  phase_data=row.phase_data, request=self._request)
        self._job = job
        if not replayed:
            if tx_mode:
                assert isinstance(self._runner.db, psycopg.Connection)
                self._savepoint = contextlib.ExitStack()
                self._savepoint.enter_context(self._runner.db.transaction())
            else:
                self._heartbeat = _SyncHeartbeat(self._beat, to_seconds(self._lease) / 3,
                                                 self._mark_lost)
        self._ctx_token = _current.set(job)
        return job

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        job = self._job
        assert job is not None
        if self._ctx_token is not None:
            _current.reset(self._ctx_token)
        if job.replayed:
            return
        try:
            self._stop_heartbeat(join=True)
            if self._savepoint is not None:
                # an exception rolls the block's writes back to the savepoint
                self._savepoint.__exit__(exc_type, exc, tb)
            if exc is None:
                try:
                    self._settle_clean(job)
                except Exception as e:
                    _report_error(self, e, job)
                    raise
            else:
                self._settle_error(job, exc)
        finally:
            self._runner.close()

    def _settle_clean(self, job: Job) -> None:
        if job._finished:
            return
        if job._lost_state is not None:
            raise KeyLostError(key=self.key, scope=self.scope, sqlstate=job._lost_state)
        if job._failure is not None:
            self._store(error_envelope(job._failure), "failed")
        else:
            self._store(value_envelope(job.value), "succeeded")
        job._finished = True

    def _settle_error(self, job: Job, exc: BaseException) -> None:
        # An explicit finish may have rolled back with the caller's transaction:
        # settle anyway; if it did commit, the key answers "finished" (lost).
        if job._lost_state is not None:
            return
        retry = not isinstance(exc, Exception) or self._retryable(exc)
        try:
            if retry:
                self._runner.token_call(RELEASE_SQL, {"key": self.key, "token": job._token,
                                                      "scope": self.scope})
            else:
                self._store(error_envelope(exc), "failed")
        except KeyLostError:
            pass
        except psycopg.Error as e:
            if not is_lost(e) and not released_before(e):
                log.warning("could not %s key %r after %r: %s",
                            "release" if retry else "store the failure of", self.key, exc, e)

    def _store(self, envelope: Any, status: str,
               conn: Optional["psycopg.Connection[Any]"] = None) -> None:
        job = self._job
        assert job is not None
        try:
            self._runner.token_call(*_finish_statement(self, job._token, envelope, status),
                                    conn=conn)
        except psycopg.Error as e:
            if is_lost(e):
                raise KeyLostError(key=self.key, scope=self.scope, sqlstate=e.sqlstate) from e
            raise

    def _beat(self) -> None:
        job = self._job
        assert job is not None
        with self._beat_lock:
            # the uncommitted checkpoint keeps other claims off the key anyway
            if _still_open(self._open_checkpoint):
                return
            self._open_checkpoint = None
            self._runner.beat(EXTEND_SQL, {"key": self.key, "token": job._token,
                                           "lease": to_timedelta(self._lease),
                                           "scope": self.scope})

    def _note_open_checkpoint(self, conn: Optional["psycopg.Connection[Any]"]) -> None:
        """Remember the connection a checkpoint just ran on if it left it in a
        transaction (the caller's, still to commit)."""
        ran_on = conn if conn is not None else self._runner.db
        if isinstance(ran_on, psycopg.Connection) and _still_open(ran_on):
            self._open_checkpoint = ran_on

    def _mark_lost(self, sqlstate: str) -> None:
        job = self._job
        if job is not None and not job._finished:
            log.warning("lost the claim on key %r (scope %r): SQLSTATE %s",
                        self.key, self.scope, sqlstate)
            job._lost_state = sqlstate

    def _stop_heartbeat(self, join: bool) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(join=join)
            if join:
                self._heartbeat = None


# ---- async ----------------------------------------------------------------------


class _AsyncRunner:
    def __init__(self, db: AsyncDB) -> None:
        self.db = db
        self._beat_conn: Optional[psycopg.AsyncConnection[Any]] = None
        self._held: Optional[contextlib.AsyncExitStack] = None

    async def claim(self, sql: str, params: dict[str, Any], hold: bool) -> Tuple[Any, ...]:
        """See ``_SyncRunner.claim``."""
        if not hold or not isinstance(self.db, AsyncConnectionPool):
            return await self.one(sql, params)
        stack = contextlib.AsyncExitStack()
        async with stack:
            c = await stack.enter_async_context(self.db.connection())
            row = await _aexec_committed(c, sql, params)
            self._held = stack.pop_all()
        return row

    async def info(self, need: Tuple[int, ...], what: str = "") -> ServerInfo:
        """See ``_SyncRunner.info``."""
        info = known_server_info(self.db)
        if info is None:
            info = server_info(await self.one(SERVER_INFO_SQL, {}))
            remember_server_info(self.db, info)
        require_version(info, need, what)
        return info

    async def release_held(self) -> None:
        held, self._held = self._held, None
        if held is not None:
            try:
                await held.aclose()
            except psycopg.Error as e:
                log.warning("could not return the session-bound claim's connection: %s", e)

    def in_transaction(self) -> bool:
        return (isinstance(self.db, psycopg.AsyncConnection)
                and self.db.info.transaction_status != TransactionStatus.IDLE)

    async def one(self, sql: str, params: dict[str, Any],
                  conn: Optional["psycopg.AsyncConnection[Any]"] = None) -> Tuple[Any, ...]:
        if conn is not None:
            return await _aexec(conn, sql, params)
        if isinstance(self.db, AsyncConnectionPool):
            async with self.db.connection() as c:
                return await _aexec(c, sql, params)
        return await _aexec_committed(self.db, sql, params)

    async def token_call(self, sql: str, params: dict[str, Any],
                         conn: Optional["psycopg.AsyncConnection[Any]"] = None
                         ) -> Tuple[Any, ...]:
        """See ``_SyncRunner.token_call``."""
        if conn is not None or self.in_transaction():
            return await self.one(sql, params, conn=conn)
        return await acall_with_retry(lambda: self.one(sql, params))

    async def beat(self, sql: str, params: dict[str, Any]) -> None:
        if isinstance(self.db, AsyncConnectionPool):
            await acall_with_retry(lambda: self.one(sql, params))
            return
        if self._beat_conn is None:
            info = self.db.info
            kwargs: dict[str, Any] = {"autocommit": True}
            if info.password:
                kwargs["password"] = info.password
            self._beat_conn = await psycopg.AsyncConnection.connect(info.dsn, **kwargs)
        beat_conn = self._beat_conn
        await acall_with_retry(lambda: _aexec(beat_conn, sql, params))

    async def close(self) -> None:
        await self.release_held()
        if self._beat_conn is not None:
            await self._beat_conn.close()
            self._beat_conn = None


async def _aexec_committed(c: "psycopg.AsyncConnection[Any]", sql: str,
                           params: dict[str, Any]) -> Tuple[Any, ...]:
    """See ``_exec_committed``."""
    if c.autocommit or c.info.transaction_status != TransactionStatus.IDLE:
        return await _aexec(c, sql, params)
    async with c.transaction():
        return await _aexec(c, sql, params)


async def _aexec(conn: "psycopg.AsyncConnection[Any]", sql: str,
                 params: dict[str, Any]) -> Tuple[Any, ...]:
    row = await afetch_one(conn, sql, params)
    assert row is not None
    return row


class _AsyncHeartbeat:
    def __init__(self, beat: Callable[[], Awaitable[None]], interval: float,
                 on_lost: Callable[[str], None]) -> None:
        self._beat = beat
        self._interval = interval
        self._on_lost = on_lost
        self._stop = asyncio.Event()
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._stop.wait(), self._interval)
                return
            except asyncio.TimeoutError:
                pass
            try:
                await self._beat()
            except psycopg.Error as e:
                if is_lost(e):
                    self._on_lost(e.sqlstate or "")
                    return
                log.warning("idempotency heartbeat failed: %s", e)
            except Exception:
                log.exception("idempotency heartbeat failed")

    def stop(self) -> None:
        self._stop.set()

    async def wait(self) -> None:
        self._stop.set()
        await self._task


class AsyncIdempotent:
    """Async context manager returned by ``idempotent()`` for a psycopg
    ``AsyncConnection`` or ``AsyncConnectionPool``."""

    def __init__(self, db: AsyncDB, key: str, *, request: Any = None, scope: str = "",
                 lease: Duration = DEFAULT_LEASE, retention: Optional[Duration] = None,
                 wait: Duration = 0, retryable: Optional[Retryable] = None,
                 session_bound: bool = False, remember: Optional[Duration] = None,
                 keep_request: bool = False, hooks: Optional[Hooks] = None) -> None:
        self._runner = _AsyncRunner(db)
        self.key = key
        self.scope = scope
        self._request = request
        self._lease = lease
        self._retention = retention
        self._wait = wait
        self._retryable = _retryable_predicate(retryable)
        self._session_bound = bool(session_bound)
        self._remember = remember_option(remember)
        self._keep_request = keep_request_option(keep_request)
        self._hooks = hooks if hooks is not None else Hooks(log)
        self._job: Optional[AsyncJob] = None
        self._heartbeat: Optional[_AsyncHeartbeat] = None
        # see Idempotent._beat_lock (made in __aenter__, inside the event loop)
        self._beat_lock: asyncio.Lock = cast(asyncio.Lock, None)
        self._open_checkpoint: Optional[psycopg.AsyncConnection[Any]] = None
        self._savepoint: Optional[contextlib.AsyncExitStack] = None
        self._ctx_token: Optional[contextvars.Token[Optional[_JobBase]]] = None

    async def __aenter__(self) -> AsyncJob:
        self._beat_lock = asyncio.Lock()
        tx_mode = self._runner.in_transaction()
        try:
            await self._runner.info(*_needs(self))
            row = ClaimRow(*await self._runner.claim(*_claim_statement(self),
                                                   hold=self._session_bound))
        except Exception as e:
            _report_error(self, e)
            raise
        if row.outcome != "claimed":
            await self._runner.release_held()
        _announce(self._hooks, row, self.key, self.scope, self._request)
        _claim_outcome(row, self.key, self.scope)
        return await self._adopt(row, tx_mode)

    async def _adopt(self, row: ClaimRow, tx_mode: bool = False) -> AsyncJob:
        """See ``Idempotent._adopt``; called inside the event loop."""
        if self._beat_lock is None:
            self._beat_lock = asyncio.Lock()
        replayed = row.outcome == "replay"
        job = AsyncJob(self, key=self.key, scope=self.scope, replayed=replayed,
                       value=envelope_value(row.response_body) if replayed else None,
                       attempt=row.attempt, token=row.token, phase=row.phase,
                       phase_data=row.phase_data, request=self._request)
        self._job = job
        if not replayed:
            if tx_mode:
                assert isinstance(self._runner.db, psycopg.AsyncConnection)
                self._savepoint = contextlib.AsyncExitStack()
                await self._savepoint.enter_async_context(self._runner.db.transaction())
            else:
                self._heartbeat = _AsyncHeartbeat(self._beat, to_seconds(self._lease) / 3,
                                                  self._mark_lost)
        self._ctx_token = _current.set(job)
        return job

    async def __aexit__(self, exc_type: Optional[Type[BaseException]],
                        exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        job = self._job
        assert job is not None
        if self._ctx_token is not None:
            _current.reset(self._ctx_token)
        if job.replayed:
            return
        try:
            if self._heartbeat is not None:
                await self._heartbeat.wait()
                self._heartbeat = None
            if self._savepoint is not None:
                await self._savepoint.__aexit__(exc_type, exc, tb)
            if exc is None:
                try:
                    await self._settle_clean(job)
                except Exception as e:
                    _report_error(self, e, job)
                    raise
            else:
                await self._settle_error(job, exc)
        finally:
            await self._runner.close()

    async def _settle_clean(self, job: AsyncJob) -> None:
        if job._finished:
            return
        if job._lost_state is not None:
            raise KeyLostError(key=self.key, scope=self.scope, sqlstate=job._lost_state)
        if job._failure is not None:
            await self._store(error_envelope(job._failure), "failed")
        else:
            await self._store(value_envelope(job.value), "succeeded")
        job._finished = True

    async def _settle_error(self, job: AsyncJob, exc: BaseException) -> None:
        if job._lost_state is not None:
            return
        retry = not isinstance(exc, Exception) or self._retryable(exc)
        try:
            if retry:
                await self._runner.token_call(RELEASE_SQL, {"key": self.key, "token": job._token,
                                                            "scope": self.scope})
            else:
                await self._store(error_envelope(exc), "failed")
        except KeyLostError:
            pass
        except psycopg.Error as e:
            if not is_lost(e) and not released_before(e):
                log.warning("could not %s key %r after %r: %s",
                            "release" if retry else "store the failure of", self.key, exc, e)

    async def _store(self, envelope: Any, status: str,
                     conn: Optional["psycopg.AsyncConnection[Any]"] = None) -> None:
        job = self._job
        assert job is not None
        try:
            await self._runner.token_call(*_finish_statement(self, job._token, envelope, status),
                                          conn=conn)
        except psycopg.Error as e:
            if is_lost(e):
                raise KeyLostError(key=self.key, scope=self.scope, sqlstate=e.sqlstate) from e
            raise

    async def _beat(self) -> None:
        job = self._job
        assert job is not None
        async with self._beat_lock:
            if _still_open(self._open_checkpoint):
                return
            self._open_checkpoint = None
            await self._runner.beat(EXTEND_SQL, {"key": self.key, "token": job._token,
                                                 "lease": to_timedelta(self._lease),
                                                 "scope": self.scope})

    def _note_open_checkpoint(self, conn: Optional["psycopg.AsyncConnection[Any]"]) -> None:
        """See ``Idempotent._note_open_checkpoint``."""
        ran_on = conn if conn is not None else self._runner.db
        if isinstance(ran_on, psycopg.AsyncConnection) and _still_open(ran_on):
            self._open_checkpoint = ran_on

    def _mark_lost(self, sqlstate: str) -> None:
        job = self._job
        if job is not None and not job._finished:
            log.warning("lost the claim on key %r (scope %r): SQLSTATE %s",
                        self.key, self.scope, sqlstate)
            job._lost_state = sqlstate

    async def _stop_heartbeat(self) -> None:
        if self._heartbeat is not None:
            await self._heartbeat.wait()
            self._heartbeat = None


# ---- the two entry points ---------------------------------------------------------


@overload
def idempotent(db: SyncDB, key: str, *, request: Any = ..., scope: str = ...,
               lease: Duration = ..., retention: Optional[Duration] = ...,
               wait: Duration = ..., retryable: Optional[Retryable] = ...,
               session_bound: bool = ..., remember: Optional[Duration] = ...,
               keep_request: bool = ...,
               on_claim: Optional[Hook] = ..., on_replay: Optional[Hook] = ...,
               on_conflict: Optional[Hook] = ..., on_mismatch: Optional[Hook] = ...,
               on_expired: Optional[Hook] = ..., on_error: Optional[Hook] = ...) -> Idempotent: ...


@overload
def idempotent(db: AsyncDB, key: str, *, request: Any = ..., scope: str = ...,
               lease: Duration = ..., retention: Optional[Duration] = ...,
               wait: Duration = ..., retryable: Optional[Retryable] = ...,
               session_bound: bool = ..., remember: Optional[Duration] = ...,
               keep_request: bool = ...,
               on_claim: Optional[Hook] = ..., on_replay: Optional[Hook] = ...,
               on_conflict: Optional[Hook] = ..., on_mismatch: Optional[Hook] = ...,
               on_expired: Optional[Hook] = ..., on_error: Optional[Hook] = ...) -> AsyncIdempotent: ...


def idempotent(db: Union[SyncDB, AsyncDB], key: str, *, request: Any = None, scope: str = "",
               lease: Duration = DEFAULT_LEASE, retention: Optional[Duration] = None,
               wait: Duration = 0, retryable: Optional[Retryable] = None,
               session_bound: bool = False, remember: Optional[Duration] = None,
               keep_request: bool = False,
               on_claim: Optional[Hook] = None, on_replay: Optional[Hook] = None,
               on_conflict: Optional[Hook] = None, on_mismatch: Optional[Hook] = None,
               on_expired: Optional[Hook] = None,
               on_error: Optional[Hook] = None) -> Union[Idempotent, AsyncIdempotent]:
    """Run a block at most once per ``(scope, key)``: ``with`` for a sync
    connection or pool, ``async with`` for an async one.

    ``request``: any JSON value fingerprinted with the key (a different payload
    under the same key raises ``MismatchError``); None: no payload check.
    ``lease``: how long the claim is protected (the heartbeat renews it every
    lease/3). ``retention``: how long the result is kept (None: the server's
    ``idempotency.retention``). ``wait``: how long the claim may wait for an
    attempt in flight before ``InProgressError``. ``retryable``: which
    exceptions release the key instead of storing a failure (default: all).
    ``session_bound``: tie the claim to the server session that makes it (a
    pool connection held for the whole attempt, with a pool), so that the key
    is free at once if that session ends; meaningless behind a transaction
    pooler such as PgBouncer in transaction mode. ``remember``: how long the
    server remembers the key after its retention (its status, not its value),
    so that a block entered in that time raises ``ExpiredError`` instead of
    running again; None: the server's ``idempotency.remember`` (default off);
    0: off whatever the server's setting; needs extension 1.7
    (``MisconfiguredError`` before the claim otherwise). ``keep_request``:
    store the request with the key while it is pending, so that a completer
    can finish the job from its last checkpoint if this process dies (over
    the server's ``idempotency.max_response_size`` the claim raises SQLSTATE
    54000); needs extension 1.8 (``MisconfiguredError`` before the claim
    otherwise). ``on_claim``,
    ``on_replay``, ``on_conflict``, ``on_mismatch``, ``on_expired``,
    ``on_error``: hooks called with a ``HookEvent`` for each outcome
    (``on_error``: the store's failures and a lost key, not the block's own
    exceptions); one that raises is logged and changes nothing.
    """
    hooks = Hooks(log, on_claim=on_claim, on_replay=on_replay, on_conflict=on_conflict,
                  on_mismatch=on_mismatch, on_expired=on_expired, on_error=on_error)
    kw: dict[str, Any] = dict(request=request, scope=scope, lease=lease, retention=retention,
                              wait=wait, retryable=retryable, session_bound=session_bound,
                              remember=remember, keep_request=keep_request, hooks=hooks)
    if isinstance(db, (psycopg.AsyncConnection, AsyncConnectionPool)):
        return AsyncIdempotent(db, key, **kw)
    if isinstance(db, (psycopg.Connection, ConnectionPool)):
        return Idempotent(db, key, **kw)
    raise TypeError(f"idempotent() needs a psycopg connection or pool, not {type(db).__name__}")


F = TypeVar("F", bound=Callable[..., Any])


def idempotent_job(db: Union[SyncDB, AsyncDB], *, key: Callable[..., str],
                   request: Optional[Callable[..., Any]] = None,
                   scope: Union[None, str, Callable[..., str]] = None,
                   lease: Duration = DEFAULT_LEASE, retention: Optional[Duration] = None,
                   wait: Duration = 0, retryable: Optional[Retryable] = None,
                   session_bound: bool = False, remember: Optional[Duration] = None,
                   keep_request: bool = False,
                   on_claim: Optional[Hook] = None, on_replay: Optional[Hook] = None,
                   on_conflict: Optional[Hook] = None, on_mismatch: Optional[Hook] = None,
                   on_expired: Optional[Hook] = None,
                   on_error: Optional[Hook] = None) -> Callable[[F], F]:
    """Decorator form: ``key``, ``request`` and ``scope`` are computed from the
    call's arguments. The function runs at most once per key; a replay returns
    the stored value without calling it. Works on plain and ``async`` functions
    (an async function needs an async connection or pool). Inside, the running
    attempt is ``current_job()`` (its ``attempt``, fencing ``token``, ``phase``,
    ``phase_data`` and ``checkpoint()``).

    ``scope`` defaults to the function's qualified name
    (``f"{fn.__module__}.{fn.__qualname__}"``), so that two jobs fed the same
    ids never share a key; ``scope=""`` is the one scope of versions before 0.3.
    ``remember``, ``keep_request`` and the hooks are ``idempotent()``'s. A
    completer runs the undecorated function (``fn.__wrapped__``) with the
    stored request, so a job whose request is its one argument is finished
    by ``handler=lambda job: fn.__wrapped__(job.request)``."""
    hooks = Hooks(log, on_claim=on_claim, on_replay=on_replay, on_conflict=on_conflict,
                  on_mismatch=on_mismatch, on_expired=on_expired, on_error=on_error)
    remember_option(remember)      # a bad value fails at decoration, not at the first call
    keep_request_option(keep_request)

    def decorate(fn: F) -> F:
        default_scope = f"{fn.__module__}.{fn.__qualname__}"

        def options(args: Tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
            return dict(request=None if request is None else request(*args, **kwargs),
                        scope=(default_scope if scope is None
                               else scope(*args, **kwargs) if callable(scope) else scope),
                        lease=lease, retention=retention, wait=wait, retryable=retryable,
                        session_bound=session_bound, remember=remember,
                        keep_request=keep_request, hooks=hooks)

        if inspect.iscoroutinefunction(fn):
            if not isinstance(db, (psycopg.AsyncConnection, AsyncConnectionPool)):
                raise TypeError("an async function needs an AsyncConnection or AsyncConnectionPool")
            adb = db

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                async with AsyncIdempotent(adb, key(*args, **kwargs),
                                           **options(args, kwargs)) as job:
                    if job.replayed:
                        return job.value
                    job.set_result(await fn(*args, **kwargs))
                    return job.value
            return cast(F, run_async)

        if not isinstance(db, (psycopg.Connection, ConnectionPool)):
            raise TypeError("a plain function needs a Connection or ConnectionPool")
        sdb = db

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with Idempotent(sdb, key(*args, **kwargs), **options(args, kwargs)) as job:
                if job.replayed:
                    return job.value
                job.set_result(fn(*args, **kwargs))
                return job.value
        return cast(F, run)

    return decorate
