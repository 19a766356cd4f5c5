"""Completers (extension 1.8): ``keep_request`` on jobs and on the ASGI
middleware, and ``completer()`` (sync and async) taking over abandoned keys:
woken by the sweep's NOTIFY, by its poll, after its LISTEN connection comes
back; two of them racing; a handler's error; a graceful stop; and the
refusals on an older extension.

Each test has a scope of its own, since a completer takes every abandoned key
of its scope. A key is abandoned by claiming it with a tiny lease and waiting
until the database clock has passed that lease (or by a job that kills
itself), and the sweep is called here, so that its notification is the
test's to send."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import uuid
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx
import psycopg
import pytest
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, ConnectionPool

import pg_idempotency
from conftest import Server, database_with_extension, wait_for, with_pool_lifespan
from pg_idempotency import (AsyncCompleter, Completer, HookEvent, IdempotencyMiddleware, Job,
                            MisconfiguredError, StoredFailureError, completer, current_job,
                            idempotent, idempotent_job)

HERE = os.path.dirname(os.path.abspath(__file__))


def new_scope(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex}"


def row_of(db: psycopg.Connection[Any], key: str, scope: str) -> Optional[Dict[str, Any]]:
    """The stored key: status, attempt, token, phase, phase_data, request,
    response_code, response_body; None when absent."""
    cur = db.execute("SELECT status, attempt, token, phase, phase_data, request, response_code, "
                     "response_body FROM idempotency.keys WHERE scope = %s AND key = %s",
                     (scope, key))
    row = cur.fetchone()
    if row is None:
        return None
    names = [c.name for c in cur.description or []]
    return dict(zip(names, row))


def lease_ended(db: psycopg.Connection[Any], key: str, scope: str) -> None:
    """Wait until the database clock has passed the lease of the key's
    current attempt, or until that attempt is over anyway: a completer may
    take the key over first, woken by a sweep of the background worker."""
    first = row_of(db, key, scope)
    assert first is not None
    token = first["token"]
    wait_for(lambda: db.execute(
        "SELECT status <> 'pending' OR token IS DISTINCT FROM %s::bigint "
        "       OR lease_until <= pg_catalog.clock_timestamp() FROM idempotency.keys "
        "WHERE scope = %s AND key = %s", (token, scope, key)).fetchone() == (True,),
        what=f"the lease of {key} to end")


def abandoned_keys(db: psycopg.Connection[Any], scope: str, requests: List[Any]
                   ) -> List[Tuple[str, int]]:
    """(key, token) of keys abandoned by their attempts, one per request:
    claimed with keep_request and a lease of 50 ms, waited for until those
    leases ended."""
    keys = []
    for request in requests:
        key = "abandoned-" + uuid.uuid4().hex
        row = db.execute(
            "SELECT outcome, token FROM idempotency.idem_claim(key => %s, request => %s, "
            "scope => %s, lease => interval '50 milliseconds', keep_request => true)",
            (key, Jsonb(request), scope)).fetchone()
        assert row is not None and row[0] == "claimed", row
        keys.append((key, int(row[1])))
    for key, _ in keys:
        lease_ended(db, key, scope)
    return keys


def abandoned(db: psycopg.Connection[Any], scope: str, request: Any) -> str:
    return abandoned_keys(db, scope, [request])[0][0]


def sweep(db: psycopg.Connection[Any]) -> None:
    """The sweep: resets the keys whose lease ended and notifies their scopes."""
    db.execute("SELECT * FROM idempotency.idem_sweep()")


def finished(db: psycopg.Connection[Any], key: str, scope: str,
             status: str = "succeeded") -> Dict[str, Any]:
    wait_for(lambda: (row_of(db, key, scope) or {}).get("status") == status,
             what=f"{key} to be {status}")
    row = row_of(db, key, scope)
    assert row is not None
    return row


def charge_order(job: Any) -> Dict[str, Any]:
    """The job's block as a function: what ``idempotent()`` runs, and what a
    completer runs unchanged."""
    charge = (job.phase_data or {}).get("charge")
    if job.phase is None:
        charge = f"ch-{job.token}"
        job.checkpoint("charged", {"charge": charge})
    return {"order": job.key, "charge": charge, "amount": job.request["amount"],
            "finished_by": job.attempt, "current": current_job() is job}


@pytest.fixture
def quiet_pool() -> Iterator[ConnectionPool]:
    with ConnectionPool("", min_size=1, max_size=8, kwargs={"autocommit": True}) as p:
        yield p


def sync_completer(pool: ConnectionPool, **options: Any) -> Completer:
    """A completer with the tests' settings: no timer poll unless asked."""
    merged: Dict[str, Any] = {"poll_interval": 3600, **options}
    return Completer(pool, **merged)


