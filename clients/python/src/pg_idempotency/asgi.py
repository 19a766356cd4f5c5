"""A pure ASGI middleware for the ``Idempotency-Key`` header (Starlette, FastAPI,
any ASGI framework), on an ``AsyncConnectionPool``.

::

    app.add_middleware(IdempotencyMiddleware, pool=pool,
                       scope=lambda req: req["user"].identity)

Per covered request (POST and PATCH by default): parse the header (or call
the ``key`` option); read the body up to ``max_body_size``; claim ``(scope,
key)`` with the request's fingerprint; ``replay``: send the stored response
with ``Idempotent-Replayed: true``; ``in_progress``: 409 with a capped
``Retry-After``; ``mismatch``: 422; ``expired`` (the key's response is gone
but the server remembers it): 410; ``claimed``: run the app with a heartbeat
(up to ``handler_timeout``), buffer its response, store it (or release the
key) per the status policy, and only then send it with its own
Content-Length, so the first client sees what every retry will see. With
``keep_request`` the claim stores the request (method, path, body) with the
key, for a completer to finish it from if this process dies.

There is no transactional mode: the stored response is written after the app
returns, in its own statement. Writes that must commit with the stored result
belong in a job on a connection inside a transaction (``jobs.idempotent``).
"""

from __future__ import annotations

import asyncio
import base64
import contextvars
import hashlib
import inspect
import json
import logging
import math
import re
from dataclasses import dataclass
from typing import (Any, Awaitable, Callable, Collection, Dict, Iterator, List, Literal,
                    Mapping, MutableMapping, Optional, Set, Tuple, Union)

import psycopg
import psycopg_pool
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from ._core import (EXTEND_SQL, HTTP_FINISH_SQL, LOOKUP_SQL, MAX_KEY_LENGTH,
                    RELEASE_SQL, SERVER_INFO_SQL, UNAVAILABLE_SQLSTATES, ClaimRow, Duration,
                    KeyLostError, MisconfiguredError, ServerInfo, acall_with_retry, afetch_one, envelope_body,
                    http_claim_sql, http_envelope, is_envelope, is_json_media_type, is_lost,
                    json_body_text, keep_request_option, known_server_info, misconfiguration,
                    released_before, remember_option, remember_server_info, require_keep_request,
                    require_remember, server_info, to_seconds, to_timedelta, too_large_envelope)
from .cache import CachedResult, ResultCache
from .header import parse_idempotency_key
from .hooks import Hook, Hooks

__all__ = ["IdempotencyMiddleware", "IdempotencyRequest", "IdempotencyAttempt",
           "default_store_policy", "StorePolicy", "StoreDecision", "DEFAULT_STORE_HEADERS",
           "FRAMING_HEADERS"]

log = logging.getLogger("pg_idempotency")

# The request being answered, for the hooks of the paths that only get its key.
_REQUEST: "contextvars.ContextVar[Any]" = contextvars.ContextVar("pg_idempotency_request",
                                                                 default=None)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

StoreDecision = Literal["succeeded", "failed", "release"]
StorePolicy = Callable[[int], StoreDecision]

_TRANSIENT_4XX = frozenset({408, 409, 425, 429})

#: Response headers stored and replayed by default; ``store_headers`` adds to them.
DEFAULT_STORE_HEADERS = frozenset({"content-type", "content-encoding", "content-language",
                                   "location", "etag", "last-modified"})

#: Headers that describe one connection's framing, not the response: never
#: stored, and dropped from what the handler sets, since the middleware sends
#: the buffered body with its own Content-Length.
FRAMING_HEADERS = frozenset({"transfer-encoding", "content-length", "connection", "keep-alive",
                             "upgrade", "te", "trailer", "proxy-connection"})

