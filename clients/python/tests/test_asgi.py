"""The ASGI middleware over real HTTP: uvicorn on a free port, httpx clients."""

from __future__ import annotations

import base64
import hashlib
import json
import socket
import threading
import uuid
from typing import Any, Dict, Iterator, List

import httpx
import pytest
from psycopg.types.json import Jsonb

from conftest import Server, stored, take_over, wait_for, wait_past_lease
from httpapp import BINARY, Probe, calls, gate, make_app
from pg_idempotency import IdempotencyRequest, ResultCache

RETENTION = "86400"


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    app = make_app()
    with Server(app) as s:
        s.app = app  # type: ignore[attr-defined]
        yield s


@pytest.fixture
def client(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


def post(client: httpx.Client, path: str, key: Any = None, **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", [])
    if key is not None:
        headers = [("Idempotency-Key", key)] + list(headers)
    return client.post(path, headers=headers, **kw)


def assert_problem(r: httpx.Response, status: int, slug: str) -> Dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["idempotency-key-retention"] == RETENTION
    body: Dict[str, Any] = r.json()
    assert body["type"] == "urn:idempotency:problem:" + slug
    assert body["status"] == status
    assert body["title"] and body["detail"]
    return body


# ---- claimed, then replay --------------------------------------------------------


def test_json_response_is_stored_then_replayed(server: Server, client: httpx.Client, db: Any,
                                               key: str) -> None:
    before = calls(server.app).get("orders", 0)  # type: ignore[attr-defined]
    r1 = post(client, "/orders?src=web", f'"{key}"', json={"item": "book"})
    assert r1.status_code == 201
    assert "idempotent-replayed" not in r1.headers
    assert r1.headers["idempotency-key-retention"] == RETENTION
    assert r1.headers["x-not-stored"] == "1"
    n = r1.json()["order"]
    assert r1.json() == {"order": n, "item": "book", "note": "caf\u00e9"}
    assert stored(db, key) == ("succeeded", 1, 201, {
        "v": 1, "headers": {"content-type": "application/json", "location": f"/orders/{n}"},
        "json": {"order": n, "item": "book", "note": "caf\u00e9"}})

    r2 = post(client, "/orders?src=web", key, json={"item": "book"})   # bare token, same key
    assert r2.status_code == 201
    assert r2.headers["idempotent-replayed"] == "true"
    assert r2.headers["idempotency-key-retention"] == RETENTION
    assert r2.headers["location"] == f"/orders/{n}"
    assert r2.headers["content-type"] == "application/json"
    assert "x-not-stored" not in r2.headers, "only store_headers are stored"
    assert r2.json() == r1.json()
    assert calls(server.app)["orders"] == before + 1  # type: ignore[attr-defined]
    assert stored(db, key)[:2] == ("succeeded", 1)  # type: ignore[index]


def test_binary_body_replays_byte_for_byte(server: Server, client: httpx.Client, db: Any,
                                           key: str) -> None:
    payload = bytes(range(255, -1, -1))
    r1 = post(client, "/binary", key, content=payload,
              headers=[("content-type", "application/octet-stream")])
    assert r1.status_code == 200 and r1.content == BINARY + payload
    status, attempt, code, body = stored(db, key)  # type: ignore[misc]
    assert (status, attempt, code) == ("succeeded", 1, 200)
    assert body == {"v": 1, "headers": {"content-type": "application/octet-stream"},
                    "base64": base64.b64encode(BINARY + payload).decode()}
    r2 = post(client, "/binary", key, content=payload,
              headers=[("content-type", "application/octet-stream")])
    assert r2.headers["idempotent-replayed"] == "true"
    assert r2.content == r1.content
    assert r2.headers["content-type"] == "application/octet-stream"
    assert r2.headers["content-length"] == str(len(BINARY + payload))


@pytest.mark.parametrize("path, content_type, body, expect", [
    ("/text", "text/plain; charset=utf-8", b"plain words", "base64"),
    ("/json-bad", "application/json", b"{not json", "base64"),
])
def test_non_json_bodies_are_stored_as_base64(client: httpx.Client, db: Any, key: str, path: str,
                                              content_type: str, body: bytes,
                                              expect: str) -> None:
    r1 = post(client, path, key)
    assert r1.content == body
    envelope = stored(db, key)[3]  # type: ignore[index]
    assert envelope == {"v": 1, "headers": {"content-type": content_type},
                        "base64": base64.b64encode(body).decode()}
    r2 = post(client, path, key)
    assert (r2.status_code, r2.content, r2.headers["content-type"]) == (
        r1.status_code, body, content_type)
    assert r2.headers["idempotent-replayed"] == "true"


def test_empty_body(client: httpx.Client, db: Any, key: str) -> None:
    r1 = post(client, "/empty", key)
    assert r1.status_code == 204 and r1.content == b""
    assert stored(db, key) == ("succeeded", 1, 204, {"v": 1, "headers": {}})
    r2 = post(client, "/empty", key)
    assert r2.status_code == 204 and r2.content == b""
    assert r2.headers["idempotent-replayed"] == "true"


# ---- 409, 422 --------------------------------------------------------------------


def test_concurrent_duplicate_gets_409_with_retry_after(server: Server, client: httpx.Client,
                                                        db: Any, key: str) -> None:
    g = gate(server.app, key)  # type: ignore[attr-defined]
    first: List[httpx.Response] = []
    t = threading.Thread(target=lambda: first.append(post(client, f"/slow/{key}", key)))
    t.start()
    try:
        assert g.entered.wait(30)
        r = post(client, f"/slow/{key}", key)
        assert_problem(r, 409, "idempotency-key-in-use")
        assert 1 <= int(r.headers["retry-after"]) <= 30
        assert stored(db, key)[:2] == ("pending", 1)  # type: ignore[index]
    finally:
        g.release.set()
        t.join(30)
    assert first[0].status_code == 201 and "idempotent-replayed" not in first[0].headers
    r = post(client, f"/slow/{key}", key)
    assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
    assert calls(server.app)[f"slow/{key}"] == 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("change", ["body", "whitespace", "path", "query", "method"])
def test_changed_request_gets_422(client: httpx.Client, db: Any, key: str, change: str) -> None:
    r = post(client, "/orders?a=1", key, content=b'{"item":"book"}',
             headers=[("content-type", "application/json")])
    assert r.status_code == 201
    if change == "method":
        r2 = client.patch("/orders?a=1", headers={"Idempotency-Key": key},
                          content=b'{"item":"book"}')
    else:
        path, body = {
            "body": ("/orders?a=1", b'{"item":"pen"}'),
            "whitespace": ("/orders?a=1", b'{"item": "book"}'),
            "path": ("/charges?a=1", b'{"item":"book"}'),
            "query": ("/orders?a=2", b'{"item":"book"}'),
        }[change]
        r2 = post(client, path, key, content=body, headers=[("content-type", "application/json")])
    assert_problem(r2, 422, "idempotency-key-reused")
    assert stored(db, key)[:3] == ("succeeded", 1, 201)  # type: ignore[index]


# ---- the header --------------------------------------------------------------------


def test_missing_header(client: httpx.Client, db: Any) -> None:
    assert_problem(post(client, "/orders", json={}), 400, "idempotency-key-missing")


@pytest.mark.parametrize("headers, slug", [
    ([("Idempotency-Key", '"a"'), ("Idempotency-Key", '"b"')], "idempotency-key-repeated"),
    ([("Idempotency-Key", '"a", "b"')], "idempotency-key-repeated"),
    ([("Idempotency-Key", '"abc')], "idempotency-key-malformed"),
    ([("Idempotency-Key", '"abc";x=1')], "idempotency-key-malformed"),
    ([("Idempotency-Key", "")], "idempotency-key-malformed"),
    ([("Idempotency-Key", '""')], "idempotency-key-malformed"),
    ([("Idempotency-Key", "{1234}")], "idempotency-key-malformed"),
    ([("Idempotency-Key", b'"caf\xc3\xa9"')], "idempotency-key-malformed"),
    ([("Idempotency-Key", '"' + "k" * 256 + '"')], "idempotency-key-too-long"),
])
def test_bad_headers_get_400(server: Server, client: httpx.Client, db: Any, headers: Any,
                             slug: str) -> None:
    before = dict(calls(server.app))  # type: ignore[attr-defined]
    r = client.post("/orders", headers=headers, json={"item": "x"})
    assert_problem(r, 400, slug)
    assert calls(server.app) == before, "the handler did not run"  # type: ignore[attr-defined]
    for k in ("a", "abc", "{1234}", "1234", "k" * 255):
        assert stored(db, k) is None


def test_255_characters_is_fine(client: httpx.Client, db: Any) -> None:
    key = "k" + uuid.uuid4().hex + "x" * (255 - 33)
    assert len(key) == 255
    assert post(client, "/orders", f'"{key}"', json={}).status_code == 201
    assert stored(db, key)[:2] == ("succeeded", 1)  # type: ignore[index]


def test_uncovered_methods_pass_through(server: Server, client: httpx.Client, key: str,
                                        db: Any) -> None:
    r = client.get("/things/1", headers={"Idempotency-Key": "'nonsense"})
    assert r.status_code == 200 and r.json() == {"thing": 1}
    assert "idempotency-key-retention" not in r.headers
    # PATCH is covered by default
    r = client.patch("/things/2", headers={"Idempotency-Key": key})
    assert r.status_code == 200 and r.headers["idempotency-key-retention"] == RETENTION
    assert stored(db, key)[:3] == ("succeeded", 1, 200)  # type: ignore[index]
    assert client.patch("/things/2").status_code == 400


def test_options_methods_required_retention(db: Any, key: str) -> None:
    app = make_app(methods=["POST"], required=False, retention=3600)
    with Server(app) as s, httpx.Client(base_url=s.url) as c:
        r = c.post("/orders", json={"item": "a"})                # no key: just runs
        assert r.status_code == 201 and r.headers["idempotency-key-retention"] == "3600"
        r = c.patch("/things/1", headers={"Idempotency-Key": key})
        assert "idempotency-key-retention" not in r.headers      # PATCH not covered here
        assert stored(db, key) is None
        r = c.post("/orders", headers={"Idempotency-Key": key}, json={"item": "a"})
        assert r.headers["idempotency-key-retention"] == "3600"
    assert db.execute("SELECT retention FROM idempotency.keys WHERE key = %s",
                      (key,)).fetchone()[0].total_seconds() == 3600


# ---- status policy ---------------------------------------------------------------


@pytest.mark.parametrize("code", [400, 404, 422])
def test_4xx_is_stored_as_failed_and_replayed(server: Server, client: httpx.Client, db: Any,
                                              key: str, code: int) -> None:
    before = calls(server.app).get(f"status/{code}", 0)  # type: ignore[attr-defined]
    assert post(client, f"/status/{code}", key).status_code == code
    assert stored(db, key) == ("failed", 1, code, {
        "v": 1, "headers": {"content-type": "application/json"}, "json": {"status": code}})
    r = post(client, f"/status/{code}", key)
    assert r.status_code == code and r.headers["idempotent-replayed"] == "true"
    assert r.json() == {"status": code}
    assert calls(server.app)[f"status/{code}"] == before + 1  # type: ignore[attr-defined]


@pytest.mark.parametrize("code", [408, 409, 425, 429, 500, 503])
def test_transient_statuses_release_the_key(server: Server, client: httpx.Client, db: Any,
                                            key: str, code: int) -> None:
    before = calls(server.app).get(f"status/{code}", 0)  # type: ignore[attr-defined]
    for _ in range(2):
        r = post(client, f"/status/{code}", key)
        assert r.status_code == code and "idempotent-replayed" not in r.headers
        assert r.headers["idempotency-key-retention"] == RETENTION
        assert stored(db, key) is None
    assert calls(server.app)[f"status/{code}"] == before + 2  # type: ignore[attr-defined]


def test_exception_releases_and_gives_the_frameworks_500(server: Server, client: httpx.Client,
                                                         db: Any, key: str) -> None:
    # uvicorn closes the connection after an app exception: one request per connection
    close = [("connection", "close")]
    r = post(client, "/boom", key, headers=close)
    assert r.status_code == 500
    assert stored(db, key) is None
    assert post(client, "/boom", key, headers=close).status_code == 500
    assert stored(db, key) is None
    assert calls(server.app)["boom"] >= 2  # type: ignore[attr-defined]


def test_custom_store_policy_and_headers(db: Any, key: str) -> None:
    app = make_app(store_policy=lambda status: "succeeded" if status < 500 else "failed",
                   store_headers=["Location", "X-Not-Stored"])
    with Server(app) as s, httpx.Client(base_url=s.url) as c:
        assert c.post("/status/503", headers={"Idempotency-Key": key}).status_code == 503
        assert stored(db, key)[:3] == ("failed", 1, 503)  # type: ignore[index]
        key2 = key + "-2"
        r = c.post("/orders", headers={"Idempotency-Key": key2}, json={})
        # store_headers adds to the default list (content-type, location, ...)
        assert stored(db, key2)[3]["headers"] == {  # type: ignore[index]
            "content-type": "application/json", "location": r.headers["location"],
            "x-not-stored": "1"}
        r2 = c.post("/orders", headers={"Idempotency-Key": key2}, json={})
        assert r2.headers["x-not-stored"] == "1" and r2.json() == r.json()


# ---- scope and fingerprint ---------------------------------------------------------


def test_scope_comes_from_the_authenticated_principal(db: Any, key: str) -> None:
    from starlette.authentication import (AuthCredentials, AuthenticationBackend,
                                          SimpleUser)
    from starlette.middleware.authentication import AuthenticationMiddleware

    class Bearer(AuthenticationBackend):
        async def authenticate(self, conn: Any) -> Any:
            auth = conn.headers.get("authorization", "")
            if auth.startswith("Bearer "):
                return AuthCredentials(["authenticated"]), SimpleUser(auth[7:])
            return None

    inner = make_app(scope=lambda req: req["user"].username)
    # added last: outermost, so the principal is known when the middleware runs
    inner.add_middleware(AuthenticationMiddleware, backend=Bearer())
    with Server(inner) as s, httpx.Client(base_url=s.url) as c:
        ra = c.post("/orders", headers={"Idempotency-Key": key, "Authorization": "Bearer alice",
                                        "X-Tenant": "bob"}, json={"item": 1})
        rb = c.post("/orders", headers={"Idempotency-Key": key, "Authorization": "Bearer bob"},
                    json={"item": 2})
        assert ra.status_code == rb.status_code == 201
        assert ra.json()["order"] != rb.json()["order"], "two tenants, two runs"
        assert "idempotent-replayed" not in rb.headers
    assert stored(db, key, "alice")[3]["json"]["item"] == 1  # type: ignore[index]
    assert stored(db, key, "bob")[3]["json"]["item"] == 2  # type: ignore[index]
    assert stored(db, key, "") is None


def test_default_fingerprint_and_custom_fingerprint(db: Any, key: str) -> None:
    seen: List[IdempotencyRequest] = []

    async def fingerprint(req: IdempotencyRequest) -> Any:
        seen.append(req)
        return {"amount": req.json()["amount"]}

    app = make_app(fingerprint=fingerprint)
    with Server(app) as s, httpx.Client(base_url=s.url) as c:
        h = {"Idempotency-Key": key}
        assert c.post("/charges?x=1", headers=h, json={"amount": 5, "memo": "a"}
                      ).status_code == 201
        r = c.post("/charges?x=1", headers=h, json={"memo": "b", "amount": 5})
        assert r.headers["idempotent-replayed"] == "true", "only the amount is compared"
        assert c.post("/charges?x=1", headers=h, json={"amount": 6}).status_code == 422
    assert seen[0].method == "POST" and seen[0].path == "/charges?x=1"
    assert db.execute("SELECT fingerprint = sha256(convert_to('{\"amount\": 5}'::jsonb::text, "
                      "'UTF8')) FROM idempotency.keys WHERE key = %s", (key,)).fetchone()[0]


def test_default_fingerprint_is_method_path_and_body_hash(client: httpx.Client, db: Any, key: str) -> None:
    body = b'\x00\x01 any bytes'
    post(client, "/binary?q=%20x", key, content=body)
    expect = {"method": "POST", "path": "/binary?q=%20x",
              "body_sha256": hashlib.sha256(body).hexdigest()}
    assert db.execute("SELECT fingerprint = sha256(convert_to(%s::jsonb::text, 'UTF8')) "
                      "FROM idempotency.keys WHERE key = %s", (Jsonb(expect), key)).fetchone()[0]


# ---- heartbeat, disconnect, lost key ---------------------------------------------------


def test_heartbeat_keeps_a_slow_handler_alive(db: Any, key: str) -> None:
    app = make_app(lease=2.4)
    g = gate(app, key)
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        first: List[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(
            c.post(f"/slow/{key}", headers={"Idempotency-Key": key})))
        t.start()
        try:
            assert g.entered.wait(30)
            wait_past_lease(db, key)
            r = c.post(f"/slow/{key}", headers={"Idempotency-Key": key})
            assert_problem(r, 409, "idempotency-key-in-use")
        finally:
            g.release.set()
            t.join(30)
    assert first[0].status_code == 201
    assert stored(db, key) == ("succeeded", 1, 201, {
        "v": 1, "headers": {"content-type": "application/json"}, "json": {"slow": key}})
    assert calls(app)[f"slow/{key}"] == 1


def test_client_disconnect_still_stores_the_result(db: Any, key: str) -> None:
    app = make_app()
    g = gate(app, key)
    probe = Probe(app)
    with Server(probe) as s:
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall((f"POST /slow/{key} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n"
                      "Content-Length: 0\r\n\r\n").encode())
        assert g.entered.wait(30)
        sock.close()
        wait_for(lambda: s.connections() == 0, what="the server to see the disconnect")
        assert stored(db, key)[:2] == ("pending", 1)  # type: ignore[index]
        g.release.set()
        assert probe.done.wait(30)
        assert stored(db, key) == ("succeeded", 1, 201, {
            "v": 1, "headers": {"content-type": "application/json"}, "json": {"slow": key}})
        with httpx.Client(base_url=s.url) as c:
            r = c.post(f"/slow/{key}", headers={"Idempotency-Key": key})
        assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
        assert r.json() == {"slow": key}
    assert calls(app)[f"slow/{key}"] == 1


def test_lost_key_gets_409_and_is_not_stored(db: Any, key: str) -> None:
    app = make_app(lease=60)
    g = gate(app, key)
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        first: List[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(
            c.post(f"/slow/{key}", headers={"Idempotency-Key": key})))
        t.start()
        assert g.entered.wait(30)
        request = {"method": "POST", "path": f"/slow/{key}",
                   "body_sha256": hashlib.sha256(b"").hexdigest()}
        other = take_over(db, key, request)
        g.release.set()
        t.join(30)
        assert_problem(first[0], 409, "idempotency-key-lost")
        assert stored(db, key)[:2] == ("pending", 1)  # type: ignore[index]
        # the attempt that took over stores its own result; retries get it
        db.execute("SELECT idempotency.idem_finish(%s, %s, 202, %s)", (key, other, Jsonb(
            {"v": 1, "headers": {"content-type": "application/json"}, "json": {"other": 1}})))
        r = c.post(f"/slow/{key}", headers={"Idempotency-Key": key})
        assert r.status_code == 202 and r.json() == {"other": 1}
        assert r.headers["idempotent-replayed"] == "true"


# ---- interop: results the Node library stored ------------------------------------------


def test_replays_envelopes_written_by_another_client(client: httpx.Client, db: Any,
                                                     key: str) -> None:
    raw = bytes(range(256))
    cases = [
        ("/orders", 201, {"v": 1, "headers": {"content-type": "application/json",
                                              "location": "/orders/9"},
                          "json": {"order": 9, "list": [1, 2.5, None, True], "s": "\u00e9"}}),
        ("/binary", 200, {"v": 1, "headers": {"content-type": "image/png"},
                          "base64": base64.b64encode(raw).decode()}),
        ("/empty", 204, {"v": 1, "headers": {}}),
    ]
    for i, (path, code, envelope) in enumerate(cases):
        k = f"{key}-{i}"
        request = {"method": "POST", "path": path,
                   "body_sha256": hashlib.sha256(b"").hexdigest()}
        token = db.execute("SELECT token FROM idempotency.idem_claim(key => %s, request => %s)",
                           (k, Jsonb(request))).fetchone()[0]
        db.execute("SELECT idempotency.idem_finish(key => %s, token => %s, response_code => %s, "
                   "response_body => %s::jsonb)", (k, token, code, json.dumps(envelope)))
        r = post(client, path, k)
        assert r.status_code == code and r.headers["idempotent-replayed"] == "true"
        for name, value in envelope["headers"].items():  # type: ignore[attr-defined]
            assert r.headers[name] == value
        if "json" in envelope:
            assert r.json() == envelope["json"]
            # PostgreSQL's text form of the stored value, as the Node library sends it
            in_db = db.execute("SELECT (response_body -> 'json')::text FROM idempotency.keys "
                               "WHERE key = %s", (k,)).fetchone()[0]
            assert r.content == in_db.encode()
        elif "base64" in envelope:
            assert r.content == raw
        else:
            assert r.content == b""


# ---- the cache -----------------------------------------------------------------------


def test_cache_serves_replays_without_the_database(db: Any, key: str) -> None:
    cache = ResultCache(10)
    app = make_app(cache=cache)
    with Server(app) as s, httpx.Client(base_url=s.url) as c:
        h = {"Idempotency-Key": key}
        r1 = c.post("/orders", headers=h, json={"item": "a"})
        assert r1.status_code == 201 and len(cache) == 1
        # the row is gone: only the cache can answer this replay
        db.execute("DELETE FROM idempotency.keys WHERE key = %s", (key,))
        r2 = c.post("/orders", headers=h, json={"item": "a"})
        assert r2.status_code == 201 and r2.headers["idempotent-replayed"] == "true"
        assert r2.json() == r1.json() and r2.headers["location"] == r1.headers["location"]
        assert cache.hits == 1
        assert stored(db, key) is None, "no claim reached the database"
        assert calls(app)["orders"] == 1


def test_cache_never_serves_a_different_fingerprint(db: Any, key: str) -> None:
    cache = ResultCache(10)
    app = make_app(cache=cache)
    with Server(app) as s, httpx.Client(base_url=s.url) as c:
        h = {"Idempotency-Key": key}
        assert c.post("/orders", headers=h, json={"item": "a"}).status_code == 201
        assert_problem(c.post("/orders", headers=h, json={"item": "b"}), 422,
                       "idempotency-key-reused")
        assert cache.hits == 0


def test_cache_is_filled_by_a_replay_and_bounded(db: Any, key: str) -> None:
    cache = ResultCache(1)
    app = make_app(cache=cache)
    k1, k2 = key + "-1", key + "-2"
    for k in (k1, k2):
        token = db.execute("SELECT token FROM idempotency.idem_claim(key => %s, request => %s)",
                           (k, Jsonb({"method": "POST", "path": "/orders", "body_sha256":
                                      hashlib.sha256(b"{}").hexdigest()}))
                           ).fetchone()[0]
        db.execute("SELECT idempotency.idem_finish(%s, %s, 201, %s)",
                   (k, token, Jsonb({"v": 1, "headers": {}, "json": {"k": k}})))
    with Server(app) as s, httpx.Client(base_url=s.url) as c:
        def replay(k: str) -> httpx.Response:
            return c.post("/orders", headers={"Idempotency-Key": k,
                                              "content-type": "application/json"}, content=b"{}")
        assert replay(k1).json() == {"k": k1}                   # from the database
        db.execute("DELETE FROM idempotency.keys WHERE key = %s", (k1,))
        assert replay(k1).json() == {"k": k1} and cache.hits == 1   # from the cache
        assert replay(k2).json() == {"k": k2}                   # evicts k1 (max 1)
        r = replay(k1)                                          # k1 gone everywhere: runs
        assert "idempotent-replayed" not in r.headers and r.status_code == 201
        assert calls(app)["orders"] == 1


def test_cache_entry_expires_with_the_key(db: Any, key: str) -> None:
    import datetime as dt
    now = [dt.datetime.now(dt.timezone.utc)]
    cache = ResultCache(10, now=lambda: now[0])
    app = make_app(cache=cache, retention=3600)
    with Server(app) as s, httpx.Client(base_url=s.url) as c:
        h = {"Idempotency-Key": key}
        c.post("/orders", headers=h, json={})
        db.execute("DELETE FROM idempotency.keys WHERE key = %s", (key,))
        now[0] += dt.timedelta(seconds=3601)                    # past expires_at
        r = c.post("/orders", headers=h, json={})
        assert "idempotent-replayed" not in r.headers and cache.hits == 0
        assert calls(app)["orders"] == 2


def test_disconnect_before_the_body_claims_nothing(db: Any, key: str) -> None:
    app = make_app()
    probe = Probe(app)
    with Server(probe) as s:
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall((f"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n"
                      "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{").encode())
        sock.close()
        assert probe.done.wait(30)
    assert stored(db, key) is None
    assert calls(app).get("orders", 0) == 0