# ---- keep_request ----------------------------------------------------------------


def test_keep_request_stores_the_request_while_pending(db: Any, quiet_pool: ConnectionPool,
                                                       key: str) -> None:
    scope = new_scope("keep")
    request = {"amount": 100, "lines": [{"sku": "A1", "qty": 2}]}
    with idempotent(quiet_pool, key, scope=scope, request=request, keep_request=True) as job:
        assert job.request == request
        assert row_of(db, key, scope)["request"] == request  # type: ignore[index]
        job.set_result("done")
    assert row_of(db, key, scope)["request"] is None  # type: ignore[index]
    with idempotent(quiet_pool, key + "-plain", scope=scope, request=request) as job:
        job.set_result("plain")
    assert row_of(db, key + "-plain", scope)["request"] is None  # type: ignore[index]
    with pytest.raises(TypeError, match="keep_request must be a bool"):
        idempotent(quiet_pool, key, keep_request="yes")  # type: ignore[call-overload]


# ---- taking abandoned keys over ---------------------------------------------------


def test_a_killed_job_is_finished_from_its_checkpoint_and_the_retry_replays(
        db: Any, quiet_pool: ConnectionPool, key: str) -> None:
    scope = new_scope("killed")
    request = {"amount": 250, "currency": "EUR"}
    heard: List[Tuple[str, HookEvent]] = []
    runs: List[Dict[str, Any]] = []

    def handler(job: Job) -> Dict[str, Any]:
        runs.append({"attempt": job.attempt, "phase": job.phase, "request": job.request,
                     "token": job.token})
        return charge_order(job)

    with sync_completer(quiet_pool, scope=scope, handler=handler,
                        on_claim=lambda e: heard.append(("claim", e)),
                        on_finish=lambda e: heard.append(("finish", e)),
                        on_error=lambda e: heard.append(("error", e))) as c:
        assert c.listening
        child = subprocess.run([sys.executable, os.path.join(HERE, "crash_job.py"), key, scope,
                                json.dumps(request), "0.5"], check=False)
        assert child.returncode == -9
        left = row_of(db, key, scope)
        assert left is not None
        assert (left["status"], left["attempt"], left["phase"], left["request"]) == (
            "pending", 1, "charged", request)
        lease_ended(db, key, scope)
        sweep(db)
        done = finished(db, key, scope)
    expected = {"order": key, "charge": f"ch-{left['token']}", "amount": 250, "finished_by": 2,
                "current": True}
    assert done["response_body"] == {"v": 1, "json": expected}
    assert done["request"] is None
    assert len(runs) == 1 and runs[0]["attempt"] == 2 and runs[0]["phase"] == "charged"
    assert runs[0]["request"] == request
    assert int(runs[0]["token"]) > int(left["token"]), "a newer fencing token"
    assert [(k, e.key, e.attempt, e.phase if k == "claim" else e.status) for k, e in heard] == [
        ("claim", key, 2, "charged"), ("finish", key, 2, "succeeded")]

    # the client's retry: the stored result, the block not run again
    with idempotent(quiet_pool, key, scope=scope, request=request) as job:
        assert job.replayed and job.value == expected


def test_the_function_of_an_idempotent_job_finishes_its_keys(
        db: Any, quiet_pool: ConnectionPool) -> None:
    scope = new_scope("wrapped")

    @idempotent_job(quiet_pool, key=lambda order: str(order["id"]), request=lambda order: order,
                    scope=scope, keep_request=True)
    def ship(order: Dict[str, Any]) -> Dict[str, Any]:
        job = current_job()
        assert job is not None
        return {"shipped": order["id"], "attempt": job.attempt}

    assert ship({"id": "o-1"}) == {"shipped": "o-1", "attempt": 1}
    key = abandoned(db, scope, {"id": "o-2"})
    with sync_completer(quiet_pool, scope=scope,
                        handler=lambda job: ship.__wrapped__(job.request)):  # type: ignore[attr-defined]
        done = finished(db, key, scope)
    assert done["response_body"]["json"] == {"shipped": "o-2", "attempt": 2}


