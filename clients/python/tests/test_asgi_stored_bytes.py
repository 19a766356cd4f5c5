"""What the middleware sends and stores byte for byte: PostgreSQL's text of a
JSON body, bodies jsonb cannot hold, stored headers, and the answers it gives
when the database is briefly unavailable."""

from __future__ import annotations

import base64
import contextlib
import gzip
from typing import Any, AsyncIterator, Callable, Dict, Iterator, Optional

import httpx
import psycopg
import pytest
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from conftest import Server, stored
from httpapp import calls, make_app
from pg_idempotency import ResultCache

Hook = Callable[[str], None]


class HookedPool:
    """An AsyncConnectionPool whose statements first pass through ``hook(sql)``:
    the test's way to act between two statements of the middleware, or to make
    one fail as a busy key or a lost connection would."""

    def __init__(self, **kwargs: Any) -> None:
        self.pool = AsyncConnectionPool("", min_size=1, max_size=4, open=False, kwargs=kwargs)
        self.hook: Optional[Hook] = None

    async def open(self) -> None:
        await self.pool.open()

    async def close(self) -> None:
        await self.pool.close()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        async with self.pool.connection() as conn:
            yield _HookedConn(conn, self)


class _HookedConn:
    def __init__(self, conn: Any, owner: HookedPool) -> None:
        self._conn = conn
        self._owner = owner

    def cursor(self, *a: Any, **kw: Any) -> Any:
        return _HookedCursor(self._conn.cursor(*a, **kw), self._owner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._conn, name)


class _HookedCursor:
    def __init__(self, cur: Any, owner: HookedPool) -> None:
        self._cur = cur
        self._owner = owner

    async def execute(self, sql: Any, *a: Any, **kw: Any) -> Any:
        if self._owner.hook is not None:
            self._owner.hook(str(sql))
        return await self._cur.execute(sql, *a, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cur, name)


@pytest.fixture(scope="module")
def plain() -> Iterator[Server]:
    app = make_app()
    with Server(app) as s:
        s.app = app  # type: ignore[attr-defined]
        yield s


def post(url: str, path: str, key: str, body: bytes = b"") -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as c:
        return c.post(path, headers={"Idempotency-Key": key,
                                     "content-type": "application/json"}, content=body)


def pg_text(db: Any, key: str) -> bytes:
    text = db.execute("SELECT (response_body -> 'json')::text FROM idempotency.keys "
                      "WHERE key = %s AND scope = ''", (key,)).fetchone()[0]
    assert text is not None
    return str(text).encode()


# ---- PostgreSQL's text of a JSON body ---------------------------------------------


BODY = b'{"zeta": 1, "a": 10.50, "n": 1e2}'


def test_json_body_is_postgresql_text_first_replay_and_cache(plain: Server, db: Any,
                                                             key: str) -> None:
    expect = b'{"a": 10.50, "n": 100, "zeta": 1}'
    r1 = post(plain.url, "/echo-json", key, BODY)
    assert pg_text(db, key) == expect
    r2 = post(plain.url, "/echo-json", key, BODY)
    assert r2.headers["idempotent-replayed"] == "true"
    assert (r1.content, r2.content) == (expect, expect)
    assert r1.headers["content-length"] == str(len(expect))

    cache = ResultCache(10)
    app = make_app(cache=cache)
    with Server(app) as s:
        # cached by the first answer
        k1 = key + "-first"
        assert post(s.url, "/echo-json", k1, BODY).content == expect
        hit = post(s.url, "/echo-json", k1, BODY)
        assert cache.hits == 1 and hit.content == expect == pg_text(db, k1)
        # cached by a replay from the database
        assert post(s.url, "/echo-json", key, BODY).content == expect
        hit = post(s.url, "/echo-json", key, BODY)
        assert cache.hits == 2 and hit.content == expect
        assert hit.headers["idempotent-replayed"] == "true"


def test_body_jsonb_holds_only_as_numeric_is_stored_as_json(plain: Server, db: Any,
                                                            key: str) -> None:
    body = b'{"x": 1e400}'
    r1 = post(plain.url, "/echo-json", key, body)
    assert r1.status_code == 200, r1.text
    envelope = stored(db, key)[3]  # type: ignore[index]
    assert "json" in envelope and "base64" not in envelope
    expect = b'{"x": 1' + b"0" * 400 + b"}"
    assert pg_text(db, key) == expect
    r2 = post(plain.url, "/echo-json", key, body)
    assert (r1.content, r2.content) == (expect, expect)


@pytest.mark.parametrize("body", [b'["\\ud800"]', b'{"s": "a\\u0000b"}',
                                  b'["\\uD83D\\uDE00"]'])
def test_body_jsonb_refuses_is_stored_as_base64(plain: Server, db: Any, key: str,
                                                body: bytes) -> None:
    r1 = post(plain.url, "/echo-json", key, body)
    assert r1.status_code == 200 and r1.content == body
    envelope = stored(db, key)[3]  # type: ignore[index]
    assert envelope["base64"] == base64.b64encode(body).decode()
    assert "json" not in envelope
    r2 = post(plain.url, "/echo-json", key, body)
    assert r2.headers["idempotent-replayed"] == "true" and r2.content == body


