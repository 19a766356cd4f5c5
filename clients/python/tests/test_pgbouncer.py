"""Through PgBouncer in transaction pooling mode (IDEM_PGBOUNCER_PORT on PGHOST),
with fewer server connections than clients: claim, heartbeat and finish each
take whatever server connection is free. A trigger on idempotency.keys records
which server process (pg_backend_pid) wrote each change of a key, so the tests
can show that the claim and the finish ran on different server connections.
A completer works through the pooler while its LISTEN connection reaches the
server directly."""

from __future__ import annotations

import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import httpx
import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from conftest import Server, requires_bouncer, stored, wait_for
from httpapp import calls, gate, make_app
from pg_idempotency import completer, idempotent

pytestmark = requires_bouncer

BOUNCER = f"port={os.environ.get('IDEM_PGBOUNCER_PORT', '')}"
# no server-side prepared statements across transactions of a pooled session
BOUNCER_KWARGS = {"autocommit": True, "prepare_threshold": None}


@pytest.fixture(scope="module", autouse=True)
def key_writes() -> Iterator[None]:
    with psycopg.connect(autocommit=True) as conn:
        conn.execute("""
            CREATE TABLE IF NOT EXISTS public.key_writes (
                id bigserial PRIMARY KEY, key text, op text, status text, attempt int,
                lease_until timestamptz, pid int DEFAULT pg_backend_pid());
            CREATE OR REPLACE FUNCTION public.record_key_write() RETURNS trigger
            LANGUAGE plpgsql SET search_path = pg_catalog AS $$
            BEGIN
                INSERT INTO public.key_writes (key, op, status, attempt, lease_until)
                VALUES (NEW.key, TG_OP, NEW.status, NEW.attempt, NEW.lease_until);
                RETURN NULL;
            END $$;
            DROP TRIGGER IF EXISTS record_key_write ON idempotency.keys;
            CREATE TRIGGER record_key_write AFTER INSERT OR UPDATE ON idempotency.keys
                FOR EACH ROW EXECUTE FUNCTION public.record_key_write();""")
        try:
            yield
        finally:
            conn.execute("DROP TRIGGER record_key_write ON idempotency.keys")


def writes(db: Any, key: str) -> List[Tuple[str, str, int]]:
    """(op, status, pid) of every write of the key, in order."""
    return [tuple(r) for r in db.execute(  # type: ignore[misc]
        "SELECT op, status, pid FROM public.key_writes WHERE key = %s ORDER BY id", (key,))]


def claim_pid(db: Any, key: str) -> int:
    rows = writes(db, key)
    assert rows and rows[0][0] == "INSERT", rows
    return rows[0][2]


class Holder:
    """Holds one given server connection in an open client transaction, so
    that the pooler must run everything else on another one."""

    def __init__(self, pid: int) -> None:
        self.conn: Optional[psycopg.Connection[Any]] = None
        spare: List[psycopg.Connection[Any]] = []
        for _ in range(8):
            c = psycopg.connect(BOUNCER, prepare_threshold=None)   # not autocommit: BEGIN
            got = c.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            if got == pid:
                self.conn = c
                break
            spare.append(c)
            if len(spare) > 1:          # free the others so the held one comes round
                spare.pop(0).close()
        for c in spare:
            c.close()
        assert self.conn is not None, f"no client got server connection {pid}"

    def close(self) -> None:
        assert self.conn is not None
        self.conn.close()


def wait_for_heartbeat(db: Any, key: str) -> List[Tuple[str, str, int]]:
    return wait_for(lambda: [w for w in writes(db, key)[1:] if w[1] == "pending"],
                    what="a heartbeat through the pooler")  # type: ignore[no-any-return]


def test_job_through_pgbouncer(db: Any, key: str) -> None:
    with ConnectionPool(BOUNCER, min_size=4, max_size=4, kwargs=BOUNCER_KWARGS) as pool:
        with idempotent(pool, key, request={"via": "pgbouncer"}, lease=1.5) as job:
            claimed_on = claim_pid(db, key)
            holder = Holder(claimed_on)
            try:
                beats = wait_for_heartbeat(db, key)
                job.set_result("done")
            finally:
                holder.close()
        with idempotent(pool, key, request={"via": "pgbouncer"}) as again:
            assert again.replayed and again.value == "done"
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "done"})
    finished = [w for w in writes(db, key) if w[1] == "succeeded"]
    assert len(finished) == 1
    assert finished[0][2] != claimed_on, "claim and finish on different server connections"
    assert all(pid != claimed_on for _, _, pid in beats)
    assert finished[0][2] != claimed_on, "claim and finish on different server connections"
    assert all(pid != claimed_on for _, _, pid in beats)