#: Every problem this middleware answers: its slug, status and title, the
#: same in both libraries (clients/contract/http.json).
PROBLEMS: Dict[str, Dict[str, Any]] = {
    "idempotency-key-missing": {"status": 400, "title": "Idempotency-Key header missing"},
    "idempotency-key-malformed": {"status": 400, "title": "Idempotency-Key header malformed"},
    "idempotency-key-repeated": {"status": 400, "title": "Idempotency-Key header repeated"},
    "idempotency-key-too-long": {"status": 400, "title": "Idempotency-Key too long"},
    "idempotency-key-in-use": {"status": 409, "title": "A request with this Idempotency-Key "
                                                       "is in progress"},
    "idempotency-key-reused": {"status": 422, "title": "Idempotency-Key reused with a "
                                                       "different request"},
    "idempotency-key-lost": {"status": 409, "title": "Idempotency-Key lost to a newer attempt"},
    "idempotency-key-expired": {"status": 410, "title": "Idempotency-Key already used; its "
                                                        "stored response has expired"},
    "idempotency-request-too-large": {"status": 413, "title": "Request body too large"},
    "idempotency-misconfigured": {"status": 500, "title": "Idempotency middleware misconfigured"},
    "idempotency-unavailable": {"status": 503, "title": "Idempotency store briefly unavailable"},
    "idempotency-handler-timeout": {"status": 504, "title": "Request handler timed out"},
}

# statuses whose responses carry no body, and so no content-length
_NO_BODY = frozenset({204, 304})

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def default_store_policy(status: int) -> StoreDecision:
    """2xx and 3xx are stored as succeeded, except 304 (an answer about the
    client's cache, not an outcome: released); 4xx as failed (the request was
    judged), except the transient 408, 409, 425 and 429, which release the key
    like every 5xx so that a retry runs again (``store_server_errors`` stores
    5xx as failed)."""
    if status == 304:
        return "release"
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


def kept_request(req: IdempotencyRequest) -> str:
    """The request a claim with ``keep_request`` stores, which is also what
    its fingerprint hashes: the body itself, as its JSON text (compared as
    jsonb, as with ``canonical_json``) or as base64, so that a completer can
    run the request again from it. The Node library keeps the same."""
    head = '{"method":' + json.dumps(req.method) + ',"path":' + json.dumps(req.path)
    ctype = req.header("content-type")
    text = (json_body_text(req.body)
            if ctype is not None and is_json_media_type(ctype) else None)
    if text is not None:
        return head + ',"body":' + text + "}"
    return head + ',"body_base64":"' + base64.b64encode(req.body).decode("ascii") + '"}'


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


@dataclass(frozen=True)
class IdempotencyAttempt:
    """The claimed attempt a covered request runs as, in
    ``scope["state"]["idempotency"]`` (Starlette: ``request.state.idempotency``)."""

    key: str
    scope: str
    #: the fencing token, as a decimal string (a bigint does not fit every
    #: client's number type): pass it downstream as it is
    token: str
    #: 1 for the key's first attempt; more after a takeover
    attempt: int


_DISCONNECTED = object()
_TOO_LARGE = object()


