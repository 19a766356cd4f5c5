"""idempotent() and idempotent_job() with async connections and pools."""

from __future__ import annotations

import asyncio
from typing import Any, List

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from conftest import stored, take_over, wait_for_extension, wait_past_lease
from pg_idempotency import (AsyncIdempotent, InProgressError, KeyLostError, MismatchError,
                            StoredFailureError, current_job, idempotent, idempotent_job)


class Transient(Exception):
    pass


class Invalid(Exception):
    pass


async def test_claim_and_replay(apool: AsyncConnectionPool, db: Any, key: str) -> None:
    cm = idempotent(apool, key, request={"amount": 5}, scope="ledger")
    assert isinstance(cm, AsyncIdempotent)
    async with cm as job:
        assert not job.replayed and job.attempt == 1
        assert current_job() is job
        job.set_result({"entry": 7})
    assert stored(db, key, "ledger") == ("succeeded", 1, None, {"v": 1, "json": {"entry": 7}})
    async with idempotent(apool, key, request={"amount": 5}, scope="ledger") as job:
        assert job.replayed and job.value == {"entry": 7}
    with pytest.raises(MismatchError):
        async with idempotent(apool, key, request={"amount": 6}, scope="ledger"):
            pytest.fail("a different payload must not run")


async def test_retryable_releases_other_errors_store_failed(apool: AsyncConnectionPool, db: Any,
                                                            key: str) -> None:
    with pytest.raises(Transient):
        async with idempotent(apool, key, retryable=(Transient,)):
            raise Transient("later")
    assert stored(db, key) is None
    with pytest.raises(Invalid):
        async with idempotent(apool, key, retryable=(Transient,)):
            raise Invalid("never")
    assert stored(db, key) == ("failed", 1, None,
                               {"v": 1, "error": {"name": "Invalid", "message": "never"}})
    with pytest.raises(StoredFailureError) as caught:
        async with idempotent(apool, key):
            pytest.fail("a stored failure must not run again")
    assert (caught.value.name, caught.value.error_message) == ("Invalid", "never")


async def test_in_progress(apool: AsyncConnectionPool, key: str) -> None:
    async with idempotent(apool, key, lease=60):
        with pytest.raises(InProgressError) as caught:
            async with idempotent(apool, key):
                pytest.fail("not while another attempt holds the key")
        assert 1 <= caught.value.retry_after <= 60


@pytest.mark.parametrize("kind", ["pool", "connection"])
async def test_heartbeat_task_keeps_a_slow_block_alive(kind: str, apool: AsyncConnectionPool,
                                                       db: Any, key: str) -> None:
    conn = await psycopg.AsyncConnection.connect(autocommit=True)
    target: Any = apool if kind == "pool" else conn
    try:
        async with idempotent(target, key, lease=2.4) as job:
            if kind == "connection":
                # the heartbeat commits on a connection of its own meanwhile
                await conn.execute("BEGIN")
                await asyncio.to_thread(wait_for_extension, db, key)
                await conn.execute("ROLLBACK")
            # the event loop stays free for the heartbeat task while we wait
            await asyncio.to_thread(wait_past_lease, db, key)
            with pytest.raises(InProgressError):
                async with idempotent(apool, key):
                    pytest.fail("the heartbeat keeps the key; no takeover")
            job.set_result("alive")
    finally:
        await conn.close()
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "alive"})


async def test_lost_key(apool: AsyncConnectionPool, db: Any, key: str) -> None:
    with pytest.raises(KeyLostError):
        async with idempotent(apool, key, lease=60) as job:
            take_over(db, key, None)
            job.set_result("mine")
    assert stored(db, key)[:2] == ("pending", 1)  # type: ignore[index]


async def test_decorator(apool: AsyncConnectionPool, db: Any, key: str) -> None:
    calls: List[int] = []

    @idempotent_job(apool, key=lambda order_id, amount: f"{key}-{order_id}",
                    request=lambda order_id, amount: {"amount": amount})
    async def charge(order_id: int, amount: int) -> str:
        calls.append(order_id)
        return f"charged {amount}"

    assert await charge(1, 100) == "charged 100"
    assert await charge(1, 100) == "charged 100"
    assert calls == [1]
    # the scope defaults to the function's qualified name
    assert charge.__qualname__ == "test_decorator.<locals>.charge"
    assert stored(db, f"{key}-1", "test_jobs_async.test_decorator.<locals>.charge") == (
        "succeeded", 1, None, {"v": 1, "json": "charged 100"})
    assert stored(db, f"{key}-1") is None


async def test_transaction_mode(db: Any, key: str) -> None:
    db.execute("CREATE TABLE IF NOT EXISTS ledger_py (key text, amount int)")
    async with await psycopg.AsyncConnection.connect(autocommit=True) as conn:
        async with conn.transaction():
            async with idempotent(conn, key) as job:
                await conn.execute("INSERT INTO ledger_py VALUES (%s, 3)", (key,))
                job.set_result("booked")
        key2 = key + "-2"
        async with conn.transaction():
            with pytest.raises(Transient):
                async with idempotent(conn, key2):
                    await conn.execute("INSERT INTO ledger_py VALUES (%s, 4)", (key2,))
                    raise Transient("later")
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "booked"})
    assert stored(db, key2) is None
    assert db.execute("SELECT array_agg(key) FROM ledger_py WHERE key IN (%s, %s)",
                      (key, key2)).fetchone()[0] == [key]
