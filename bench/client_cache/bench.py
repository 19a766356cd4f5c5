"""bench/client_cache/bench.py: the Python half of bench/client_cache/run.

One sequential client, three variants of a replay of a finished key,
interleaved over ROUNDS rounds (A B C, C B A, ...):
  cached    pg_idempotency's IdempotencyMiddleware with cache=N, answering from
            its in-process LRU
  database  the same middleware with the cache off: one idem_claim round trip
  redis     one GET (redis.asyncio, as an ASGI layer would use) of a value as
            large as the stored envelope
  redis_sync  the same GET with redis-py's blocking client, which an ASGI app
            cannot use without stalling its event loop but which has less
            overhead per call: reported next to the table, for orientation
The ASGI middleware is called in-process with an ASGI scope, receive and send,
no socket: see the header of ./run for why.  Prints one TSV line per measured
run:  python <variant> <round> <ops/s> <ops> <seconds>
and "#" lines with the settings.  Connection settings come from PG* and
REDIS_SOCKET; ROUNDS, DURATION, WARMUP and KEYS from the environment.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from typing import Any, Awaitable, Callable, Dict, MutableMapping

import psycopg
import psycopg_pool
import redis
import redis.asyncio as aioredis
from psycopg_pool import AsyncConnectionPool

from pg_idempotency import IdempotencyMiddleware

ROUNDS = int(os.environ.get("ROUNDS", "7"))
DURATION = float(os.environ.get("DURATION", "3"))
WARMUP = float(os.environ.get("WARMUP", "1"))
KEYS = int(os.environ.get("KEYS", "1000"))
REDIS_SOCKET = os.environ["REDIS_SOCKET"]

# the same request and response as bench.mjs
REQUEST_BODY = (b'{"amount":1250,"currency":"EUR","customer":"cus_8f2a61c0",'
                b'"reference":"inv-2024-0042"}')
RESPONSE_BODY = (b'{"id":"ord_5b7e0c9d2f","status":"created","amount":1250,"currency":"EUR",'
                 b'"customer":"cus_8f2a61c0","created":1732300000}')


class Failure(Exception):
    pass


async def handler(scope: Any, receive: Callable[[], Awaitable[Any]],
                  send: Callable[[Any], Awaitable[None]]) -> None:
    """The route: runs only for the first request of a key."""
    await receive()
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": RESPONSE_BODY})


async def receive() -> Dict[str, Any]:
    return {"type": "http.request", "body": REQUEST_BODY, "more_body": False}


def http_scope(key: str) -> Dict[str, Any]:
    return {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
        "method": "POST", "scheme": "http", "path": "/orders", "raw_path": b"/orders",
        "query_string": b"", "root_path": "",
        "headers": [(b"host", b"bench"), (b"content-type", b"application/json"),
                    (b"idempotency-key", key.encode())],
    }


class Answer:
    """The send() of one request: keeps the status, the replay flag and the body."""
    __slots__ = ("status", "replayed", "body")

    def __init__(self) -> None:
        self.status = 0
        self.replayed = False
        self.body = b""

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.replayed = (b"idempotent-replayed", b"true") in message["headers"]
        else:
            self.body += message.get("body", b"")


async def request(middleware: IdempotencyMiddleware, key: str) -> Answer:
    answer = Answer()
    await middleware(http_scope(key), receive, answer.send)
    return answer


async def main() -> None:
    pool = AsyncConnectionPool("", min_size=1, max_size=1, kwargs={"autocommit": True},
                               open=False)
    await pool.open(wait=True)
    cached = IdempotencyMiddleware(handler, pool=pool, cache=2 * KEYS)
    database = IdempotencyMiddleware(handler, pool=pool)
    r = aioredis.Redis(unix_socket_path=REDIS_SOCKET)
    r_sync = redis.Redis(unix_socket_path=REDIS_SOCKET)

    keys = [str(uuid.uuid4()) for _ in range(KEYS)]
    for key in keys:
        a = await request(database, key)
        if a.status != 201 or a.replayed:
            raise Failure(f"the first request of {key} was answered {a.status}")
    async with pool.connection() as conn:
        cur = await conn.execute(
            "SELECT response_body::text FROM idempotency.idem_lookup(key => %s)", (keys[0],))
        row = await cur.fetchone()
        assert row is not None
        value: str = row[0]
    run = uuid.uuid4().hex[:8]
    redis_keys = [f"idem:{run}:{k}" for k in keys]
    for k in redis_keys:
        await r.set(k, value)
    # fill the cache: the first replay of each key learns expires_at
    for key in keys:
        await request(cached, key)
    assert cached.cache is not None
    if len(cached.cache) != KEYS:
        raise Failure(f"the cache holds {len(cached.cache)} entries, expected {KEYS}")
    replay_length = len((await request(database, keys[0])).body)

    async def replay(middleware: IdempotencyMiddleware, key: str) -> None:
        a = Answer()
        await middleware(http_scope(key), receive, a.send)
        if a.status != 201 or not a.replayed or len(a.body) != replay_length:
            raise Failure(f"a replay of {key} was answered {a.status} with {len(a.body)} bytes")

    value_length = len(value.encode())

    async def redis_get(i: int) -> None:
        v = await r.get(redis_keys[i % KEYS])
        if v is None or len(v) != value_length:
            raise Failure("a Redis GET returned another value")

    async def redis_sync_get(i: int) -> None:
        v = r_sync.get(redis_keys[i % KEYS])
        if v is None or len(v) != value_length:
            raise Failure("a Redis GET returned another value")

    variants: Dict[str, Callable[[int], Awaitable[None]]] = {
        "cached": lambda i: replay(cached, keys[i % KEYS]),
        "database": lambda i: replay(database, keys[i % KEYS]),
        "redis": redis_get,
        "redis_sync": redis_sync_get,
    }

    async with pool.connection() as conn:
        cur = await conn.execute("SHOW server_version")
        server = (await cur.fetchone() or ("?",))[0]
    print(f"# python\tPython {sys.version.split()[0]} (asyncio), psycopg {psycopg.__version__}, "
          f"psycopg_pool {psycopg_pool.__version__}, redis-py {redis.__version__}, "
          f"PostgreSQL {server}")
    print(f"# python\tkeys {KEYS}, stored value {value_length} bytes, "
          f"replayed body {replay_length} bytes")

    counter = 0

    async def timed(fn: Callable[[int], Awaitable[None]], seconds: float) -> "tuple[int, float]":
        nonlocal counter
        clock = time.perf_counter
        start = now = clock()
        end = start + seconds
        ops = 0
        while now < end:
            await fn(counter)
            counter += 1
            ops += 1
            now = clock()
        return ops, now - start

    order = list(variants)
    for rnd in range(1, ROUNDS + 1):
        for name in (order if rnd % 2 else order[::-1]):
            await timed(variants[name], WARMUP)
            hits = cached.cache.hits
            ops, secs = await timed(variants[name], DURATION)
            # every cached replay must have been a cache hit, not a claim
            if name == "cached" and cached.cache.hits - hits != ops:
                raise Failure(f"{ops - (cached.cache.hits - hits)} cached replays missed the cache")
            print(f"python\t{name}\t{rnd}\t{ops / secs:.1f}\t{ops}\t{secs:.3f}", flush=True)

    await r.close()
    r_sync.close()
    await pool.close()


if __name__ == "__main__":
    asyncio.run(main())