class IdempotencyMiddleware:
    """Options (the README has the why of each):

    ``pool``: an ``AsyncConnectionPool`` (opened by the time requests arrive).
    ``methods``: covered methods (default POST, PATCH); others pass through.
    ``required``: a covered request without a key gets 400 (default True);
    with False it runs without idempotency.
    ``key(req)``: the key (sync or async), or None when the request has none;
    replaces the ``Idempotency-Key`` header.
    ``scope(req)``: the key's tenant/principal string (sync or async), from the
    authenticated principal; default ``''``. Never a client-supplied header.
    ``fingerprint(req)``: the request's JSON fingerprint (sync or async);
    default method + path with query + SHA-256 of the raw body bytes.
    ``canonical_json`` (default False): a JSON body is fingerprinted as its
    jsonb value instead of its bytes.
    ``lease`` (default 30 s): the claim's lease; a heartbeat renews it every
    lease/3 while the app runs. ``retention`` (default 24 h): how long results
    are kept, announced in ``Idempotency-Key-Retention``. ``remember``
    (default None: the server's ``idempotency.remember``, off unless set): how
    long the server remembers a key after its retention (its status and
    response code, not the body), so that a retry in that time gets 410
    ``idempotency-key-expired`` instead of running the app again; 0: off
    whatever the server's setting; needs extension 1.7 (500
    ``idempotency-misconfigured`` naming it otherwise).
    ``keep_request`` (default False): store the request with the key while
    it is pending, so that a completer (``kind="http"``) can finish it if
    this process dies. The stored request is what the fingerprint hashes:
    ``{method, path, body}`` with a JSON body compared as jsonb (as with
    ``canonical_json``), ``{method, path, body_base64}`` for any other body,
    or what ``fingerprint`` returns. A request over the server's
    ``idempotency.max_response_size`` gets 413; needs extension 1.8 (500
    ``idempotency-misconfigured`` naming it otherwise).
    ``store_headers``: response headers stored and replayed on top of
    ``DEFAULT_STORE_HEADERS``. ``store_policy(status)``: 'succeeded', 'failed'
    or 'release' (default ``default_store_policy``); ``store_server_errors``
    (default False) stores 5xx as failed under the default policy.
    ``retry_after_max`` (default 5 s): cap of ``Retry-After`` on a 409.
    ``on_claim``, ``on_replay``, ``on_conflict``, ``on_mismatch``, ``on_expired``,
    ``on_error``: hooks called with a ``HookEvent`` for each answer (see ``pg_idempotency.hooks``);
    one that raises is logged and changes no answer.
    ``wait`` (default 0): how long a duplicate that arrives while the original
    runs waits for the original's answer: it gets the stored response when
    the original finishes within the wait (or runs the app itself when the
    original releases the key or its lease ends), else the 409. It holds a
    pool connection while it waits.
    ``max_body_size`` (default 1 MiB): larger request bodies get 413; None or
    0: no limit.
    ``handler_timeout`` (default 300 s; 0 or None: none): the client gets 504.
    ``problem_type_base``: prefix of the problem ``type`` URIs.
    ``cache``: an int N or a ``ResultCache``: serve replays of finished keys
    from memory (off by default).
    """

    def __init__(self, app: ASGIApp, *, pool: AsyncConnectionPool,
                 methods: Collection[str] = ("POST", "PATCH"), required: bool = True,
                 key: Optional[Callable[[IdempotencyRequest],
                                        Union[Optional[str], Awaitable[Optional[str]]]]] = None,
                 scope: Optional[Callable[[IdempotencyRequest], Union[str, Awaitable[str]]]] = None,
                 fingerprint: Optional[Callable[[IdempotencyRequest], Any]] = None,
                 canonical_json: bool = False,
                 lease: Duration = 30, retention: Duration = 86400,
                 remember: Optional[Duration] = None,
                 keep_request: bool = False,
                 store_headers: Collection[str] = (),
                 store_policy: Optional[StorePolicy] = None,
                 store_server_errors: bool = False,
                 retry_after_max: float = 5,
                 wait: Duration = 0,
                 max_body_size: Optional[int] = 1024 * 1024,
                 handler_timeout: Optional[Duration] = 300,
                 problem_type_base: str = "urn:idempotency:problem:",
                 cache: Union[None, int, ResultCache] = None,
                 logger: Optional[logging.Logger] = None,
                 on_claim: Optional[Hook] = None, on_replay: Optional[Hook] = None,
                 on_conflict: Optional[Hook] = None, on_mismatch: Optional[Hook] = None,
                 on_expired: Optional[Hook] = None, on_error: Optional[Hook] = None) -> None:
        self.app = app
        self.pool = pool
        self.methods = frozenset(m.upper() for m in methods)
        self.required = required
        self.key_of = key
        self.scope_of = scope
        self.fingerprint = fingerprint
        self.canonical_json = canonical_json
        self.lease = to_timedelta(lease)
        self.lease_seconds = to_seconds(lease)
        self.retention = to_timedelta(retention)
        # rounded half up, as JavaScript's Math.round, so both libraries announce the same
        self.retention_header = str(math.floor(to_seconds(retention) + 0.5))
        self.remember = remember_option(remember)
        self.keep_request = keep_request_option(keep_request)
        self.store_headers = (DEFAULT_STORE_HEADERS
                              | frozenset(h.lower() for h in store_headers)) - FRAMING_HEADERS
        self.store_policy = store_policy
        self.store_server_errors = store_server_errors
        self.retry_after_max = retry_after_max
        if to_seconds(wait) < 0:
            raise ValueError(f"wait must be 0 or more seconds, got {wait!r}")
        self.wait = to_timedelta(wait)
        self.max_body_size = _body_limit(max_body_size)
        timeout = to_seconds(handler_timeout) if handler_timeout else 0.0
        self.handler_timeout = timeout if timeout > 0 else None
        self.problem_type_base = problem_type_base
        self.cache = ResultCache(cache) if isinstance(cache, int) else cache
        self.log = logger or log
        self.hooks = Hooks(self.log, on_claim=on_claim, on_replay=on_replay,
                           on_conflict=on_conflict, on_mismatch=on_mismatch,
                           on_expired=on_expired, on_error=on_error)
        # each cause of a misconfiguration is logged once, not once per request
        self._logged_causes: Set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"].upper() not in self.methods:
            await self.app(scope, receive, send)
            return
        key: Optional[str] = None
        if self.key_of is None:
            values = [v.decode("latin-1") for k, v in scope["headers"]
                      if k.lower() == b"idempotency-key"]
            if not values and not self.required:
                await self.app(scope, receive, self._with_retention(send))
                return
            parsed = parse_idempotency_key(values)
            if parsed.key is None:
                assert parsed.error is not None
                await self._problem(send, parsed.error, parsed.detail)
                return
            key = parsed.key

        body = await self._read_body(scope, receive)
        if body is _DISCONNECTED:
            return                      # the client left before sending its body
        if body is _TOO_LARGE:
            await self._problem(send, "idempotency-request-too-large",
                                f"The request body is larger than {self.max_body_size} bytes, "
                                "the most this endpoint accepts; the Idempotency-Key was not "
                                "used.")
            return
        assert isinstance(body, bytes)
        req = IdempotencyRequest(scope, body)
        if self.key_of is not None:
            key = await self._custom_key(req)
            if key is None:
                if not self.required:
                    await self.app(scope, _receive_body_once(body, receive),
                                   self._with_retention(send))
                    return
                await self._problem(send, "idempotency-key-missing",
                                    "This request carries no idempotency key.")
                return
            if not key or _CONTROL.search(key):
                await self._problem(send, "idempotency-key-malformed",
                                    "The idempotency key is empty or holds control characters.")
                return
            if len(key) > MAX_KEY_LENGTH:
                await self._problem(send, "idempotency-key-too-long",
                                    f"The idempotency key is longer than {MAX_KEY_LENGTH} "
                                    "characters.")
                return
        assert key is not None
        idem_scope = "" if self.scope_of is None else str(await _maybe_await(self.scope_of(req)))
        fp_text = await self._fingerprint_text(req)
        _REQUEST.set(req)

        if self.cache is not None:
            hit = self.cache.get(idem_scope, key, fp_text)
            if hit is not None:
                self.hooks.emit("replay", key, idem_scope, request=req,
                                status=hit.response_code, cached=True)
                await self._replay(send, hit.response_code, hit.response_body, hit.body_text)
                return

        try:
            info = await self._server_info()
            require_remember(info, self.remember)
            require_keep_request(info, self.keep_request)
            async with self.pool.connection() as conn:
                claim = await afetch_one(conn, http_claim_sql(self.remember is not None,
                                                              self.keep_request), {
                    "key": key, "request": fp_text, "scope": idem_scope,
                    "lease": self.lease, "retention": self.retention,
                    "wait": self.wait, "remember": self.remember})
        except MisconfiguredError as e:
            self.hooks.emit("error", key, idem_scope, request=req, error=e)
            await self._misconfigured(send, str(e))
            return
        except psycopg.Error as e:
            if self.keep_request and e.sqlstate == "54000":
                # a request the server will not keep with its key: the
                # client's to shorten, the key unused
                await self._problem(send, "idempotency-request-too-large",
                                    "The request is larger than the server keeps with an "
                                    "Idempotency-Key (idempotency.max_response_size); the "
                                    "Idempotency-Key was not used.")
                return
            self.hooks.emit("error", key, idem_scope, request=req, error=e)
            detail = misconfiguration(e, self._database())
            if detail is None and isinstance(e, psycopg_pool.PoolTimeout) \
                    and known_server_info(self.pool) is None:
                detail = await self._diagnose_login()
            if detail is not None:
                await self._misconfigured(send, detail)
                return
            self.log.warning("idempotency claim of key %r failed: %s", key, e)
            await self._unavailable(send)
            return
        assert claim is not None
        row = ClaimRow(*claim[:7])
        body_text: Optional[str] = claim[7]

        if row.outcome == "replay":
            self.hooks.emit("replay", key, idem_scope, request=req, status=row.response_code)
            if self.cache is not None:
                await self._fill_cache(row, body_text, key, idem_scope, fp_text)
            await self._replay(send, row.response_code, row.response_body, body_text)
        elif row.outcome == "in_progress":
            # whole seconds, never past the cap (a fractional cap rounds down)
            wait = min(max(1, math.ceil(row.retry_after or 1)),
                       max(1, math.floor(self.retry_after_max)))
            self.hooks.emit("conflict", key, idem_scope, request=req, retry_after=wait)
            await self._problem(send, "idempotency-key-in-use",
                                "A request with this Idempotency-Key is still being processed; "
                                "retry later.", [(b"retry-after", str(wait).encode())])
        elif row.outcome == "mismatch":
            self.hooks.emit("mismatch", key, idem_scope, request=req)
            await self._problem(send, "idempotency-key-reused",
                                "This Idempotency-Key was used with a different request "
                                "(method, path or body).")
        elif row.outcome == "expired":
            self.hooks.emit("expired", key, idem_scope, request=req, status=row.status,
                            response_code=row.response_code)
            await self._expired(send, row)
        else:
            if row.outcome != "claimed":
                raise RuntimeError(f"unexpected claim outcome {row.outcome!r}")
            assert row.token is not None
            attempt = IdempotencyAttempt(key=key, scope=idem_scope, token=str(row.token),
                                         attempt=int(row.attempt or 1))
            scope.setdefault("state", {})["idempotency"] = attempt
            self.hooks.emit("claim", key, idem_scope, request=req, token=attempt.token,
                            attempt=attempt.attempt)
            # Shielded: a server that cancels the request when the client goes
            # away still lets the app finish and its result be stored.
            task = asyncio.ensure_future(self._run_claimed(
                scope, send, body, key, idem_scope, row.token, fp_text))
            await asyncio.shield(task)

    # ---- before the claim ----------------------------------------------------------

    async def _read_body(self, scope: Scope, receive: Receive) -> Any:
        """The request body, ``_TOO_LARGE`` past ``max_body_size`` (read no
        further: at most the limit is kept), or ``_DISCONNECTED``."""
        limit = self.max_body_size
        if limit is not None:
            declared = _header([(bytes(k), bytes(v)) for k, v in scope["headers"]],
                               b"content-length")
            if declared is not None and declared.strip().isdigit() and int(declared) > limit:
                return _TOO_LARGE
        chunks = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return _DISCONNECTED
            chunk = message.get("body", b"")
            if limit is not None and len(chunks) + len(chunk) > limit:
                return _TOO_LARGE
            chunks += chunk
            if not message.get("more_body", False):
                return bytes(chunks)

    async def _custom_key(self, req: IdempotencyRequest) -> Optional[str]:
        value = await _maybe_await(self.key_of(req))  # type: ignore[misc]
        if value is None or isinstance(value, str):
            return value
        raise TypeError(f"the key option returned {type(value).__name__}, not str or None")

    async def _fingerprint_text(self, req: IdempotencyRequest) -> str:
        """The fingerprint as JSON text, which PostgreSQL parses into the jsonb
        it compares. With ``canonical_json``, a JSON body goes in as its own
        text (no float rounding or re-serialisation here), so jsonb's key
        order, whitespace and duplicate-key rules decide what is the same body."""
        if self.fingerprint is not None:
            value = await _maybe_await(self.fingerprint(req))
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.keep_request:
            return kept_request(req)
        if self.canonical_json:
            ctype = req.header("content-type")
            text = (json_body_text(req.body)
                    if ctype is not None and is_json_media_type(ctype) else None)
            if text is not None:
                return ('{"method":' + json.dumps(req.method) + ',"path":'
                        + json.dumps(req.path) + ',"body":' + text + "}")
        return json.dumps(default_fingerprint(req), sort_keys=True, separators=(",", ":"))

    async def _server_info(self) -> ServerInfo:
        """The extension's version (checked) and max_response_size, read once
        per pool."""
        info = known_server_info(self.pool)
        if info is not None:
            return info
        async with self.pool.connection() as conn:
            row = await afetch_one(conn, SERVER_INFO_SQL, {})
        assert row is not None
        info = server_info(row)
        if known_server_info(self.pool) is None:
            self.log.info("pg-idempotency: idempotency extension %s in database %r; responses "
                          "over %d bytes are stored without their body",
                          ".".join(map(str, info.extversion)), info.database,
                          info.max_response_size)
        remember_server_info(self.pool, info)
        return info

    def _database(self) -> Optional[str]:
        info = known_server_info(self.pool)
        if info is not None:
            return info.database
        try:
            return conninfo_to_dict(self.pool.conninfo).get("dbname")
        except psycopg.Error:
            return None

    async def _diagnose_login(self) -> Optional[str]:
        """The pool hides why its connections fail (it retries and times out):
        before the pool ever worked, one direct connection says whether the
        login itself is refused (a misconfiguration) or the server is away."""
        try:
            kwargs = dict(self.pool.kwargs or {})
            kwargs.setdefault("connect_timeout", 5)
            conn = await psycopg.AsyncConnection.connect(self.pool.conninfo, **kwargs)
        except psycopg.Error as e:
            return misconfiguration(e, self._database())
        await conn.close()
        return None

    # ---- claimed -------------------------------------------------------------------

    async def _run_claimed(self, scope: Scope, send: Send, body: bytes, key: str,
                           idem_scope: str, token: int, fp_text: str) -> None:
        app_done = asyncio.Event()

        async def after_body() -> Message:
            # The app never learns of a disconnect: it runs to the end.
            await app_done.wait()
            return {"type": "http.disconnect"}

        app_receive = _receive_body_once(body, after_body)

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
        run = asyncio.ensure_future(self.app(scope, app_receive, response.send))
        timed_out = False
        if self.handler_timeout is not None:
            await asyncio.wait({run}, timeout=self.handler_timeout)
            if not run.done():
                # The handler is not cancelled (it may be in the middle of a
                # side effect): it runs on, without a heartbeat, so that its
                # lease runs out and a retry may take the key over; the token
                # fences whatever it still does downstream.
                timed_out = True
                stop.set()
                await beat
                self.log.warning("the handler for idempotency key %r (scope %r) outlived "
                                 "handler_timeout (%s s): answered 504, its lease is no "
                                 "longer renewed", key, idem_scope, self.handler_timeout)
                await self._problem(send, "idempotency-handler-timeout",
                                    "The request handler did not answer in time. Its "
                                    "result is stored if it still finishes first; retry "
                                    "later with the same Idempotency-Key.")
        try:
            await run
            if response.status is None or not response.complete:
                raise RuntimeError("the ASGI app returned without a complete response")
        except BaseException:
            app_done.set()
            stop.set()
            await beat
            if not lost:
                await self._release(ids)
            if timed_out:
                # the client already has its 504: nothing else goes out
                self.log.exception("the handler for idempotency key %r failed after its "
                                   "timeout; the key was released", key)
                return
            raise
        app_done.set()
        stop.set()
        await beat
        await self._settle(None if timed_out else send, response, ids, lost, fp_text)

    async def _settle(self, send: Optional[Send], response: "_Response", ids: Dict[str, Any],
                      lost: List[str], fp_text: str) -> None:
        """Store (or release) the handler's response, then send it, unless
        ``send`` is None (the client already got its 504)."""
        key, idem_scope = ids["key"], ids["scope"]
        status = response.status
        assert status is not None
        out_headers = [(k, v) for k, v in response.headers
                       if k.decode("latin-1").lower() not in FRAMING_HEADERS]
        if lost:
            await self._lost(send, key, idem_scope, lost[0])
            return
        decision = self._decide(status)
        if decision == "release":
            await self._release(ids)
            if send is not None:
                await self._send(send, status, out_headers + [self._retention_header()],
                                 bytes(response.body), content_length=True)
            return
        headers: Dict[str, str] = {}
        for k, v in out_headers:
            name = k.decode("latin-1").lower()
            if name in self.store_headers:
                value = v.decode("latin-1")
                headers[name] = f"{headers[name]}, {value}" if name in headers else value
        body_in = b"" if status in _NO_BODY else bytes(response.body)
        envelope, json_text = http_envelope(headers, body_in, headers.get("content-type")
                                            or _header(response.headers, b"content-type"))
        info = await self._known_info()
        omitted = len(envelope.encode("utf-8")) > info.max_response_size
        if omitted:
            envelope, json_text = too_large_envelope(headers), None
        err: Optional[psycopg.Error] = None
        try:
            finished = await self._finish(ids, status, envelope, json_text, decision)
        except psycopg.Error as e:
            err = e
        if err is not None and (err.sqlstate or "").startswith("22") and json_text is not None:
            # JSON this process reads but jsonb refuses (a number past numeric's
            # range): stored as the handler's bytes, which the client gets too
            envelope, json_text = http_envelope(headers, body_in, None)
            omitted = len(envelope.encode("utf-8")) > info.max_response_size
            if omitted:
                envelope = too_large_envelope(headers)
            try:
                finished = await self._finish(ids, status, envelope, None, decision)
                err = None
            except psycopg.Error as e:
                err = e
        if err is not None:
            json_text = None
            finished = await self._finish_failed(send, ids, status, headers, decision, err,
                                                 omitted)
            if finished is None:
                return
            omitted, envelope = True, too_large_envelope(headers)
        assert finished is not None
        expires_at, stored_text = finished
        if json_text is not None and stored_text != json_text:
            headers.pop("etag", None)
        if omitted:
            self.log.warning("the response to idempotency key %r (scope %r) is larger than "
                             "%d bytes: stored without its body; retries get its status and "
                             "headers only", key, idem_scope, info.max_response_size)
        if self.cache is not None:
            self.cache.put(idem_scope, key, CachedResult(
                fp_text, decision, status, json.loads(envelope) if json_text is None
                else {"v": 1, "headers": headers, "json": json.loads(stored_text)},
                expires_at, stored_text))
        if send is None:
            return
        if json_text is not None:
            # what every replay of this key will send: PostgreSQL's text of the body
            if "etag" not in headers:
                out_headers = [h for h in out_headers if h[0].lower() != b"etag"]
            await self._send(send, status, out_headers + [self._retention_header()],
                             stored_text.encode("utf-8"), content_length=True)
            return
        await self._send(send, status, out_headers + [self._retention_header()],
                         bytes(response.body), content_length=True)

    async def _finish_failed(self, send: Optional[Send], ids: Dict[str, Any], status: int,
                             headers: Dict[str, str], decision: str, err: psycopg.Error,
                             omitted: bool) -> Optional[Tuple[Any, ...]]:
        """After a failed finish: the finish of the too-large envelope when the
        server found the result too large (None if that fails too), else None
        once the client has its answer. The handler ran, so the key is never
        released here: a released key would let a retry run it again as a
        first attempt. It stays pending until its lease runs out, then a retry
        takes it over."""
        key = ids["key"]
        if err.sqlstate == "54000" and not omitted:
            # jsonb's size is not the text's: the server has the last word
            try:
                return await self._finish(ids, status, too_large_envelope(headers), None,
                                          decision)
            except psycopg.Error as again:
                err = again
        if is_lost(err):
            await self._lost(send, key, ids["scope"], err.sqlstate or "")
            return None
        self.hooks.emit("error", key, ids["scope"], request=_REQUEST.get(), token=str(ids["token"]),
                        error=err)
        detail = misconfiguration(err, self._database(), "store of the result")
        if detail is None and _is_unavailable(err):
            self.log.warning("could not store the result of idempotency key %r (scope %r): "
                             "%s; the key is left to its lease (retries get 409 until it "
                             "runs out)", key, ids["scope"], err)
            if send is not None:
                await self._unavailable(send)
            return None
        if detail is None:
            detail = f"Storing the result of an idempotency key failed: {err!r}"
        self.log.warning("could not store the result of idempotency key %r (scope %r); the "
                         "key is left to its lease: %s", key, ids["scope"], detail)
        if send is not None:
            await self._misconfigured(send, detail)
        return None

    def _decide(self, status: int) -> StoreDecision:
        if self.store_policy is not None:
            return self.store_policy(status)
        if status >= 500 and self.store_server_errors:
            return "failed"
        return default_store_policy(status)

    async def _known_info(self) -> ServerInfo:
        info = known_server_info(self.pool)
        return info if info is not None else await self._server_info()

    async def _finish(self, ids: Dict[str, Any], status: int, envelope: str,
                      json_text: Optional[str], decision: str) -> Optional[Tuple[Any, ...]]:
        return await self._token_call(HTTP_FINISH_SQL[self.remember is not None], dict(
            ids, code=status, body=envelope, raw=json_text, status=decision,
            retention=self.retention, remember=self.remember))

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

    async def _lost(self, send: Optional[Send], key: str, idem_scope: str,
                    sqlstate: str) -> None:
        self.log.warning("lost the claim on idempotency key %r (scope %r, SQLSTATE %s): "
                         "the response was not stored", key, idem_scope, sqlstate)
        self.hooks.emit("error", key, idem_scope, request=_REQUEST.get(),
                        error=KeyLostError(key=key, scope=idem_scope, sqlstate=sqlstate or None))
        if send is None:
            return
        await self._problem(send, "idempotency-key-lost",
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
        await self._problem(send, "idempotency-unavailable",
                            "The result could not be recorded. Retry this request with the "
                            "same Idempotency-Key.", [(b"retry-after", b"1")])

    async def _misconfigured(self, send: Send, detail: str) -> None:
        if detail not in self._logged_causes:
            self._logged_causes.add(detail)
            self.log.error("pg-idempotency is misconfigured (answering 500 until it is "
                           "fixed): %s", detail)
        await self._problem(send, "idempotency-misconfigured", detail)

    async def _expired(self, send: Send, row: ClaimRow) -> None:
        """A remembered key: its request was processed, with the outcome and
        status in the members, and its response is gone. 410: repeating the
        request cannot bring the response back, and it is not run again."""
        code = row.response_code
        await self._problem(send, "idempotency-key-expired",
                            "A request with this Idempotency-Key was already processed (it "
                            f"{row.status}{'' if code is None else f', with status {code}'}); "
                            "its stored response has expired and the request is not run "
                            "again. Use a new key for a new operation.",
                            members={"key_status": row.status, "response_code": code})

    async def _replay(self, send: Send, code: Optional[int], stored: Any,
                      body_text: Optional[str] = None) -> None:
        headers, body = envelope_body(stored, body_text)
        raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()
               if k not in FRAMING_HEADERS]
        if is_envelope(stored) and stored.get("omitted") is not None:
            raw.append((b"idempotent-body-omitted", str(stored["omitted"]).encode("latin-1")))
        raw.append((b"idempotent-replayed", b"true"))
        raw.append(self._retention_header())
        await self._send(send, code or 200, raw, body, content_length=True)

    async def _problem(self, send: Send, slug: str, detail: str,
                       headers: Optional[List[Tuple[bytes, bytes]]] = None,
                       members: Optional[Dict[str, Any]] = None) -> None:
        """An RFC 9457 problem; ``members``: its extension members, after the
        standard ones."""
        status: int = PROBLEMS[slug]["status"]
        body = json.dumps({"type": self.problem_type_base + slug,
                           "title": PROBLEMS[slug]["title"],
                           "status": status, "detail": detail, **(members or {})}).encode()
        raw = [(b"content-type", b"application/problem+json")] + (headers or [])
        raw.append(self._retention_header())
        await self._send(send, status, raw, body, content_length=True)

    async def _send(self, send: Send, status: int, headers: List[Tuple[bytes, bytes]],
                    body: bytes, content_length: bool = False) -> None:
        if content_length:
            headers = [h for h in headers
                       if h[0].decode("latin-1").lower() not in FRAMING_HEADERS]
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


def _body_limit(value: Any) -> Optional[int]:
    """The ``max_body_size`` option as a limit in bytes, None for no limit
    (None or 0). A bad value fails at startup, not as 413s on every request."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError("max_body_size must be a whole number of bytes, 0 or None (no "
                        f"limit), not {type(value).__name__} {value!r}")
    if value < 0:
        raise ValueError("max_body_size must be a whole number of bytes, 0 or None (no "
                         f"limit), not {value}")
    return value or None


def _is_unavailable(err: psycopg.Error) -> bool:
    """A store briefly unavailable: a lost connection (no SQLSTATE) or one of
    the SQLSTATEs a retry may get past."""
    state = err.sqlstate
    if state is None:
        return isinstance(err, psycopg.OperationalError)
    return state.startswith("08") or state in UNAVAILABLE_SQLSTATES


def _header(headers: List[Tuple[bytes, bytes]], name: bytes) -> Optional[str]:
    for k, v in headers:
        if k.lower() == name:
            return v.decode("latin-1")
    return None


def _receive_body_once(body: bytes, then: Receive) -> Receive:
    """An ASGI receive that hands the app the body the middleware read, whole
    and once, then answers with ``then``."""
    delivered = False

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await then()
    return receive
