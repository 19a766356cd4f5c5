"""idempotent() and idempotent_job() with sync connections and pools."""

from __future__ import annotations

import threading
from typing import Any, List

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from conftest import database_with_extension, stored, take_over, wait_for, wait_for_extension, wait_past_lease
from pg_idempotency import (InProgressError, KeyLostError, MismatchError, MisconfiguredError,
                            StoredFailureError, current_job, idempotent, idempotent_job)


class Transient(Exception):
    pass


class Invalid(Exception):
    pass


def test_claim_runs_the_block_and_stores_its_result(pool: ConnectionPool, db: Any,
                                                    key: str) -> None:
    with idempotent(pool, key, request={"amount": 5}, scope="ledger") as job:
        assert not job.replayed
        # the fencing token is a decimal string: the key's token in the table
        assert job.attempt == 1 and isinstance(job.token, str)
        assert job.token == str(db.execute(
            "SELECT token FROM idempotency.keys WHERE key = %s AND scope = 'ledger'",
            (key,)).fetchone()[0])
        assert current_job() is job
        job.set_result({"entry": 7, "note": "ok"})
    assert current_job() is None
    assert stored(db, key, "ledger") == (
        "succeeded", 1, None, {"v": 1, "json": {"entry": 7, "note": "ok"}})

    ran = []
    with idempotent(pool, key, request={"amount": 5}, scope="ledger") as job:
        if not job.replayed:
            ran.append(1)
        assert job.replayed and job.value == {"entry": 7, "note": "ok"}
        assert job.token is None
    assert ran == []
    assert stored(db, key, "ledger")[:2] == ("succeeded", 1)  # type: ignore[index]


def test_block_without_result_stores_null(pool: ConnectionPool, db: Any, key: str) -> None:
    with idempotent(pool, key):
        pass
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": None})
    with idempotent(pool, key) as job:
        assert job.replayed and job.value is None


def test_retryable_exception_releases_the_key(pool: ConnectionPool, db: Any, key: str) -> None:
    with pytest.raises(Transient):
        with idempotent(pool, key, request=[1]):
            raise Transient("downstream is down")
    assert stored(db, key) is None, "released: no trace of the key"
    with idempotent(pool, key, request=[2]) as job:      # any payload: a fresh first attempt
        assert not job.replayed and job.attempt == 1
        job.set_result("second")
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "second"})


def test_other_exceptions_are_stored_as_failed(pool: ConnectionPool, db: Any, key: str) -> None:
    with pytest.raises(Invalid):
        with idempotent(pool, key, retryable=(Transient,)):
            raise Invalid('"amount" must be positive')
    assert stored(db, key) == ("failed", 1, None, {
        "v": 1, "error": {"name": "Invalid", "message": '"amount" must be positive'}})
    with pytest.raises(StoredFailureError) as caught:
        with idempotent(pool, key, retryable=(Transient,)):
            pytest.fail("the block must not run for a stored failure")
    assert caught.value.name == "Invalid"
    assert caught.value.error_message == '"amount" must be positive'


def test_retryable_predicate(pool: ConnectionPool, db: Any, key: str) -> None:
    with pytest.raises(Invalid):
        with idempotent(pool, key, retryable=lambda e: "again" in str(e)):
            raise Invalid("try again")
    assert stored(db, key) is None


def test_fail_stores_a_failure_without_raising(pool: ConnectionPool, db: Any, key: str) -> None:
    with idempotent(pool, key) as job:
        job.fail(Invalid("no such account"))
    assert stored(db, key) == ("failed", 1, None, {
        "v": 1, "error": {"name": "Invalid", "message": "no such account"}})


def test_in_progress_and_mismatch(pool: ConnectionPool, db: Any, key: str) -> None:
    with idempotent(pool, key, request={"a": 1}, lease=60) as job:
        with pytest.raises(InProgressError) as caught:
            with idempotent(pool, key, request={"a": 1}):
                pytest.fail("not while another attempt holds the key")
        assert 1 <= caught.value.retry_after <= 60
        job.set_result(1)
    with pytest.raises(MismatchError):
        with idempotent(pool, key, request={"a": 2}):
            pytest.fail("a different payload must not run")
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": 1})


