"""Remembered keys (extension 1.7): the ``remember`` option of jobs (sync and
async) and of the ASGI middleware, ``ExpiredError`` and the 410
``idempotency-key-expired`` answer, the ``on_expired`` hook, and the same
client on an extension before 1.7, where it sends no ``remember`` argument
unless told to and then names the version it needs. A key is moved past its
retention by ``age()`` instead of waiting for the clock."""

from __future__ import annotations

import datetime as dt
import importlib.metadata
from typing import Any, Iterator, List, Optional

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import pg_idempotency
from conftest import Server, age, database_with_extension
from httpapp import calls, make_app
from pg_idempotency import (ExpiredError, HookEvent, IdempotencyError, IdempotencyMiddleware,
                            MismatchError, MisconfiguredError, idempotent, idempotent_job)

DAY = 86400
# sessions where the server remembers every key for an hour unless told otherwise
REMEMBERING = "options='-c idempotency.remember=3600'"


def remember_of(db: psycopg.Connection[Any], key: str, scope: str = "") -> Optional[float]:
    """The remember a key's row holds, in seconds; None: the key is not remembered."""
    row = db.execute("SELECT pg_catalog.date_part('epoch', remember)::float8 "
                     "FROM idempotency.keys WHERE scope = %s AND key = %s",
                     (scope, key)).fetchone()
    assert row is not None, f"the row of {key!r}"
    return row[0]


def listening(heard: List[HookEvent]) -> dict[str, Any]:
    """Hooks that record the expired and error events they hear."""
    return {"on_expired": heard.append, "on_error": heard.append}


def test_the_version_is_the_distribution_s() -> None:
    """The version the errors name is the one the package is installed as."""
    assert pg_idempotency.__version__ == importlib.metadata.version("pg-idempotency")


# ---- jobs -------------------------------------------------------------------------


def test_a_sync_job_past_its_retention_raises_expired(pool: ConnectionPool, db: Any,
                                                      key: str) -> None:
    heard: List[HookEvent] = []
    options: dict[str, Any] = dict(request={"amount": 500}, scope="payouts", remember=30 * DAY,
                                   **listening(heard))
    with idempotent(pool, key, **options) as job:
        job.set_result("paid")
    assert remember_of(db, key, "payouts") == 30 * DAY
    with idempotent(pool, key, **options) as job:
        assert job.replayed and job.value == "paid"
    age(db, key, "payouts")

    with pytest.raises(ExpiredError) as caught:
        with idempotent(pool, key, **options):
            pytest.fail("a remembered key must not run again")
    err = caught.value
    assert isinstance(err, IdempotencyError)
    assert (err.key, err.scope, err.status, err.response_code) == (key, "payouts", "succeeded",
                                                                    None)
    assert "was already used (it succeeded); its stored result has expired" in str(err)
    assert [(e.kind, e.key, e.scope, e.status, e.response_code, e.request) for e in heard] == [
        ("expired", key, "payouts", "succeeded", None, {"amount": 500})], "no on_error"

    # the server decides: a block without the option gets the same answer
    with pytest.raises(ExpiredError):
        with idempotent(pool, key, request={"amount": 500}, scope="payouts"):
            pytest.fail("a remembered key must not run again")
    # another request on the remembered key is a mismatch, as on a live one
    with pytest.raises(MismatchError):
        with idempotent(pool, key, **dict(options, request={"amount": 1})):
            pytest.fail("a different request must not run")


def test_a_failure_stored_with_remember_expires_as_failed(pool: ConnectionPool, db: Any,
                                                         key: str) -> None:
    with pytest.raises(ValueError):
        with idempotent(pool, key, remember=DAY, retryable=lambda e: False):
            raise ValueError("card declined")
    age(db, key)
    with pytest.raises(ExpiredError) as caught:
        with idempotent(pool, key, remember=DAY):
            pytest.fail("a remembered key must not run again")
    assert caught.value.status == "failed"


