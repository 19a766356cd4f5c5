"""A finish that fails after the handler ran never releases the key: the side
effect ran, and a released key would let a retry run it again as attempt 1."""

from __future__ import annotations

import base64
import threading
from typing import Any, Dict, List

import httpx
import psycopg

from conftest import Server, stored, token_of, wait_past_lease
from httpapp import calls, gate, make_app
from test_asgi_stored_bytes import HookedPool, assert_unavailable, failing, post

HUGE = b'{"n": 1e1000000}'


def test_json_body_jsonb_refuses_is_stored_as_bytes_and_replayed(db: Any, key: str) -> None:
    app = make_app()
    with Server(app) as s:
        r1 = post(s.url, "/huge-number", key)
        assert r1.status_code == 201, r1.text
        assert r1.content == HUGE and "idempotent-replayed" not in r1.headers
        r2 = post(s.url, "/huge-number", key)
        assert r2.status_code == 201 and r2.headers["idempotent-replayed"] == "true"
        assert r2.content == HUGE
        assert calls(app)["huge-number"] == 1
    status, attempt, code, envelope = stored(db, key)  # type: ignore[misc]
    assert (status, attempt, code) == ("succeeded", 1, 201)
    assert envelope["base64"] == base64.b64encode(HUGE).decode() and "json" not in envelope
    assert envelope["headers"]["content-type"] == "application/json"


def test_finish_that_times_out_on_a_lock_leaves_the_key_to_its_lease(db: Any,
                                                                      key: str) -> None:
    # every statement of the middleware gives up on a row lock after 100 ms
    pool = HookedPool(options="-c lock_timeout=100")
    app = make_app(pool=pool, lease=5)  # type: ignore[arg-type]
    seen: List[str] = []
    locker = psycopg.connect()
    unlocked = threading.Lock()
    done: List[bool] = []

    def unlock() -> None:
        with unlocked:
            if not done:
                done.append(True)
                locker.commit()

    def hook(sql: str) -> None:
        seen.append(sql)
        if "idem_release" in sql:
            # the finish has failed by now: a release must find the key free
            unlock()
    pool.hook = hook
    g = gate(app, "lock")
    result: Dict[str, httpx.Response] = {}
    try:
        with Server(app) as s:
            thread = threading.Thread(
                target=lambda: result.setdefault("r", post(s.url, "/slow/lock", key)),
                daemon=True)
            thread.start()
            assert g.entered.wait(30)
            token = token_of(db, key)
            locker.execute("SELECT token FROM idempotency.keys WHERE key = %s AND scope = '' "
                           "FOR UPDATE", (key,))
            g.release.set()
            thread.join(60)
            unlock()
            assert_unavailable(result["r"])
            assert sum("idem_finish" in q for q in seen) > 1, "the finish is tried again"
            assert not any("idem_release" in q for q in seen)
            assert stored(db, key)[:2] == ("pending", 1)  # type: ignore[index]
            assert token_of(db, key) == token
            retry = post(s.url, "/slow/lock", key)
            assert retry.status_code == 409, retry.text
            assert retry.json()["type"].endswith("idempotency-key-in-use")
            assert calls(app)["slow/lock"] == 1
            # once the lease has run out, a retry takes the key over
            wait_past_lease(db, key)
            takeover = post(s.url, "/slow/lock", key)
            assert takeover.status_code == 201, takeover.text
            assert calls(app)["slow/lock"] == 2
            assert stored(db, key)[:2] == ("succeeded", 2)  # type: ignore[index]
            assert token_of(db, key) != token
    finally:
        g.release.set()
        locker.close()


def test_finish_refused_for_good_answers_500_and_keeps_the_key(db: Any, key: str) -> None:
    pool = HookedPool()
    app = make_app(pool=pool)  # type: ignore[arg-type]
    seen: List[str] = []
    refuse = failing("idem_finish",
                     lambda: psycopg.errors.InsufficientPrivilege("permission denied"))

    def hook(sql: str) -> None:
        seen.append(sql)
        refuse(sql)
    pool.hook = hook
    with Server(app) as s:
        r = post(s.url, "/echo-json", key, b"[1]")
        assert r.status_code == 500, r.text
        problem = r.json()
        assert problem["type"].endswith("idempotency-misconfigured")
        assert "Permission denied" in problem["detail"]
        assert not any("idem_release" in q for q in seen)
        assert stored(db, key)[:2] == ("pending", 1)  # type: ignore[index]
        pool.hook = None
        retry = post(s.url, "/echo-json", key, b"[1]")
        assert retry.status_code == 409 and calls(app)["echo-json"] == 1
