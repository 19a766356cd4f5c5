"""A pure ASGI middleware for the ``Idempotency-Key`` header (Starlette, FastAPI,
any ASGI framework), on an ``AsyncConnectionPool``.

::

    app.add_middleware(IdempotencyMiddleware, pool=pool,
                       scope=lambda req: req["user"].identity)

Per covered request (POST and PATCH by default): parse the header; claim
``(scope, key)`` with the request's fingerprint; ``replay``: send the stored
response with ``Idempotent-Replayed: true``; ``in_progress``: 409 with
``Retry-After``; ``mismatch``: 422; ``claimed``: run the app with a heartbeat,
buffer its response, store it (or release the key) per the status policy, and
only then send it, so the first client sees what every retry will see.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import math
from typing import (Any, Awaitable, Callable, Collection, Dict, Iterator, List, Literal,
                    Mapping, MutableMapping, Optional, Tuple, Union)

import psycopg
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from ._core import (EXTEND_SQL, HTTP_CLAIM_SQL, HTTP_FINISH_SQL, LOOKUP_SQL, RELEASE_SQL,
                    ClaimRow, Duration, acall_with_retry, afetch_one, envelope_body,
                    http_envelope, is_lost, is_transient, released_before, to_seconds,
                    to_timedelta)
from .cache import CachedResult, ResultCache
from .header import parse_idempotency_key

__all__ = ["IdempotencyMiddleware", "IdempotencyRequest", "default_store_policy",
           "StorePolicy", "StoreDecision"]

log = logging.getLogger("pg_idempotency")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

StoreDecision = Literal["succeeded", "failed", "release"]
StorePolicy = Callable[[int], StoreDecision]

_TRANSIENT_4XX = frozenset({408, 409, 425, 429})

_TITLES = {
    "idempotency-key-missing": "Idempotency-Key header missing",
    "idempotency-key-malformed": "Idempotency-Key header malformed",
    "idempotency-key-repeated": "Idempotency-Key header repeated",
    "idempotency-key-too-long": "Idempotency-Key too long",
    "idempotency-key-in-use": "Idempotency-Key in use",
    "idempotency-key-reused": "Idempotency-Key reused",
    "idempotency-key-lost": "Idempotency-Key lost",
    "idempotency-unavailable": "Idempotency store briefly unavailable",
}

# SQLSTATE of a server (or PgBouncer target) that only reads: the key cannot
# be claimed now, but may be after a failover.
_READ_ONLY = "25006"

# statuses whose responses carry no body, and so no content-length
_NO_BODY = frozenset({204, 304})


def default_store_policy(status: int) -> StoreDecision:
    """Stripe's documented behaviour: 2xx and 3xx are stored as succeeded; 4xx
    as failed (the request was judged), except the transient 408, 409, 425 and
    429, which release the key like every 5xx so that a retry runs again."""
    if status < 400:
        return "succeeded"
    if status < 500 and status not in _TRANSIENT_4XX:
        return "failed"
    return "release"


class IdempotencyRequest(Mapping[str, Any]):
    """The request as the ``scope`` and ``fingerprint`` callbacks see it.

    It reads as the ASGI connection scope (``req["user"]``, ``req["state"]``,
    ``req["path"]``) and also carries the raw ``body`` bytes, the ``method``, the
    original ``path`` with its query string, and ``headers``.
    """

    def __init__(self, scope: Scope, body: bytes) -> None:
        self.scope = scope
        self.body = body
        self.method: str = scope["method"]
        raw = scope.get("raw_path")
        path = raw.decode("latin-1") if raw else scope.get("root_path", "") + scope["path"]
        query = scope.get("query_string", b"")
        self.path: str = path + ("?" + query.decode("latin-1") if query else "")
        self.headers: List[Tuple[str, str]] = [
            (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in scope["headers"]]

    def header(self, name: str) -> Optional[str]:
        name = name.lower()
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def user(self) -> Any:
        return self.scope.get("user")

    def __getitem__(self, item: str) -> Any:
        return self.scope[item]

    def __iter__(self) -> Iterator[str]:
        return iter(self.scope)

    def __len__(self) -> int:
        return len(self.scope)


def default_fingerprint(req: IdempotencyRequest) -> Dict[str, str]:
    return {"method": req.method, "path": req.path,
            "body_sha256": hashlib.sha256(req.body).hexdigest()}


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


class _Response:
    """A response buffered from the app."""

    def __init__(self) -> None:
        self.status: Optional[int] = None
        self.headers: List[Tuple[bytes, bytes]] = []
        self.body = bytearray()
        self.complete = False

    async def send(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = int(message["status"])
            self.headers = [(bytes(k), bytes(v)) for k, v in message.get("headers", [])]
        elif kind == "http.response.body":
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                self.complete = True


class IdempotencyMiddleware:
    """Options:

    ``pool``: an ``AsyncConnectionPool`` (opened by the time requests arrive).
    ``methods``: covered methods (default POST, PATCH); others pass through.
    ``required``: a covered request without the header gets 400 (default True);
    with False it runs without idempotency.
    ``scope(req)``: the key's tenant/principal string (sync or async), from the
    authenticated principal; default ``''``. Never a client-supplied header.
    ``fingerprint(req)``: the request's JSON fingerprint (sync or async);
    default method + path with query + SHA-256 of the raw body bytes.
    ``lease`` (default 30 s): the claim's lease; a heartbeat renews it every
    lease/3 while the app runs. ``retention`` (default 24 h): how long results
    are kept, announced in ``Idempotency-Key-Retention``.
    ``store_headers``: response headers stored and replayed (default
    content-type, content-encoding, location). ``store_policy(status)``: 'succeeded', 'failed'
    or 'release' (default ``default_store_policy``).
    ``problem_type_base``: prefix of the problem ``type`` URIs.
    ``cache``: an int N or a ``ResultCache``: serve replays of finished keys
    from memory (off by default).
    """

    def __init__(self, app: ASGIApp, *, pool: AsyncConnectionPool,
                 methods: Collection[str] = ("POST", "PATCH"), required: bool = True,
                 scope: Optional[Callable[[IdempotencyRequest], Union[str, Awaitable[str]]]] = None,
                 fingerprint: Optional[Callable[[IdempotencyRequest], Any]] = None,
                 lease: Duration = 30, retention: Duration = 86400,
                 store_headers: Collection[str] = ("content-type", "content-encoding",
                                                   "location"),
                 store_policy: StorePolicy = default_store_policy,
                 problem_type_base: str = "urn:idempotency:problem:",
                 cache: Union[None, int, ResultCache] = None,
                 logger: Optional[logging.Logger] = None) -> None:
        self.app = app
        self.pool = pool
        self.methods = frozenset(m.upper() for m in methods)
        self.required = required
        self.scope_of = scope
        self.fingerprint = fingerprint or default_fingerprint
        self.lease = to_timedelta(lease)
        self.lease_seconds = to_seconds(lease)
        self.retention = to_timedelta(retention)
        # rounded half up, as JavaScript's Math.round, so both libraries announce the same
        self.retention_header = str(math.floor(to_seconds(retention) + 0.5))
        self.store_headers = frozenset(h.lower() for h in store_headers)
        self.store_policy = store_policy
        self.problem_type_base = problem_type_base
        self.cache = ResultCache(cache) if isinstance(cache, int) else cache
        self.log = logger or log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() not in self.methods:
            await self.app(scope, receive, send)
            return
        values = [v.decode("latin-1") for k, v in scope["headers"]
                  if k.lower() == b"idempotency-key"]
        if not values and not self.required:
            await self.app(scope, receive, self._with_retention(send))
            return
        parsed = parse_idempotency_key(values)
        if parsed.key is None:
            assert parsed.error is not None
            await self._problem(send, 400, parsed.error, parsed.detail)
            return
        key = parsed.key

        body = await _read_body(receive)
        if body is None:
            return                      # the client left before sending its body
        req = IdempotencyRequest(scope, body)
        idem_scope = "" if self.scope_of is None else str(await _maybe_await(self.scope_of(req)))
        fingerprint = await _maybe_await(self.fingerprint(req))
        fp_text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))

        if self.cache is not None:
            hit = self.cache.get(idem_scope, key, fp_text)
            if hit is not None:
                await self._replay(send, hit.response_code, hit.response_body, hit.body_text)
                return

        try:
            async with self.pool.connection() as conn:
                claim = await afetch_one(conn, HTTP_CLAIM_SQL, {
                    "key": key, "request": Jsonb(fingerprint), "scope": idem_scope,
                    "lease": self.lease, "retention": self.retention,
                    "wait": to_timedelta(0)})
        except psycopg.Error as e:
            if is_transient(e) or e.sqlstate == _READ_ONLY:
                self.log.warning("idempotency claim of key %r failed: %s", key, e)
                await self._unavailable(send)
                return
            raise
        assert claim is not None
        row = ClaimRow(*claim[:7])
        body_text: Optional[str] = claim[7]

        if row.outcome == "replay":
            if self.cache is not None:
                await self._fill_cache(row, body_text, key, idem_scope, fp_text)
            await self._replay(send, row.response_code, row.response_body, body_text)
        elif row.outcome == "in_progress":
            await self._problem(send, 409, "idempotency-key-in-use",
                                "A request with this Idempotency-Key is still being processed; "
                                "retry later.",
                                [(b"retry-after", str(row.retry_after or 1).encode())])
        elif row.outcome == "mismatch":
            await self._problem(send, 422, "idempotency-key-reused",
                                "This Idempotency-Key was used with a different request "
                                "(method, path or body).")
        else:
            assert row.token is not None
            # Shielded: a server that cancels the request when the client goes
            # away still lets the app finish and its result be stored.
            task = asyncio.ensure_future(self._run_claimed(
                scope, send, body, key, idem_scope, row.token, fp_text))
            await asyncio.shield(task)

    # ---- claimed -------------------------------------------------------------------

    async def _run_claimed(self, scope: Scope, send: Send, body: bytes, key: str,
                           idem_scope: str, token: int, fp_text: str) -> None:
        app_done = asyncio.Event()
        delivered = False

        async def app_receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            # The app never learns of a disconnect: it runs to the end.
            await app_done.wait()
            return {"type": "http.disconnect"}

        response = _Response()
        lost: List[str] = []
        stop = asyncio.Event()
        ids = {"key": key, "token": token, "scope": idem_scope}

        async def heartbeat() -> None:
            while True:
                try:
                    await asyncio.wait_for(stop.wait(), self.lease_seconds / 3)
                    return
                except asyncio.TimeoutError:
                    pass
                try:
                    await self._token_call(EXTEND_SQL, dict(ids, lease=self.lease))
                except psycopg.Error as e:
                    if is_lost(e):
                        lost.append(e.sqlstate or "")
                        return
                    self.log.warning("idempotency heartbeat for key %r failed: %s", key, e)
                except Exception:
                    self.log.exception("idempotency heartbeat for key %r failed", key)

        beat = asyncio.ensure_future(heartbeat())
        try:
            await self.app(scope, app_receive, response.send)
            if response.status is None or not response.complete:
                raise RuntimeError("the ASGI app returned without a complete response")
        except BaseException:
            app_done.set()
            stop.set()
            await beat
            if not lost:
                await self._release(ids)
            raise
        app_done.set()
        stop.set()
        await beat

        status = response.status
        if lost:
            await self._lost(send, key, idem_scope, lost[0])
            return
        decision = self.store_policy(status)
        if decision == "release":
            await self._release(ids)
        else:
            headers: Dict[str, str] = {}
            for k, v in response.headers:
                name = k.decode("latin-1").lower()
                if name in self.store_headers:
                    value = v.decode("latin-1")
                    headers[name] = f"{headers[name]}, {value}" if name in headers else value
            body_in = b"" if status in _NO_BODY else bytes(response.body)
            envelope, json_text = http_envelope(headers, body_in, headers.get("content-type")
                                                or _header(response.headers, b"content-type"))
            try:
                finished = await self._token_call(HTTP_FINISH_SQL, dict(
                    ids, code=status, body=envelope, status=decision,
                    retention=self.retention))
            except psycopg.Error as e:
                if is_lost(e):
                    await self._lost(send, key, idem_scope, e.sqlstate or "")
                    return
                self.log.warning("could not store the result of idempotency key %r: %s", key, e)
                await self._release(ids)
                await self._unavailable(send)
                return
            assert finished is not None
            expires_at, stored_text = finished
            if self.cache is not None:
                self.cache.put(idem_scope, key, CachedResult(
                    fp_text, decision, status, json.loads(envelope) if json_text is None
                    else {"v": 1, "headers": headers, "json": json.loads(stored_text)},
                    expires_at, stored_text))
            if json_text is not None:
                # what every replay of this key will send: PostgreSQL's text of the body
                out_headers = [h for h in response.headers if h[0].lower() != b"etag"]
                await self._send(send, status, out_headers + [self._retention_header()],
                                 stored_text.encode("utf-8"), content_length=True)
                return
        await self._send(send, status, response.headers + [self._retention_header()],
                         bytes(response.body), content_length=True)

    async def _token_call(self, sql: str, params: Mapping[str, Any]) -> Optional[Tuple[Any, ...]]:
        """A token statement on a pool connection, tried again after a transient failure."""
        async def once() -> Optional[Tuple[Any, ...]]:
            async with self.pool.connection() as conn:
                return await afetch_one(conn, sql, params)
        return await acall_with_retry(once)

    async def _release(self, ids: Dict[str, Any]) -> None:
        try:
            await self._token_call(RELEASE_SQL, ids)
        except psycopg.Error as e:
            if not is_lost(e) and not released_before(e):
                self.log.warning("could not release idempotency key %r: %s", ids["key"], e)

    async def _fill_cache(self, row: ClaimRow, body_text: Optional[str], key: str,
                          idem_scope: str, fp_text: str) -> None:
        """Cache a replay with its key's expiry, read after the claim. The key may
        have been swept, or swept and settled anew, in between: only a lookup
        that finds the replayed result itself gives the expiry to cache it with."""
        try:
            async with self.pool.connection() as conn:
                found = await afetch_one(conn, LOOKUP_SQL, {"key": key, "scope": idem_scope})
        except psycopg.Error as e:
            self.log.warning("idempotency lookup of key %r for the cache failed: %s", key, e)
            return
        if found is None:
            return
        status, response_code, response_body, expires_at = found
        if (expires_at is None or status != row.status or response_code != row.response_code
                or response_body != row.response_body):
            return
        self.cache.put(idem_scope, key, CachedResult(  # type: ignore[union-attr]
            fp_text, row.status or "succeeded", row.response_code, row.response_body,
            expires_at, body_text))

    async def _lost(self, send: Send, key: str, idem_scope: str, sqlstate: str) -> None:
        self.log.warning("lost the claim on idempotency key %r (scope %r, SQLSTATE %s): "
                         "the response was not stored", key, idem_scope, sqlstate)
        await self._problem(send, 409, "idempotency-key-lost",
                            "This request outlived its claim on the Idempotency-Key and another "
                            "attempt took it over; its result was not stored. Retry to get the "
                            "stored result.")

    # ---- responses -------------------------------------------------------------------

    def _retention_header(self) -> Tuple[bytes, bytes]:
        return (b"idempotency-key-retention", self.retention_header.encode())

    def _with_retention(self, send: Send) -> Send:
        async def wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = list(message.get("headers", [])) + [self._retention_header()]
            await send(message)
        return wrapped

    async def _unavailable(self, send: Send) -> None:
        await self._problem(send, 503, "idempotency-unavailable",
                            "The result could not be recorded. Retry this request with the "
                            "same Idempotency-Key.", [(b"retry-after", b"1")])

    async def _replay(self, send: Send, code: Optional[int], stored: Any,
                      body_text: Optional[str] = None) -> None:
        headers, body = envelope_body(stored, body_text)
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
        raw.append((b"idempotent-replayed", b"true"))
        raw.append(self._retention_header())
        await self._send(send, code or 200, raw, body, content_length=True)

    async def _problem(self, send: Send, status: int, slug: str, detail: str,
                       headers: Optional[List[Tuple[bytes, bytes]]] = None) -> None:
        body = json.dumps({"type": self.problem_type_base + slug, "title": _TITLES[slug],
                           "status": status, "detail": detail}).encode()
        raw = [(b"content-type", b"application/problem+json")] + (headers or [])
        raw.append(self._retention_header())
        await self._send(send, status, raw, body, content_length=True)

    async def _send(self, send: Send, status: int, headers: List[Tuple[bytes, bytes]],
                    body: bytes, content_length: bool = False) -> None:
        if content_length:
            headers = [h for h in headers if h[0].lower() != b"content-length"]
            if status not in _NO_BODY:
                headers.append((b"content-length", str(len(body)).encode()))
            else:
                body = b""
        try:
            await send({"type": "http.response.start", "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body, "more_body": False})
        except OSError as e:
            # the client is gone; what it would have got is stored for its retry
            self.log.info("could not send the response: %s", e)


def _header(headers: List[Tuple[bytes, bytes]], name: bytes) -> Optional[str]:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


async def _read_body(receive: Receive) -> Optional[bytes]:
    chunks = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunks += message.get("body", b"")
        if not message.get("more_body", False):
            return bytes(chunks)