async def test_an_async_completer_finishes_an_abandoned_key(db: Any, apool: AsyncConnectionPool
                                                           ) -> None:
    scope = new_scope("async")
    seen: List[Any] = []

    async def handler(job: Any) -> Dict[str, Any]:
        seen.append((job.attempt, job.phase, job.request, current_job() is job))
        await asyncio.sleep(0)
        return {"paid": job.request["amount"]}

    c = completer(apool, scope=scope, handler=handler, poll_interval=3600)
    assert isinstance(c, AsyncCompleter)
    async with c:
        assert c.listening
        key = await asyncio.to_thread(abandoned, db, scope, {"amount": 9})
        await asyncio.to_thread(sweep, db)
        done = await asyncio.to_thread(finished, db, key, scope)
    assert done["response_body"]["json"] == {"paid": 9}
    assert seen == [(2, None, {"amount": 9}, True)]
    assert not c.listening
    async with idempotent(apool, key, scope=scope, request={"amount": 9}) as job:
        assert job.replayed and job.value == {"paid": 9}


def test_two_completers_racing_run_every_key_exactly_once(db: Any,
                                                          quiet_pool: ConnectionPool) -> None:
    scope = new_scope("race")
    runs: Dict[str, int] = {}
    lock = threading.Lock()

    def handler(job: Job) -> str:
        with lock:
            runs[job.key] = runs.get(job.key, 0) + 1
        return job.key

    with ConnectionPool("", min_size=1, max_size=8, kwargs={"autocommit": True}) as other:
        with sync_completer(quiet_pool, scope=scope, handler=handler, concurrency=4) as a, \
                sync_completer(other, scope=scope, handler=handler, concurrency=3) as b:
            keys = [k for k, _ in abandoned_keys(db, scope, [{"n": i} for i in range(20)])]
            pollers = [threading.Thread(target=c.poll) for c in (a, b, a, b)]
            for t in pollers:
                t.start()
            sweep(db)
            for t in pollers:
                t.join()
            for k in keys:
                finished(db, k, scope)
    assert [runs.get(k) for k in keys] == [1] * len(keys)
    assert all(row_of(db, k, scope)["attempt"] == 2 for k in keys)  # type: ignore[index]


def test_a_handler_error_releases_the_key_or_stores_the_failure(
        db: Any, quiet_pool: ConnectionPool) -> None:
    scope = new_scope("error")
    heard: List[HookEvent] = []
    boom = RuntimeError("provider down")

    def failing(job: Job) -> None:
        raise boom

    with sync_completer(quiet_pool, scope=scope, handler=failing, on_finish=heard.append,
                        on_error=heard.append):
        key = abandoned(db, scope, {"amount": 1})
        sweep(db)
        wait_for(lambda: heard, what="the handler to settle")
    assert [(e.kind, e.key, e.status, e.error) for e in heard] == [
        ("finish", key, "released", boom)]
    assert row_of(db, key, scope) is None, "released: the key is gone"
    with idempotent(quiet_pool, key, scope=scope, request={"amount": 1}) as job:
        assert not job.replayed and job.attempt == 1

    def declined(job: Job) -> None:
        raise ValueError("bad order")

    with sync_completer(quiet_pool, scope=scope, handler=declined,
                        retryable=lambda e: not isinstance(e, ValueError)):
        second = abandoned(db, scope, {"amount": 2})
        sweep(db)
        finished(db, second, scope, status="failed")
    with pytest.raises(StoredFailureError) as caught:
        with idempotent(quiet_pool, second, scope=scope, request={"amount": 2}):
            pytest.fail("a stored failure does not run")
    assert caught.value.error_message == "bad order"


def test_stop_waits_for_the_running_handler_and_takes_nothing_more(
        db: Any, quiet_pool: ConnectionPool) -> None:
    scope = new_scope("stop")
    entered = threading.Event()
    release = threading.Event()

    def slow(job: Job) -> str:
        entered.set()
        release.wait()
        return "late but stored"

    c = sync_completer(quiet_pool, scope=scope, handler=slow, concurrency=2)
    c.start()
    first = abandoned(db, scope, {})
    sweep(db)
    assert entered.wait(30)
    stopper = threading.Thread(target=c.stop)
    stopper.start()
    wait_for(lambda: not c.listening, what="the LISTEN connection to close")
    second = abandoned(db, scope, {})
    sweep(db)
    assert c.poll() == 0, "a stopping completer takes nothing over"
    assert stopper.is_alive(), "stop() waits for the handler"
    assert c.running == 1
    release.set()
    stopper.join()
    assert row_of(db, first, scope)["status"] == "succeeded"  # type: ignore[index]
    untouched = row_of(db, second, scope)
    assert untouched is not None and (untouched["status"], untouched["attempt"]) == ("pending", 1)