async def test_async_job_through_pgbouncer(db: Any, key: str) -> None:
    import asyncio
    async with AsyncConnectionPool(BOUNCER, min_size=4, max_size=4,
                                   kwargs=BOUNCER_KWARGS) as pool:
        async with idempotent(pool, key, lease=1.5) as job:
            claimed_on = claim_pid(db, key)
            holder = await asyncio.to_thread(Holder, claimed_on)
            try:
                await asyncio.to_thread(wait_for_heartbeat, db, key)
                job.set_result("async done")
            finally:
                holder.close()
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "async done"})
    finished = [w for w in writes(db, key) if w[1] == "succeeded"]
    assert len(finished) == 1 and finished[0][2] != claimed_on


def test_http_through_pgbouncer(db: Any, key: str) -> None:
    pool = AsyncConnectionPool(BOUNCER, min_size=4, max_size=4, kwargs=BOUNCER_KWARGS,
                               open=False)
    app = make_app(pool, lease=1.5)
    g = gate(app, key)
    with Server(app) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        first: List[httpx.Response] = []
        t = threading.Thread(target=lambda: first.append(
            c.post(f"/slow/{key}", headers={"Idempotency-Key": key})))
        t.start()
        holder = None
        try:
            assert g.entered.wait(30)
            claimed_on = claim_pid(db, key)
            holder = Holder(claimed_on)
            beats = wait_for_heartbeat(db, key)
        finally:
            g.release.set()
            t.join(30)              # the finish runs while the claim's connection is held
            if holder is not None:
                holder.close()
        assert first[0].status_code == 201
        r = c.post(f"/slow/{key}", headers={"Idempotency-Key": key})
        assert r.status_code == 201 and r.headers["idempotent-replayed"] == "true"
    assert stored(db, key)[:3] == ("succeeded", 1, 201)  # type: ignore[index]
    finished = [w for w in writes(db, key) if w[1] == "succeeded"]
    assert len(finished) == 1
    assert finished[0][2] != claimed_on, "claim and finish on different server connections"
    assert all(pid != claimed_on for _, _, pid in beats)



def test_http_wait_through_pgbouncer(db: Any, key: str) -> None:
    """A duplicate with wait holds a server connection of the pooler while it
    waits, and gets the first request's answer once that is stored."""
    pool = AsyncConnectionPool(BOUNCER, min_size=4, max_size=4, kwargs=BOUNCER_KWARGS,
                               open=False)
    app = make_app(pool, wait=30)
    g = gate(app, key)
    with Server(app) as s:
        answers: Dict[str, httpx.Response] = {}

        def post(name: str) -> None:
            with httpx.Client(base_url=s.url, timeout=60) as own:
                answers[name] = own.post(f"/slow/{key}", headers={"Idempotency-Key": key})

        first = threading.Thread(target=post, args=("first",))
        duplicate = threading.Thread(target=post, args=("duplicate",))
        try:
            first.start()
            assert g.entered.wait(30)
            duplicate.start()
            wait_for(lambda: db.execute(
                "SELECT EXISTS (SELECT FROM pg_catalog.pg_stat_activity"
                " WHERE state = 'active' AND wait_event_type IN ('Extension', 'Lock', 'Timeout')"
                "   AND query LIKE '%%idem_claim%%')").fetchone()[0],
                what="the duplicate's claim waiting")
        finally:
            g.release.set()
            first.join(60)
            duplicate.join(60)
    assert answers["first"].status_code == 201
    assert answers["duplicate"].status_code == 201
    assert answers["duplicate"].headers["idempotent-replayed"] == "true"
    assert answers["duplicate"].content == answers["first"].content
    assert calls(app).get(f"slow/{key}") == 1
    assert stored(db, key)[:3] == ("succeeded", 1, 201)  # type: ignore[index]


