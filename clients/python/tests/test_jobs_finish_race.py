"""An explicit finish() while a heartbeat's extend is in flight: the finish
waits for the beat instead of meeting it on the key (55P03)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from conftest import stored
from pg_idempotency import idempotent
from pg_idempotency import jobs

HOLD = 1.5      # seconds the slow beat keeps the key's row locked: longer than all retries

EXTEND = ("SELECT idempotency.idem_extend(key => %s, token => %s, lease => '3 s')")
LOCK = "SELECT 1 FROM idempotency.keys WHERE key = %s AND scope = '' FOR UPDATE"


def test_finish_waits_for_the_beat_in_flight(pool: ConnectionPool, db: Any, key: str,
                                             monkeypatch: Any) -> None:
    in_flight = threading.Event()

    def slow_beat(self: Any) -> None:
        if in_flight.is_set():
            return
        # the extend holds the key's row for a while, as a slow server would
        with psycopg.connect() as conn:
            conn.execute(LOCK, (self.key,))
            in_flight.set()
            time.sleep(HOLD)
            conn.execute(EXTEND, (self.key, int(self._job.token)))

    monkeypatch.setattr(jobs.Idempotent, "_beat", slow_beat)
    with idempotent(pool, key, lease=3) as job:
        assert in_flight.wait(30)
        job.finish({"done": True})
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": {"done": True}})


async def test_async_finish_waits_for_the_beat_in_flight(apool: AsyncConnectionPool, db: Any,
                                                         key: str, monkeypatch: Any) -> None:
    in_flight = asyncio.Event()

    async def slow_beat(self: Any) -> None:
        if in_flight.is_set():
            return
        async with await psycopg.AsyncConnection.connect() as conn:
            await conn.execute(LOCK, (self.key,))
            in_flight.set()
            await asyncio.sleep(HOLD)
            await conn.execute(EXTEND, (self.key, int(self._job.token)))

    monkeypatch.setattr(jobs.AsyncIdempotent, "_beat", slow_beat)
    async with idempotent(apool, key, lease=3) as job:
        await asyncio.wait_for(in_flight.wait(), 30)
        await job.finish({"done": True})
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": {"done": True}})


def test_no_value_and_both_stored_forms(pool: ConnectionPool, db: Any, key: str) -> None:
    with idempotent(pool, key) as job:
        job.set_result(None)
    assert stored(db, key)[3] == {"v": 1, "json": None}  # type: ignore[index]
    for i, envelope in enumerate(['{"v": 1}', '{"v": 1, "json": null}',
                                  '{"v": 1, "base64": "AAH/"}']):
        k = f"{key}-{i}"
        token = db.execute("SELECT token FROM idempotency.idem_claim(key => %s)",
                           (k,)).fetchone()[0]
        db.execute("SELECT idempotency.idem_finish(%s, %s, NULL, %s::jsonb)", (k, token, envelope))
        with idempotent(pool, k) as job:
            assert job.replayed
            assert job.value == (b"\x00\x01\xff" if i == 2 else None)