async def test_an_async_stop_waits_for_the_running_handler(db: Any,
                                                           apool: AsyncConnectionPool) -> None:
    scope = new_scope("astop")
    entered = asyncio.Event()
    release = asyncio.Event()

    async def slow(job: Any) -> str:
        entered.set()
        await release.wait()
        return "late"

    c = completer(apool, scope=scope, handler=slow, poll_interval=3600)
    await c.start()
    key = await asyncio.to_thread(abandoned, db, scope, {})
    await asyncio.to_thread(sweep, db)
    await asyncio.wait_for(entered.wait(), 30)
    stopping = asyncio.ensure_future(c.stop())
    await asyncio.sleep(0)
    assert await c.poll() == 0
    assert not stopping.done() and c.running == 1
    release.set()
    await stopping
    assert (await asyncio.to_thread(row_of, db, key, scope))["status"] == "succeeded"  # type: ignore[index]


def test_it_polls_without_listen_and_while_listen_cannot_connect(
        db: Any, quiet_pool: ConnectionPool, caplog: pytest.LogCaptureFixture) -> None:
    scope = new_scope("poll")
    with completer(quiet_pool, scope=scope, handler=lambda job: "polled", listen_conninfo=False,
                   poll_interval=0.1) as c:
        assert not c.listening
        key = abandoned(db, scope, {})
        assert finished(db, key, scope)["response_body"]["json"] == "polled"
    with caplog.at_level("WARNING", logger="pg_idempotency"):
        with completer(quiet_pool, scope=scope, handler=lambda job: "polled again",
                       listen_conninfo="host=/nonexistent-socket-dir port=1",
                       poll_interval=0.1) as c:
            assert not c.listening
            other = abandoned(db, scope, {})
            assert finished(db, other, scope)["response_body"]["json"] == "polled again"
    assert any("LISTEN connection (scope" in r.getMessage() and "it polls every 0.1 s"
               in r.getMessage() for r in caplog.records)


@pytest.fixture
def listener_role(db: Any) -> Iterator[str]:
    """A login role of its own for the LISTEN connection, whose login the
    test can refuse for a while."""
    name = "idem_py_listener_" + uuid.uuid4().hex[:8]
    db.execute(f"CREATE ROLE {name} LOGIN")
    try:
        yield name
    finally:
        db.execute(f"SELECT pg_catalog.pg_terminate_backend(pid) FROM pg_catalog.pg_stat_activity "
                   f"WHERE usename = '{name}'")
        wait_for(lambda: db.execute("SELECT count(*) FROM pg_catalog.pg_stat_activity "
                                    "WHERE usename = %s", (name,)).fetchone() == (0,),
                 what="the listener's sessions to end")
        db.execute(f"DROP ROLE {name}")


def test_the_listen_connection_lost_reconnects_and_looks_for_what_it_missed(
        db: Any, quiet_pool: ConnectionPool, listener_role: str) -> None:
    scope = new_scope("reconnect")
    with sync_completer(quiet_pool, scope=scope, handler=lambda job: {"finished_by": job.attempt},
                        listen_conninfo=f"user={listener_role}") as c:
        assert c.listening
        # no new LISTEN connection until the test allows it again
        db.execute(f"ALTER ROLE {listener_role} NOLOGIN")
        assert db.execute("SELECT pg_catalog.pg_terminate_backend(pid) FROM "
                          "pg_catalog.pg_stat_activity WHERE usename = %s",
                          (listener_role,)).fetchall() == [(True,)]
        wait_for(lambda: not c.listening, what="the completer to notice")
        # abandoned and swept while nobody listens: the notification is lost
        key = abandoned(db, scope, {})
        sweep(db)
        assert row_of(db, key, scope)["token"] is None  # type: ignore[index]
        db.execute(f"ALTER ROLE {listener_role} LOGIN")
        wait_for(lambda: c.listening, what="the LISTEN connection to be back")
        assert finished(db, key, scope)["response_body"]["json"] == {"finished_by": 2}


# ---- HTTP keys ----------------------------------------------------------------------


