"""What the contract table cannot show: stored rows, run counts over several
retries, the body limit's reads, late results after a handler timeout, and
the misconfigurations that answer 500 instead of 503."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
import threading
import uuid
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

import pg_idempotency
from conftest import Server, database_with_extension, stored, take_over, wait_for, with_pool_lifespan
from pg_idempotency import (IdempotencyAttempt, IdempotencyMiddleware, MisconfiguredError,
                            idempotent)
from pg_idempotency._core import ServerInfo, remember_server_info, server_info

Headers = List[Tuple[str, str]]


class App:
    """A raw ASGI app: answers ``answer(body)`` -> (status, headers, body),
    counts its runs, records what it read and the attempt it ran as, and can
    hold a run until the test releases it."""

    def __init__(self, answer: Callable[[bytes], Tuple[int, Headers, bytes]],
                 hold: bool = False) -> None:
        self.answer = answer
        self.hold = hold
        self.runs = 0
        self.bodies: List[bytes] = []
        self.attempts: List[Optional[IdempotencyAttempt]] = []
        self.entered = threading.Event()
        self.release = threading.Event()
        self.returned = threading.Event()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.runs += 1
        self.attempts.append(scope.get("state", {}).get("idempotency"))
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.bodies.append(body)
        self.entered.set()
        try:
            if self.hold:
                await asyncio.to_thread(self.release.wait)
            status, headers, out = self.answer(body)
            await send({"type": "http.response.start", "status": status,
                        "headers": [(k.encode(), v.encode()) for k, v in headers]})
            await send({"type": "http.response.body", "body": out})
        finally:
            self.returned.set()


def serve(inner: App, pool: Optional[AsyncConnectionPool] = None, open_pool: bool = True,
          **options: Any) -> Tuple[Server, IdempotencyMiddleware, AsyncConnectionPool]:
    pool = pool or AsyncConnectionPool("", min_size=1, max_size=4, open=False)
    middleware = IdempotencyMiddleware(inner, pool=pool, **options)
    return Server(with_pool_lifespan(middleware, pool, open_pool)), middleware, pool


def post(server: Server, key: Optional[str], body: bytes = b"{}", **headers: str
         ) -> httpx.Response:
    h = {"content-type": "application/json", **headers}
    if key is not None:
        h["idempotency-key"] = key
    with httpx.Client(base_url=server.url, timeout=60) as c:
        return c.post("/things", headers=h, content=body)


def problem(r: httpx.Response, status: int, slug: str) -> Dict[str, Any]:
    assert r.status_code == status, r.text
    body: Dict[str, Any] = r.json()
    assert body["type"].endswith(slug), body
    return body


# ---- framing ---------------------------------------------------------------------------


def test_framing_headers_are_dropped_sent_correct_and_never_stored(db: Any, key: str) -> None:
    app = App(lambda body: (201, [("content-type", "text/plain"), ("content-length", "999"),
                                  ("transfer-encoding", "chunked"), ("keep-alive", "x"),
                                  ("x-cost", "3")], b"hello"))
    server, _, _ = serve(app, store_headers=["x-cost", "Transfer-Encoding", "content-length"])
    with server:
        for replayed in (None, "true"):
            r = post(server, key)
            assert r.status_code == 201 and r.content == b"hello"
            assert r.headers["content-length"] == "5"
            assert "transfer-encoding" not in r.headers and "keep-alive" not in r.headers
            assert r.headers.get("idempotent-replayed") == replayed
            assert r.headers["x-cost"] == "3"
    row = stored(db, key)
    assert row is not None and row[3]["headers"] == {"content-type": "text/plain", "x-cost": "3"}
    assert app.runs == 1


# ---- the request body ------------------------------------------------------------------


def test_the_body_is_read_once_and_handed_on_whole(key: str) -> None:
    seen: List[bytes] = []
    app = App(lambda body: (200, [("content-type", "application/octet-stream")], body))

    def key_of(req: Any) -> str:
        seen.append(req.body)            # the key function sees the body too
        return key
    server, _, _ = serve(app, key=key_of)
    payload = bytes(range(256)) * 64
    with server:
        r = post(server, None, payload)
    assert r.content == payload and app.bodies == [payload] and seen == [payload]


async def test_the_body_limit_stops_reading_past_the_limit(apool: AsyncConnectionPool,
                                                           db: Any, key: str) -> None:
    """No Content-Length: the middleware reads chunks until one takes it past
    the limit, keeps at most the limit, and reads no further."""
    app = App(lambda body: (201, [], b""))
    middleware = IdempotencyMiddleware(app, pool=apool, max_body_size=2500)
    received = 0

    async def receive() -> Dict[str, Any]:
        nonlocal received
        received += 1
        return {"type": "http.request", "body": b"x" * 1000, "more_body": received < 1000}
    sent: List[Dict[str, Any]] = []

    async def send(message: Dict[str, Any]) -> None:
        sent.append(message)
    scope = {"type": "http", "method": "POST", "path": "/things", "raw_path": b"/things",
             "query_string": b"", "headers": [(b"idempotency-key", key.encode())]}
    await middleware(scope, receive, send)
    assert received == 3, "the third chunk passes 2500 bytes: nothing more is read"
    assert sent[0]["status"] == 413 and app.runs == 0
    assert json.loads(sent[1]["body"])["type"].endswith("idempotency-request-too-large")
    assert stored(db, key) is None


def test_a_declared_content_length_over_the_limit_is_refused_unread(db: Any, key: str) -> None:
    app = App(lambda body: (201, [], b""))
    server, _, _ = serve(app, max_body_size=10)
    with server:
        problem(post(server, key, b"x" * 11), 413, "idempotency-request-too-large")
        assert post(server, key, b"x" * 10).status_code == 201, "the key was not used"
    assert app.runs == 1 and stored(db, key)[:3] == ("succeeded", 1, 201)  # type: ignore



@pytest.mark.parametrize("options, limit", [
    ({}, 1024 * 1024),
    ({"max_body_size": None}, None),
    ({"max_body_size": 0}, None),
    ({"max_body_size": 100, "fingerprint": lambda req: {"path": req.path}}, 100),
], ids=["absent: 1 MiB", "None: no limit", "0: no limit", "with a fingerprint option"])
def test_the_body_limit_declared_and_chunked(db: Any, key: str, options: Dict[str, Any],
                                             limit: Optional[int]) -> None:
    app = App(lambda body: (201, [], b""))
    server, _, _ = serve(app, **options)
    size = (limit or 1024 * 1024) + 1

    def chunked() -> Iterator[bytes]:
        for start in range(0, size, 4096):
            yield b"x" * min(4096, size - start)
    with server:
        for i, content in enumerate([b"x" * size, chunked()]):
            r = post(server, f"{key}-{i}", content)  # type: ignore[arg-type]
            if limit is None:
                assert r.status_code == 201, r.text
                assert len(app.bodies[-1]) == size
            else:
                problem(r, 413, "idempotency-request-too-large")
                assert stored(db, f"{key}-{i}") is None
    assert app.runs == (2 if limit is None else 0)


@pytest.mark.parametrize("value, error", [(-1, ValueError), (1.5, TypeError),
                                          ("1024", TypeError), (True, TypeError)])
def test_a_bad_max_body_size_is_refused_at_construction(value: Any, error: Any) -> None:
    with pytest.raises(error, match="max_body_size"):
        IdempotencyMiddleware(App(lambda body: (201, [], b"")),
                              pool=None, max_body_size=value)  # type: ignore[arg-type]

def test_a_negative_wait_is_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="wait must be 0 or more seconds"):
        IdempotencyMiddleware(App(lambda body: (201, [], b"")),
                              pool=None, wait=-0.5)  # type: ignore[arg-type]


# ---- status policy -----------------------------------------------------------------------


def test_a_304_is_released_never_stored(db: Any, key: str) -> None:
    app = App(lambda body: (304, [("etag", '"v1"')], b""))
    server, _, _ = serve(app)
    with server:
        for _ in range(2):
            r = post(server, key)
            assert r.status_code == 304 and "idempotent-replayed" not in r.headers
            assert stored(db, key) is None
    assert app.runs == 2


def test_store_server_errors_stores_a_5xx_as_failed(db: Any, key: str) -> None:
    app = App(lambda body: (503, [("content-type", "text/plain")], b"down"))
    server, _, _ = serve(app, store_server_errors=True)
    with server:
        assert post(server, key).status_code == 503
        r = post(server, key)
    assert r.status_code == 503 and r.text == "down" and r.headers["idempotent-replayed"]
    assert stored(db, key)[:3] == ("failed", 1, 503) and app.runs == 1  # type: ignore


# ---- responses too large to store ---------------------------------------------------------


BIG = b"y" * (2 * 1024 * 1024)


def big_answer(body: bytes) -> Tuple[int, Headers, bytes]:
    return 201, [("content-type", "application/octet-stream"), ("location", "/things/9"),
                 ("content-language", "en")], BIG


def assert_stored_without_body(db: Any, key: str, app: App, server: Server) -> None:
    r = post(server, key)
    assert r.status_code == 201 and r.content == BIG, "the first client gets all of it"
    assert stored(db, key) == ("succeeded", 1, 201, {
        "v": 1, "headers": {"location": "/things/9"}, "omitted": "too-large"})
    for _ in range(3):
        r = post(server, key)
        assert r.status_code == 201 and r.content == b""
        assert r.headers["idempotent-replayed"] == "true"
        assert r.headers["idempotent-body-omitted"] == "too-large"
        assert r.headers["location"] == "/things/9" and r.headers["content-length"] == "0"
        assert "content-type" not in r.headers and "content-language" not in r.headers
    assert app.runs == 1, "a response too large to store never runs its handler again"


def test_a_response_too_large_to_store_runs_once(db: Any, key: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    app = App(big_answer)
    server, _, _ = serve(app)
    with caplog.at_level(logging.INFO, logger="pg_idempotency"), server:
        assert_stored_without_body(db, key, app, server)
    told = [r.getMessage() for r in caplog.records
            if "stored without their body" in r.getMessage()]
    assert len(told) == 1 and "responses over 1048576 bytes" in told[0], "logged once per pool"


def test_the_servers_54000_also_stores_without_the_body(db: Any, key: str) -> None:
    """The size known to the client is too generous (jsonb's size is not the
    text's): idem_finish answers 54000 and the outcome is stored without the body."""
    app = App(big_answer)
    pool = AsyncConnectionPool("", min_size=1, max_size=4, open=False)
    remember_server_info(pool, ServerInfo("idem", (1, 6), 1 << 30))
    server, _, _ = serve(app, pool=pool)
    with server:
        assert_stored_without_body(db, key, app, server)


# ---- the handler timeout -------------------------------------------------------------------


def test_a_late_handler_result_is_stored_after_the_504(db: Any, key: str) -> None:
    app = App(lambda body: (201, [("content-type", "application/json")], b'{"late": 1}'),
              hold=True)
    server, _, _ = serve(app, handler_timeout=1)
    with server:
        problem(post(server, key), 504, "idempotency-handler-timeout")
        problem(post(server, key), 409, "idempotency-key-in-use")
        app.release.set()
        assert app.returned.wait(30)
        wait_for(lambda: stored(db, key)[0] == "succeeded",  # type: ignore[index]
                 what="the late result to be stored")
        r = post(server, key)
        assert r.status_code == 201 and r.json() == {"late": 1}
        assert r.headers["idempotent-replayed"] == "true"
    assert app.runs == 1


def test_a_late_handler_that_lost_its_key_sends_and_stores_nothing(
        db: Any, key: str, caplog: pytest.LogCaptureFixture) -> None:
    app = App(lambda body: (201, [], b"late"), hold=True)
    server, _, _ = serve(app, handler_timeout=1)
    with caplog.at_level(logging.WARNING, logger="pg_idempotency"), server:
        problem(post(server, key), 504, "idempotency-handler-timeout")
        request = {"method": "POST", "path": "/things",
                   "body_sha256": hashlib.sha256(b"{}").hexdigest()}
        other = take_over(db, key, request)  # as a retry after the lease ran out would
        app.release.set()
        assert app.returned.wait(30)
        wait_for(lambda: any("lost the claim on idempotency key" in r.getMessage()
                             for r in caplog.records), what="the lost key to be logged")
    assert stored(db, key)[0] == "pending"  # type: ignore[index]
    assert db.execute("SELECT token FROM idempotency.keys WHERE key = %s",
                      (key,)).fetchone()[0] == other


def test_handler_timeout_zero_disables_it(key: str) -> None:
    app = App(lambda body: (201, [], b"ok"))
    _, middleware, _ = serve(app, handler_timeout=0)
    assert middleware.handler_timeout is None
    _, middleware, _ = serve(app)
    assert middleware.handler_timeout == 300


# ---- the attempt handed to the app ----------------------------------------------------------


def test_the_attempt_carries_the_token_as_a_decimal_string(db: Any, key: str) -> None:
    app = App(lambda body: (201, [], b""))
    server, _, _ = serve(app, scope=lambda req: "tenant-1")
    with server:
        post(server, key)
    attempt = app.attempts[0]
    token = db.execute("SELECT token FROM idempotency.keys WHERE key = %s AND scope = %s",
                       (key, "tenant-1")).fetchone()[0]
    assert attempt == IdempotencyAttempt(key=key, scope="tenant-1", token=str(token), attempt=1)


# ---- canonical JSON ------------------------------------------------------------------------


@pytest.mark.parametrize("first, again, same", [
    (b'{"a": 12345678901234567890123}', b'{"a":12345678901234567890124}', False),
    (b'{"a": 0.10000000000000000001}', b'{"a": 0.1}', False),
    (b'{"a": 1, "a": 2}', b'{"a": 2}', True),
    (b'{"b": [1, {"y": 2, "x": 1}], "a": null}', b'{"a":null,"b":[1,{"x":1,"y":2}]}', True),
])
def test_canonical_json_compares_jsonb_values_exactly(db: Any, key: str, first: bytes,
                                                     again: bytes, same: bool) -> None:
    app = App(lambda body: (201, [], b""))
    server, _, _ = serve(app, canonical_json=True)
    with server:
        assert post(server, key, first).status_code == 201
        r = post(server, key, again, **{"content-type": "application/merge-patch+json"})
    assert r.status_code == (201 if same else 422) and app.runs == 1


# ---- the key option ----------------------------------------------------------------------


@pytest.mark.parametrize("value, status, slug", [
    ("", 400, "idempotency-key-malformed"),
    ("a\nb", 400, "idempotency-key-malformed"),
    (256, 400, "idempotency-key-too-long"),
    (255, 201, None),
])
def test_a_key_from_the_key_option_is_checked(value: Any, status: int,
                                              slug: Optional[str]) -> None:
    app = App(lambda body: (201, [], b""))
    # a key of that many characters, unique to this run
    key = value if isinstance(value, str) else uuid.uuid4().hex.ljust(value, "k")

    async def key_of(req: Any) -> str:       # an async key function is awaited
        return key
    server, _, _ = serve(app, key=key_of)
    with server:
        r = post(server, None)
    if slug is not None:
        problem(r, status, slug)
    assert r.status_code == status and app.runs == (1 if slug is None else 0)


# ---- misconfiguration ----------------------------------------------------------------------


def test_a_pool_never_opened_is_a_500_logged_once(key: str,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    app = App(lambda body: (201, [], b""))
    server, _, _ = serve(app, open_pool=False)
    with caplog.at_level(logging.ERROR, logger="pg_idempotency"), server:
        for _ in range(3):
            r = post(server, key)
            detail = problem(r, 500, "idempotency-misconfigured")["detail"]
            assert "not open" in detail and "pool.open()" in detail
            assert "retry-after" not in r.headers
    assert len([r for r in caplog.records if "misconfigured" in r.getMessage()]) == 1
    assert app.runs == 0


@pytest.fixture
def role_without_usage(db: Any) -> Iterator[str]:
    role = "idem_py_nousage_" + uuid.uuid4().hex[:8]
    db.execute(f"CREATE ROLE {role} LOGIN")
    try:
        yield role
    finally:
        db.execute(f"DROP ROLE {role}")


def post_through(conninfo: str, key: str, **pool_options: Any) -> httpx.Response:
    """One covered request through a fresh pool on ``conninfo``; the app never runs."""
    app = App(lambda body: (201, [], b""))
    pool = AsyncConnectionPool(conninfo, min_size=1, max_size=2, open=False, **pool_options)
    server, _, _ = serve(app, pool=pool)
    with server:
        r = post(server, key)
    assert app.runs == 0
    return r


def test_permission_denied_is_a_500_naming_the_grant(role_without_usage: str, key: str) -> None:
    r = post_through(f"user={role_without_usage}", key)
    detail = problem(r, 500, "idempotency-misconfigured")["detail"]
    assert "Permission denied" in detail and "USAGE on schema idempotency" in detail


def test_a_missing_database_is_a_500_not_a_503(key: str) -> None:
    r = post_through("dbname=idem_py_no_such_db", key, timeout=1)
    detail = problem(r, 500, "idempotency-misconfigured")["detail"]
    assert 'database "idem_py_no_such_db" does not exist' in detail
    assert "retry-after" not in r.headers


def test_an_extension_older_than_needed_names_the_update() -> None:
    with pytest.raises(MisconfiguredError, match=r"^pg-idempotency "
                       + re.escape(pg_idempotency.__version__) + r" needs the "
                       r"idempotency extension 1\.0 or later; database \"shop\" has 0\.9: "
                       r"run ALTER EXTENSION idempotency UPDATE\.$"):
        server_info(("shop", "0.9", None, None))
    with pytest.raises(MisconfiguredError, match=r"not installed in database \"shop\": run "
                       r"CREATE EXTENSION idempotency\."):
        server_info(("shop", None, None, None))
    assert server_info(("shop", "1.6", "2097152", "B")).max_response_size == 2 * 1024 * 1024
    assert server_info(("shop", "1.6", "2MB", None)).max_response_size == 2 * 1024 * 1024
    assert server_info(("shop", "1.6", None, None)).max_response_size == 1024 * 1024


def test_an_unavailable_database_stays_a_503(key: str) -> None:
    """A connection refused is a passing unavailability, not a misconfiguration."""
    r = post_through("host=127.0.0.1 port=1", key, timeout=1)
    problem(r, 503, "idempotency-unavailable")
    assert r.headers["retry-after"] == "1"


# ---- the oldest extension version this package runs on -----------------------------------------


@pytest.fixture
def database_1_0(db: Any) -> Iterator[str]:
    with database_with_extension(db, "idem_py_v10_", "1.0") as name:
        yield name


def test_middleware_and_jobs_run_on_extension_1_0(database_1_0: str, key: str) -> None:
    app = App(lambda body: (201, [("content-type", "application/json")], b'{"id": 1}'))
    pool = AsyncConnectionPool(f"dbname={database_1_0}", min_size=1, max_size=2, open=False)
    server, _, _ = serve(app, pool=pool)
    with server:
        assert post(server, key).status_code == 201
        r = post(server, key)
    assert r.headers["idempotent-replayed"] == "true" and r.json() == {"id": 1}
    assert app.runs == 1
    with psycopg.connect(dbname=database_1_0, autocommit=True) as conn:
        assert conn.execute("SELECT extversion FROM pg_extension WHERE extname = "
                            "'idempotency'").fetchone() == ("1.0",)
        for _ in range(2):
            with idempotent(conn, key + "-job", request={"n": 1}) as job:
                if not job.replayed:
                    assert job.token is not None and job.token.isdigit()
                    job.set_result("done")
        assert job.replayed and job.value == "done"