@pytest.mark.parametrize("raises", [False, True])
def test_hooks_hear_each_outcome(pool: ConnectionPool, db: Any, key: str, raises: bool,
                                 caplog: Any) -> None:
    """Every outcome reaches its hook with the key, scope and request; the
    block's own exception is not the store's error; a hook that raises is
    logged and changes nothing."""
    heard: List[Any] = []

    def hook(event: Any) -> None:
        heard.append(event)
        if raises:
            raise RuntimeError(f"the on_{event.kind} hook raises")
    hooks = {f"on_{n}": hook for n in ("claim", "replay", "conflict", "mismatch", "error")}
    with idempotent(pool, key, request={"amount": 5}, scope="h", **hooks) as job:
        job.set_result("booked")
    with idempotent(pool, key, request={"amount": 5}, scope="h", **hooks) as again:
        assert again.replayed and again.value == "booked"
    with pytest.raises(MismatchError):
        with idempotent(pool, key, request={"amount": 6}, scope="h", **hooks):
            pass
    with idempotent(pool, key + "-busy", scope="h", **hooks) as owner:
        with pytest.raises(InProgressError):
            with idempotent(pool, key + "-busy", scope="h", **hooks):
                pass
        owner.set_result("done")
    with pytest.raises(Transient):
        with idempotent(pool, key + "-own", scope="h", **hooks):
            raise Transient()
    assert [e.kind for e in heard] == ["claim", "replay", "mismatch", "claim", "conflict", "claim"]
    assert [e.key for e in heard] == [key, key, key, key + "-busy", key + "-busy", key + "-own"]
    assert all(e.scope == "h" for e in heard)
    assert heard[0].request == {"amount": 5} and heard[0].attempt == 1
    assert heard[0].token == job.token
    assert heard[1].status == "succeeded"
    assert heard[4].retry_after is not None and heard[4].retry_after >= 1
    failed = [r for r in caplog.records if "hook failed; the answer is unchanged" in r.getMessage()]
    assert len(failed) == (6 if raises else 0)


def test_on_error_hears_a_store_that_fails(db: Any, key: str) -> None:
    heard: List[Any] = []
    with ConnectionPool("dbname=idem_no_such_database_for_hooks", min_size=0, max_size=1,
                        timeout=1, open=True) as broken:
        with pytest.raises(Exception) as raised:
            with idempotent(broken, key, on_error=heard.append):
                pass
    assert len(heard) == 1 and heard[0].kind == "error" and heard[0].error is raised.value


def test_a_hook_that_is_not_callable_is_refused(pool: ConnectionPool, key: str) -> None:
    with pytest.raises(TypeError, match="on_claim must be callable"):
        idempotent(pool, key, on_claim="yes")  # type: ignore[arg-type]


def test_wait_for_the_attempt_in_flight(pool: ConnectionPool, db: Any, key: str) -> None:
    holder = db.execute("SELECT token FROM idempotency.idem_claim(%s, lease => '1 hour')",
                        (key,)).fetchone()[0]
    waiting = threading.Event()
    result: List[Any] = []

    def waiter() -> None:
        waiting.set()
        with idempotent(pool, key, wait=60) as job:
            result.append((job.replayed, job.value))

    t = threading.Thread(target=waiter)
    t.start()
    waiting.wait()
    db.execute("SELECT idempotency.idem_finish(%s, %s, response_body => %s)",
               (key, holder, psycopg.types.json.Jsonb({"v": 1, "json": "theirs"})))
    t.join(60)
    assert result == [(True, "theirs")]


@pytest.mark.parametrize("kind", ["pool", "connection"])
def test_heartbeat_keeps_a_slow_block_alive(kind: str, pool: ConnectionPool, db: Any,
                                            key: str) -> None:
    conn = psycopg.connect(autocommit=True)
    target: Any = pool if kind == "pool" else conn
    try:
        with idempotent(target, key, lease=2.4) as job:
            if kind == "connection":
                # a transaction of the block's own on the connection: the
                # heartbeat commits on a connection of its own meanwhile
                conn.execute("BEGIN")
                conn.execute("SELECT 1")
                wait_for_extension(db, key)
                conn.execute("ROLLBACK")
            wait_past_lease(db, key)
            with pytest.raises(InProgressError):
                with idempotent(pool, key):
                    pytest.fail("the heartbeat keeps the key; no takeover")
            assert not job.lost
            job.set_result("slow but alive")
    finally:
        conn.close()
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "slow but alive"})