# ---- headers ------------------------------------------------------------------------


def test_content_encoding_is_stored_and_etag_dropped(plain: Server, db: Any, key: str) -> None:
    r1 = post(plain.url, "/gzip", key)
    assert r1.headers["content-encoding"] == "gzip" and r1.content == b'{"packed": true}'
    envelope = stored(db, key)[3]  # type: ignore[index]
    assert envelope["headers"]["content-encoding"] == "gzip"
    assert gzip.decompress(base64.b64decode(envelope["base64"])) == b'{"packed": true}'
    r2 = post(plain.url, "/gzip", key)
    assert r2.headers["content-encoding"] == "gzip" and r2.content == r1.content
    # a JSON body rewritten to PostgreSQL's text is not the one the ETag named
    k2 = key + "-etag"
    r3 = post(plain.url, "/echo-json", k2, b'{"a":1}')
    assert r3.content == b'{"a": 1}' and "etag" not in r3.headers


def test_no_content_length_on_204(plain: Server, key: str) -> None:
    for _ in range(2):
        r = post(plain.url, "/empty", key)
        assert r.status_code == 204 and "content-length" not in r.headers
    assert r.headers["idempotent-replayed"] == "true"


def test_fractional_retention_rounds_half_up(key: str) -> None:
    app = make_app(retention=1.5)
    with Server(app) as s:
        assert post(s.url, "/empty", key).headers["idempotency-key-retention"] == "2"


# ---- the replay cache and the key's expiry ------------------------------------------------


def settle(db: Any, key: str, envelope: Dict[str, Any], request_body: bytes = b"") -> None:
    import hashlib
    request = {"method": "POST", "path": "/echo-json",
               "body_sha256": hashlib.sha256(request_body).hexdigest()}
    token = db.execute("SELECT token FROM idempotency.idem_claim(key => %s, request => %s)",
                       (key, Jsonb(request))).fetchone()[0]
    db.execute("SELECT idempotency.idem_finish(%s, %s, 200, %s, retention => '1 hour')",
               (key, token, Jsonb(envelope)))


@pytest.mark.parametrize("between", ["swept", "settled anew"])
def test_replay_whose_key_changes_before_the_lookup_is_served_not_cached(
        db: Any, key: str, between: str) -> None:
    old = {"v": 1, "headers": {"content-type": "application/json"}, "json": {"old": 1}}
    settle(db, key, old)
    pool = HookedPool()
    cache = ResultCache(10)
    app = make_app(pool=pool, cache=cache)  # type: ignore[arg-type]

    def hook(sql: str) -> None:
        if "idem_lookup" in sql:
            db.execute("DELETE FROM idempotency.keys WHERE key = %s", (key,))
            if between == "settled anew":
                settle(db, key, {"v": 1, "headers": {}, "json": {"new": 1}})
    pool.hook = hook
    with Server(app) as s:
        r = post(s.url, "/echo-json", key)
        assert r.status_code == 200 and r.json() == {"old": 1}
        assert r.headers["idempotent-replayed"] == "true"
        assert len(cache) == 0


# ---- a briefly unavailable database ---------------------------------------------------


def assert_unavailable(r: httpx.Response) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == "1"
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "urn:idempotency:problem:idempotency-unavailable"


def failing(on: str, error: Callable[[], BaseException], times: int = 1000) -> Hook:
    left = [times]

    def hook(sql: str) -> None:
        if on in sql and left[0] > 0:
            left[0] -= 1
            raise error()
    return hook


@pytest.mark.parametrize("error", [
    lambda: psycopg.errors.LockNotAvailable("key busy"),
    lambda: psycopg.errors.SerializationFailure("serialization"),
    lambda: psycopg.OperationalError("server closed the connection unexpectedly"),
])
def test_transient_claim_error_is_503(db: Any, key: str, error: Any) -> None:
    pool = HookedPool()
    app = make_app(pool=pool)  # type: ignore[arg-type]
    pool.hook = failing("idem_claim", error)
    with Server(app) as s:
        assert_unavailable(post(s.url, "/echo-json", key, b"{}"))
        assert calls(app).get("echo-json", 0) == 0
        pool.hook = None
        assert post(s.url, "/echo-json", key, b"{}").status_code == 200
    assert stored(db, key)[0] == "succeeded"  # type: ignore[index]


def test_transient_finish_error_is_retried_then_503(db: Any, key: str) -> None:
    pool = HookedPool()
    app = make_app(pool=pool)  # type: ignore[arg-type]
    with Server(app) as s:
        pool.hook = failing("idem_finish", lambda: psycopg.errors.LockNotAvailable("busy"), 2)
        assert post(s.url, "/echo-json", key, b"[1]").status_code == 200
        assert stored(db, key)[0] == "succeeded"  # type: ignore[index]
        k2 = key + "-2"
        pool.hook = failing("idem_finish", lambda: psycopg.errors.LockNotAvailable("busy"))
        assert_unavailable(post(s.url, "/echo-json", k2, b"[1]"))
        # the handler ran: the key is not released, a retry waits for its lease
        assert stored(db, k2)[0] == "pending"  # type: ignore[index]
        assert calls(app)["echo-json"] == 2