async def test_an_async_job_past_its_retention_raises_expired(apool: AsyncConnectionPool,
                                                              db: Any, key: str) -> None:
    heard: List[HookEvent] = []
    async with idempotent(apool, key, remember=dt.timedelta(days=7), **listening(heard)) as job:
        job.set_result(1)
    assert remember_of(db, key) == 7 * DAY
    age(db, key)
    with pytest.raises(ExpiredError) as caught:
        async with idempotent(apool, key, remember=dt.timedelta(days=7), **listening(heard)):
            pytest.fail("a remembered key must not run again")
    assert (caught.value.status, caught.value.response_code) == ("succeeded", None)
    assert [e.kind for e in heard] == ["expired"]


def test_idempotent_job_takes_remember(pool: ConnectionPool, db: Any, key: str) -> None:
    runs: List[str] = []
    heard: List[HookEvent] = []

    @idempotent_job(pool, key=lambda order: order, scope="payouts", remember=DAY,
                    **listening(heard))
    def pay_out(order: str) -> str:
        runs.append(order)
        return f"paid {order}"

    assert pay_out(key) == f"paid {key}"
    age(db, key, "payouts")
    with pytest.raises(ExpiredError) as caught:
        pay_out(key)
    assert (caught.value.key, caught.value.scope) == (key, "payouts")
    assert runs == [key] and [e.kind for e in heard] == ["expired"]


async def test_an_async_idempotent_job_takes_remember(apool: AsyncConnectionPool, db: Any,
                                                      key: str) -> None:
    runs: List[str] = []

    @idempotent_job(apool, key=lambda order: order, scope="payouts", remember=DAY)
    async def pay_out(order: str) -> str:
        runs.append(order)
        return "paid"

    assert await pay_out(key) == "paid"
    age(db, key, "payouts")
    with pytest.raises(ExpiredError):
        await pay_out(key)
    assert runs == [key]


def test_without_remember_an_aged_key_runs_again(pool: ConnectionPool, db: Any,
                                                 key: str) -> None:
    with idempotent(pool, key) as job:
        job.set_result("first")
    assert remember_of(db, key) is None
    age(db, key)
    with idempotent(pool, key) as job:
        assert not job.replayed, "a key that is not remembered runs again past its retention"
        job.set_result("second")


def test_the_server_setting_remembers_and_remember_0_turns_it_off(db: Any, key: str) -> None:
    with ConnectionPool(REMEMBERING, min_size=1, max_size=2,
                        kwargs={"autocommit": True}) as remembering:
        with idempotent(remembering, key) as job:
            job.set_result("kept")
        assert remember_of(db, key) == 3600
        age(db, key)
        with pytest.raises(ExpiredError):
            with idempotent(remembering, key):
                pytest.fail("remembered by the server's setting")

        off = key + "-off"
        with idempotent(remembering, off, remember=0) as job:
            job.set_result("not kept")
        assert remember_of(db, off) is None
        age(db, off)
        with idempotent(remembering, off, remember=0) as job:
            assert not job.replayed
            job.set_result("ran")


def test_a_bad_remember_or_on_expired_is_refused_at_once(pool: ConnectionPool,
                                                         key: str) -> None:
    with pytest.raises(ValueError, match="remember must be 0 or more seconds"):
        idempotent(pool, key, remember=-1)
    with pytest.raises(TypeError, match="remember must be seconds or a timedelta"):
        idempotent(pool, key, remember="a day")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="remember must be 0 or more seconds"):
        idempotent_job(pool, key=lambda k: k, remember=dt.timedelta(seconds=-1))
    with pytest.raises(TypeError, match="on_expired must be callable"):
        idempotent(pool, key, on_expired="log it")  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="remember must be 0 or more seconds"):
        IdempotencyMiddleware(make_app, pool=None, remember=-5)  # type: ignore[arg-type]


# ---- ASGI -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heard() -> List[HookEvent]:
    return []


@pytest.fixture(scope="module")
def server(heard: List[HookEvent]) -> Iterator[Server]:
    app = make_app(remember=7 * DAY, **listening(heard))
    with Server(app) as s:
        s.app = app  # type: ignore[attr-defined]
        yield s


def post(url: str, path: str, key: str, body: Any) -> httpx.Response:
    return httpx.post(url + path, headers={"Idempotency-Key": f'"{key}"'}, json=body, timeout=60)