def test_lost_key_is_reported_and_never_stored_twice(pool: ConnectionPool, db: Any,
                                                     key: str) -> None:
    with pytest.raises(KeyLostError) as caught:
        with idempotent(pool, key, request={"n": 1}, lease=60) as job:
            other = take_over(db, key, {"n": 1})
            job.set_result("mine")
    assert caught.value.sqlstate == "55006"
    assert stored(db, key)[:2] == ("pending", 1)  # type: ignore[index]
    db.execute("SELECT idempotency.idem_finish(%s, %s, response_body => %s)",
               (key, other, psycopg.types.json.Jsonb({"v": 1, "json": "theirs"})))
    with idempotent(pool, key, request={"n": 1}) as job:
        assert job.replayed and job.value == "theirs"


def test_heartbeat_notices_a_lost_key(pool: ConnectionPool, db: Any, key: str) -> None:
    with pytest.raises(KeyLostError):
        with idempotent(pool, key, lease=0.3) as job:
            take_over(db, key, None)
            wait_for(lambda: job.lost, what="the heartbeat to notice")
            with pytest.raises(KeyLostError):
                job.raise_if_lost()
    assert stored(db, key)[:2] == ("pending", 1)  # type: ignore[index]


def test_decorator(pool: ConnectionPool, db: Any, key: str) -> None:
    calls: List[Any] = []

    @idempotent_job(pool, key=lambda msg: msg["id"], request=lambda msg: msg["body"],
                    scope=lambda msg: msg["queue"])
    def handle(msg: dict) -> dict:
        job = current_job()
        assert job is not None
        calls.append((job.attempt, job.token))
        return {"booked": msg["body"]["amount"]}

    msg = {"id": key, "queue": "payments", "body": {"amount": 3}}
    assert handle(msg) == {"booked": 3}
    assert handle(msg) == {"booked": 3}
    assert len(calls) == 1 and calls[0][0] == 1
    assert stored(db, key, "payments") == ("succeeded", 1, None, {"v": 1, "json": {"booked": 3}})
    with pytest.raises(MismatchError):
        handle({"id": key, "queue": "payments", "body": {"amount": 4}})


def test_transaction_mode_commits_writes_with_the_result(db: Any, key: str) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS ledger_py (key text, amount int)")
    with psycopg.connect() as conn:          # not autocommit: psycopg opens the transaction
        with conn.transaction():
            with idempotent(conn, key, request={"amount": 9}) as job:
                conn.execute("INSERT INTO ledger_py VALUES (%s, 9)", (key,))
                job.set_result("booked")
            # nothing is visible to others before the commit
            assert db.execute("SELECT outcome FROM idempotency.idem_claim(%s, %s)",
                              (key, psycopg.types.json.Jsonb({"amount": 9}))
                              ).fetchone()[0] == "in_progress"
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "booked"})
    assert db.execute("SELECT count(*) FROM ledger_py WHERE key = %s", (key,)).fetchone()[0] == 1


def test_transaction_mode_exceptions(db: Any, key: str) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS ledger_py (key text, amount int)")
    with psycopg.connect(autocommit=True) as conn:
        # non-retryable: the block's writes roll back to the savepoint, the
        # failure commits with the caller's transaction
        with conn.transaction():
            with pytest.raises(Invalid):
                with idempotent(conn, key, retryable=(Transient,)):
                    conn.execute("INSERT INTO ledger_py VALUES (%s, 1)", (key,))
                    raise Invalid("bad")
        assert stored(db, key) == ("failed", 1, None, {
            "v": 1, "error": {"name": "Invalid", "message": "bad"}})
        # a database error in the block (the transaction is aborted) still settles
        key2 = key + "-2"
        with conn.transaction():
            with pytest.raises(psycopg.errors.DivisionByZero):
                with idempotent(conn, key2):
                    conn.execute("INSERT INTO ledger_py VALUES (%s, 2)", (key2,))
                    conn.execute("SELECT 1/0")
        assert stored(db, key2) is None, "released"
    assert db.execute("SELECT count(*) FROM ledger_py WHERE key IN (%s, %s)",
                      (key, key + "-2")).fetchone()[0] == 0