class Stalling:
    """A raw ASGI app that records a request's body, then stalls until the
    test releases it (the middleware answers 504 and stops the heartbeat)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.runs = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        self.runs += 1
        while (await receive()).get("more_body"):
            pass
        await asyncio.to_thread(self.release.wait)
        await send({"type": "http.response.start", "status": 201,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b'{"from": "the handler"}'})


def post(server: Server, key: str, body: bytes) -> httpx.Response:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        return c.post("/orders", content=body, headers={"idempotency-key": f'"{key}"',
                                                        "content-type": "application/json"})


def test_an_http_request_whose_handler_stalled_is_finished_and_replayed(
        db: Any, quiet_pool: ConnectionPool, key: str) -> None:
    scope = new_scope("http")
    app = Stalling()
    pool = AsyncConnectionPool("", min_size=1, max_size=4, open=False)
    middleware = IdempotencyMiddleware(app, pool=pool, scope=lambda req: scope,
                                       keep_request=True, lease=0.3, handler_timeout=0.2)
    body = b'{"item": "book",  "qty": 2}'
    seen: List[Any] = []

    def finish_order(job: Job) -> Dict[str, Any]:
        seen.append((job.request, job.attempt))
        return {"status": 201, "headers": {"location": "/orders/7"},
                "body": {"order": 7, "qty": job.request["body"]["qty"]}}

    try:
        with Server(with_pool_lifespan(middleware, pool)) as server:
            r = post(server, key, body)
            assert r.status_code == 504, r.text
            kept = row_of(db, key, scope)
            assert kept is not None and kept["request"] == {
                "method": "POST", "path": "/orders", "body": {"item": "book", "qty": 2}}
            # abandoned once its lease (no longer renewed after the 504) has ended
            lease_ended(db, key, scope)
            with sync_completer(quiet_pool, scope=scope, kind="http", handler=finish_order):
                sweep(db)
                done = finished(db, key, scope)
            assert done["response_code"] == 201
            assert seen == [(kept["request"], 2)]
            retry = post(server, key, body)
            assert retry.status_code == 201
            assert retry.headers["idempotent-replayed"] == "true"
            assert retry.headers["location"] == "/orders/7"
            assert retry.headers["content-type"].startswith("application/json")
            assert retry.json() == {"order": 7, "qty": 2}
            # other whitespace and key order: the same request under keep_request
            assert post(server, key, b'{"qty":2,"item":"book"}').status_code == 201
            app.release.set()
    finally:
        app.release.set()
    assert app.runs == 1


def test_an_http_request_the_server_will_not_keep_gets_413(db: Any, key: str) -> None:
    app = Stalling()
    app.release.set()
    pool = AsyncConnectionPool("options='-c idempotency.max_response_size=1kB'", min_size=1,
                               max_size=2, open=False)
    middleware = IdempotencyMiddleware(app, pool=pool, keep_request=True)
    with Server(with_pool_lifespan(middleware, pool)) as server:
        r = post(server, key, json.dumps({"note": "x" * 4000}).encode())
        assert r.status_code == 413, r.text
        assert r.json()["type"].endswith("idempotency-request-too-large")
    assert app.runs == 0
    assert row_of(db, key, "") is None


# ---- extension versions before 1.8 ------------------------------------------------


def test_on_1_7_keep_request_and_completers_name_the_version_they_need(db: Any,
                                                                       key: str) -> None:
    with database_with_extension(db, "idem_py_v17_", "1.7") as name:
        def needs(what: str) -> str:
            return (f"pg-idempotency {pg_idempotency.__version__} ({what}) needs the idempotency "
                    f"extension 1.8 or later; database \"{name}\" has 1.7: run ALTER EXTENSION "
                    "idempotency UPDATE.")
        with ConnectionPool(f"dbname={name}", min_size=1, max_size=2,
                            kwargs={"autocommit": True}) as old:
            with idempotent(old, key) as job:
                job.set_result("old")
            with pytest.raises(MisconfiguredError) as caught:
                with idempotent(old, key + "-k", keep_request=True):
                    pytest.fail("no keep_request before 1.8")
            assert str(caught.value) == needs("keep_request")
            with pytest.raises(MisconfiguredError) as caught:
                completer(old, handler=lambda job: None).start()
            assert str(caught.value) == needs("completer")
        app = Stalling()
        app.release.set()
        pool = AsyncConnectionPool(f"dbname={name}", min_size=1, max_size=2, open=False)
        with Server(with_pool_lifespan(IdempotencyMiddleware(app, pool=pool, keep_request=True),
                                       pool)) as server:
            r = post(server, key + "-h", b"{}")
            assert r.status_code == 500, r.text
            assert r.json()["detail"] == needs("keep_request")
        assert app.runs == 0


def test_bad_options_are_refused_when_the_completer_is_made(quiet_pool: ConnectionPool) -> None:
    with pytest.raises(ValueError, match="concurrency must be a whole number from 1 to 10000"):
        completer(quiet_pool, handler=lambda job: None, concurrency=0)
    with pytest.raises(ValueError, match="kind must be 'job' or 'http'"):
        completer(quiet_pool, handler=lambda job: None, kind="grpc")  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="needs handler"):
        completer(quiet_pool, handler=None)  # type: ignore[call-overload]
    with pytest.raises(TypeError, match="ConnectionPool or AsyncConnectionPool"):
        completer(object(), handler=lambda job: None)  # type: ignore[call-overload]
