"""Fixtures: a real PostgreSQL (libpq PG* environment), pools, a uvicorn server
on a real socket, and helpers that read the stored rows."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from typing import Any, Callable, Iterator, Optional

import psycopg
import pytest
import pytest_asyncio
import uvicorn
from psycopg_pool import AsyncConnectionPool, ConnectionPool

for var in ("PGHOST", "PGDATABASE"):
    if not os.environ.get(var):
        raise pytest.UsageError(f"set {var} (and PGPORT, PGUSER) to a database with the "
                                "idempotency extension; test.sh does it for you")


requires_bouncer = pytest.mark.skipif(
    not os.environ.get("IDEM_PGBOUNCER_PORT"),
    reason="IDEM_PGBOUNCER_PORT is not set: no PgBouncer (transaction pooling) to test through")


@pytest.fixture
def db() -> Iterator[psycopg.Connection[Any]]:
    """An autocommit connection for the test's own SQL."""
    with psycopg.connect(autocommit=True) as conn:
        yield conn


@pytest.fixture
def key() -> str:
    return "k-" + uuid.uuid4().hex


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    with ConnectionPool("", min_size=1, max_size=4, kwargs={"autocommit": True}) as p:
        yield p


@pytest_asyncio.fixture
async def apool() -> Any:
    async with AsyncConnectionPool("", min_size=1, max_size=4) as p:
        yield p


@contextlib.contextmanager
def database_with_extension(db: psycopg.Connection[Any], prefix: str,
                            version: Optional[str]) -> Iterator[str]:
    """A fresh database named ``prefix`` + random hex, with the extension at
    ``version`` (None: without the extension), dropped afterwards."""
    name = prefix + uuid.uuid4().hex[:8]
    db.execute(f"CREATE DATABASE {name}")
    try:
        if version is not None:
            with psycopg.connect(dbname=name, autocommit=True) as c:
                c.execute(f"CREATE EXTENSION idempotency VERSION '{version}'")
        yield name
    finally:
        db.execute(f"DROP DATABASE {name} WITH (FORCE)")


def stored(db: psycopg.Connection[Any], key: str, scope: str = "") -> Optional[tuple[Any, ...]]:
    """(status, attempt, response_code, response_body) of a key, None if absent."""
    return db.execute(
        "SELECT status, attempt, response_code, response_body FROM idempotency.keys "
        "WHERE key = %s AND scope = %s", (key, scope)).fetchone()


def age(db: psycopg.Connection[Any], key: str, scope: str = "") -> None:
    """Move a finished key past its retention, as if that time had passed:
    what a claim of it answers then (absent, or expired when the server
    remembers it), without waiting for the clock."""
    updated = db.execute(
        "UPDATE idempotency.keys SET expires_at = now() - interval '1 second',"
        "       sweep_at = now() - interval '1 second'"
        " WHERE scope = %s AND key = %s AND status <> 'pending'", (scope, key)).rowcount
    assert updated == 1, f"the finished key {key!r} to age"


def token_of(db: psycopg.Connection[Any], key: str, scope: str = "") -> int:
    row = db.execute("SELECT token FROM idempotency.keys WHERE key = %s AND scope = %s",
                     (key, scope)).fetchone()
    assert row is not None
    return int(row[0])


def take_over(db: psycopg.Connection[Any], key: str, request: Any, scope: str = "") -> int:
    """Make another attempt own the key: release the current token (as its
    lease running out and a takeover would) and claim it anew. Returns the new
    token."""
    db.execute("SELECT idempotency.idem_release(key => %s, token => %s, scope => %s)",
               (key, token_of(db, key, scope), scope))
    row = db.execute(
        "SELECT outcome, token FROM idempotency.idem_claim(key => %s, request => %s, "
        "scope => %s, lease => '1 hour')",
        (key, psycopg.types.json.Jsonb(request) if request is not None else None, scope)
    ).fetchone()
    assert row is not None and row[0] == "claimed", row
    return int(row[1])


def wait_for(condition: Callable[[], Any], timeout: float = 30.0, what: str = "") -> Any:
    """Wait until condition() is truthy (a condition the test controls, with
    a generous ceiling only against hangs)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        time.sleep(0.02)


def wait_past_lease(db: psycopg.Connection[Any], key: str, scope: str = "") -> None:
    """Wait until the database clock has passed the lease end the key had when
    this was called, so that without a heartbeat another claim would take over."""
    row = db.execute("SELECT lease_until FROM idempotency.keys WHERE key = %s AND scope = %s",
                     (key, scope)).fetchone()
    assert row is not None
    first_lease_end = row[0]
    wait_for(lambda: db.execute("SELECT clock_timestamp() > %s", (first_lease_end,)
                                ).fetchone()[0],  # type: ignore[index]
             what="the first lease to end")


def wait_for_extension(db: psycopg.Connection[Any], key: str, scope: str = "") -> None:
    """Wait until a heartbeat has committed a lease end later than the current one."""
    def lease_end() -> Any:
        return db.execute("SELECT lease_until FROM idempotency.keys WHERE key = %s "
                          "AND scope = %s", (key, scope)).fetchone()[0]  # type: ignore[index]
    first = lease_end()
    wait_for(lambda: lease_end() > first, what="a committed heartbeat")


class Server:
    """A uvicorn server in a thread, on a socket bound here (a free port)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, lifespan="on", log_level="warning", access_log=False)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self) -> "Server":
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), what="uvicorn")
        assert self.server.started, "uvicorn did not start"
        return self

    def connections(self) -> int:
        return len(self.server.server_state.connections)

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()


def with_pool_lifespan(app: Any, pool: AsyncConnectionPool, open_pool: bool = True) -> Any:
    """A raw ASGI app whose lifespan opens the pool (unless ``open_pool`` is
    False) at startup and closes it at shutdown, in the server's event loop."""
    async def wrapped(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if open_pool:
                    await pool.open()
                await send({"type": "lifespan.startup.complete"})
            else:
                await pool.close()
                await send({"type": "lifespan.shutdown.complete"})
                return
    return wrapped


@contextlib.contextmanager
def serve(app: Any) -> Iterator[Server]:
    with Server(app) as server:
        yield server