def test_explicit_finish_commits_with_the_callers_transaction(pool: ConnectionPool, db: Any,
                                                              key: str) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS ledger_py (key text, amount int)")
    with idempotent(pool, key, lease=60) as job:
        with pool.connection() as c, c.transaction():
            c.execute("INSERT INTO ledger_py VALUES (%s, 5)", (key,))
            job.finish({"entry": 1}, conn=c)
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": {"entry": 1}})
    assert db.execute("SELECT count(*) FROM ledger_py WHERE key = %s", (key,)).fetchone()[0] == 1

    # lost: the finish raises and the caller's writes roll back with it
    key2 = key + "-lost"
    with pytest.raises(KeyLostError):
        with idempotent(pool, key2, lease=60) as job:
            take_over(db, key2, None)
            with pool.connection() as c, c.transaction():
                c.execute("INSERT INTO ledger_py VALUES (%s, 5)", (key2,))
                job.finish({"entry": 2}, conn=c)
    assert db.execute("SELECT count(*) FROM ledger_py WHERE key = %s", (key2,)).fetchone()[0] == 0
    assert stored(db, key2)[:2] == ("pending", 1)  # type: ignore[index]



def test_replays_results_another_client_stored(pool: ConnectionPool, db: Any, key: str) -> None:
    """Rows written as the Node library writes them (and a bare body, as
    plain SQL may have written it) replay as the same value or failure."""
    def settle(k: str, body: str, status: str) -> None:
        token = db.execute("SELECT token FROM idempotency.idem_claim(key => %s, request => %s, "
                           "scope => 'jobs')", (k, psycopg.types.json.Jsonb({"n": 1}))
                           ).fetchone()[0]
        db.execute("SELECT idempotency.idem_finish(key => %s, token => %s, "
                   "response_body => %s::jsonb, scope => 'jobs', status => %s)",
                   (k, token, body, status))

    settle(key + "-ok", '{"v": 1, "json": {"sent": [1, "two"]}}', "succeeded")
    settle(key + "-err", '{"v": 1, "error": {"name": "TypeError", "message": "x is undefined"}}',
           "failed")
    settle(key + "-bare", '{"entry_id": 4}', "succeeded")
    settle(key + "-bare-err", '{"error": "\\"amount\\" must be positive"}', "failed")
    with idempotent(pool, key + "-ok", request={"n": 1}, scope="jobs") as job:
        assert job.replayed and job.value == {"sent": [1, "two"]}
    with idempotent(pool, key + "-bare", request={"n": 1}, scope="jobs") as job:
        assert job.replayed and job.value == {"entry_id": 4}
    with pytest.raises(StoredFailureError) as caught:
        with idempotent(pool, key + "-err", request={"n": 1}, scope="jobs"):
            pytest.fail("must not run")
    assert (caught.value.name, caught.value.error_message) == ("TypeError", "x is undefined")
    with pytest.raises(StoredFailureError) as caught:
        with idempotent(pool, key + "-bare-err", request={"n": 1}, scope="jobs"):
            pytest.fail("must not run")
    assert caught.value.error_message == '"amount" must be positive'


def test_a_database_without_the_extension_is_named_before_any_claim(db: Any, key: str) -> None:
    with database_with_extension(db, "idem_py_noext_jobs_", None) as name, \
            psycopg.connect(dbname=name, autocommit=True) as conn:
        with pytest.raises(MisconfiguredError, match=(
                f'^The idempotency extension is not installed in database "{name}": '
                "run CREATE EXTENSION idempotency.$")):
            with idempotent(conn, key):
                pytest.fail("the block must not run")