def expired_problem(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 410, r.text
    assert r.headers["content-type"] == "application/problem+json"
    assert r.headers["idempotency-key-retention"] == "86400"
    assert "idempotent-replayed" not in r.headers
    p: dict[str, Any] = r.json()
    assert p["type"] == "urn:idempotency:problem:idempotency-key-expired"
    assert p["title"] == "Idempotency-Key already used; its stored response has expired"
    assert p["status"] == 410
    return p


def test_a_retry_past_the_retention_gets_410_with_the_original_outcome(
        server: Server, heard: List[HookEvent], db: Any, key: str) -> None:
    app = server.app  # type: ignore[attr-defined]
    assert post(server.url, "/orders", key, {"item": "lamp"}).status_code == 201
    assert remember_of(db, key) == 7 * DAY, "claim and finish store remember"
    runs = calls(app)["orders"]
    age(db, key)
    heard.clear()

    p = expired_problem(post(server.url, "/orders", key, {"item": "lamp"}))
    assert (p["key_status"], p["response_code"]) == ("succeeded", 201)
    assert "already processed (it succeeded, with status 201); its stored response has " \
        "expired" in p["detail"]
    assert calls(app)["orders"] == runs
    assert [(e.kind, e.key, e.scope, e.status, e.response_code) for e in heard] == [
        ("expired", key, "", "succeeded", 201)]
    assert heard[0].request is not None

    r = post(server.url, "/orders", key, {"item": "chair"})
    assert r.status_code == 422 and r.json()["type"].endswith("idempotency-key-reused")
    assert calls(app)["orders"] == runs


def test_a_stored_4xx_expires_as_failed_with_its_status(server: Server, db: Any,
                                                        key: str) -> None:
    assert post(server.url, "/status/400", key, {}).status_code == 400
    age(db, key)
    p = expired_problem(post(server.url, "/status/400", key, {}))
    assert (p["key_status"], p["response_code"]) == ("failed", 400)


def test_the_server_setting_alone_makes_the_answer_410(db: Any, key: str) -> None:
    app = make_app(pool=AsyncConnectionPool(REMEMBERING, min_size=1, max_size=2, open=False))
    with Server(app) as s:
        assert post(s.url, "/orders", key, {"item": "vase"}).status_code == 201
        assert remember_of(db, key) == 3600
        age(db, key)
        expired_problem(post(s.url, "/orders", key, {"item": "vase"}))


# ---- extension versions before 1.7 ------------------------------------------------


@pytest.fixture
def v16_db(db: Any) -> Iterator[str]:
    with database_with_extension(db, "idem_py_v16_", "1.6") as name:
        yield name


def test_on_1_6_both_work_without_remember_and_name_the_version_with_it(v16_db: str,
                                                                        key: str) -> None:
    needs = (f"pg-idempotency {pg_idempotency.__version__} (remember) needs the idempotency "
             f"extension 1.7 or later; database \"{v16_db}\" has 1.6: run ALTER EXTENSION "
             "idempotency UPDATE.")
    with psycopg.connect(dbname=v16_db, autocommit=True) as conn:
        with idempotent(conn, key) as job:
            job.set_result("old")
        with idempotent(conn, key) as job:
            assert job.replayed and job.value == "old"
        with pytest.raises(MisconfiguredError) as caught:
            with idempotent(conn, key + "-r", remember=DAY):
                pytest.fail("no remember before 1.7")
        assert str(caught.value) == needs
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE key = %s",
                            (key + "-r",)).fetchone() == (0,), "refused before the claim"

    plain = make_app(pool=AsyncConnectionPool(f"dbname={v16_db}", min_size=1, max_size=2,
                                              open=False))
    kept = make_app(pool=AsyncConnectionPool(f"dbname={v16_db}", min_size=1, max_size=2,
                                             open=False), remember=DAY)
    with Server(plain) as s:
        assert post(s.url, "/orders", key + "-h", {"item": "old"}).status_code == 201
    with Server(kept) as s:
        r = post(s.url, "/orders", key + "-k", {"item": "old"})
        assert r.status_code == 500, r.text
        assert r.json()["type"].endswith("idempotency-misconfigured")
        assert r.json()["detail"] == needs
        assert calls(kept).get("orders", 0) == 0, "the handler never runs"