def test_many_clients_share_two_server_connections(db: Any, key: str) -> None:
    """Eight threads, each a client connection of the pool, run jobs at once
    through a pooler with fewer server connections: every statement may land
    on any of them, so nothing may rely on per-connection state."""
    errors: List[BaseException] = []
    with ConnectionPool(BOUNCER, min_size=8, max_size=8, kwargs=BOUNCER_KWARGS) as pool:
        def worker(w: int) -> None:
            try:
                for i in range(10):
                    k = f"{key}-{w}-{i}"
                    for _ in range(2):                      # the second run replays
                        with idempotent(pool, k, request={"w": w, "i": i}) as job:
                            if not job.replayed:
                                job.set_result([w, i])
                            else:
                                assert job.value == [w, i]
            except BaseException as e:   # reported below, with the thread's traceback
                errors.append(e)
        threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    assert db.execute("SELECT count(*) FILTER (WHERE status = 'succeeded' AND attempt = 1), "
                      "count(*) FROM idempotency.keys WHERE key LIKE %s",
                      (key + "-%",)).fetchone() == (80, 80)
    pids = db.execute("SELECT count(DISTINCT pid) FROM public.key_writes WHERE key LIKE %s",
                      (key + "-%",)).fetchone()[0]
    assert pids >= 2, "the writes went through more than one server connection"


def test_session_bound_behind_the_pooler_binds_the_poolers_session(db: Any, key: str) -> None:
    """Behind a transaction pooler the server session belongs to the pooler
    and outlives the client: a session-bound job still runs and finishes, but
    a client that goes away frees nothing; the lease still does."""
    with ConnectionPool(BOUNCER, min_size=2, max_size=2, kwargs=BOUNCER_KWARGS) as pool:
        with idempotent(pool, key, session_bound=True) as job:
            assert db.execute("SELECT owner_session IS NOT NULL FROM idempotency.keys "
                              "WHERE key = %s", (key,)).fetchone()[0]
            job.checkpoint("through the pooler")
            job.set_result("bound to the pooler")
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "bound to the pooler"})

    key2 = key + "-gone"
    client = psycopg.connect(BOUNCER, **BOUNCER_KWARGS)
    token = client.execute("SELECT token FROM idempotency.idem_claim(%s, lease => '1 hour', "
                           "session_bound => true)", (key2,)).fetchone()[0]  # type: ignore
    client.close()
    # the server session that holds the binding lives on in the pooler
    assert db.execute("SELECT outcome FROM idempotency.idem_claim(%s)",
                      (key2,)).fetchone()[0] == "in_progress"  # type: ignore[index]
    db.execute("SELECT idempotency.idem_release(%s, %s)", (key2, token))


def test_a_completer_through_the_pooler_with_its_listen_connection_direct(db: Any,
                                                                          key: str) -> None:
    scope = "pgb-completer-" + key
    with ConnectionPool(BOUNCER, min_size=2, max_size=4, kwargs=BOUNCER_KWARGS) as pool:

        def handler(job: Any) -> Dict[str, Any]:
            before = len(writes(db, key))       # the takeover's write is in
            wait_for(lambda: len(writes(db, key)) > before, what="a heartbeat through the pooler")
            return {"attempt": job.attempt, "request": job.request, "phase": job.phase}

        # listen_conninfo "": the libpq environment, the server itself
        with completer(pool, scope=scope, handler=handler, lease=0.6, poll_interval=3600,
                       listen_conninfo="") as c:
            assert c.listening
            row = db.execute("SELECT token FROM idempotency.idem_claim(key => %s, "
                             "request => '{\"amount\": 7}', scope => %s, "
                             "lease => interval '50 milliseconds', keep_request => true)",
                             (key, scope)).fetchone()
            assert row is not None
            db.execute("SELECT idempotency.idem_checkpoint(%s, %s, 'charged', NULL, %s)",
                       (key, row[0], scope))
            # (or the key taken over already, after a sweep of the background worker)
            wait_for(lambda: db.execute(
                "SELECT lease_until <= clock_timestamp() OR attempt > 1 FROM idempotency.keys "
                "WHERE scope = %s AND key = %s", (scope, key)).fetchone() == (True,),
                what="the lease to end")
            db.execute("SELECT * FROM idempotency.idem_sweep()")
            wait_for(lambda: stored(db, key, scope) is not None
                     and stored(db, key, scope)[0] == "succeeded",  # type: ignore[index]
                     what="the completer to finish the key")
    assert stored(db, key, scope) == ("succeeded", 2, None, {"v": 1, "json": {
        "attempt": 2, "request": {"amount": 7}, "phase": "charged"}})
