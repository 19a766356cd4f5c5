"""Recovery points (job.checkpoint, job.phase, job.phase_data) and
session-bound claims (session_bound=True), sync, async and decorated."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Iterator, List, Optional, Tuple

import psycopg
import pytest
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool, ConnectionPool

from conftest import database_with_extension, stored, wait_for, wait_past_lease
from pg_idempotency import (AsyncJob, Job, KeyLostError, MisconfiguredError, current_job,
                            idempotent, idempotent_job)


class Rollback(Exception):
    """Raised to roll a step's transaction back."""


@pytest.fixture(scope="module", autouse=True)
def steps_table() -> None:
    with psycopg.connect(autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS public.steps_py (key text, step text)")


def checkpoint_of(db: Any, key: str, scope: str = "") -> Optional[Tuple[Any, ...]]:
    """(phase, phase_data) as stored, None if the key is absent."""
    return db.execute("SELECT phase, phase_data FROM idempotency.keys "
                      "WHERE key = %s AND scope = %s", (key, scope)).fetchone()


def steps(db: Any, key: str) -> List[str]:
    return [r[0] for r in db.execute(
        "SELECT step FROM public.steps_py WHERE key = %s ORDER BY step", (key,))]


def end_lease(db: Any, key: str, scope: str = "") -> None:
    """End the current attempt's lease now, as if it had died without a
    heartbeat: the next claim takes the key over."""
    db.execute("UPDATE idempotency.keys SET lease_until = clock_timestamp() - interval '1 s' "
               "WHERE key = %s AND scope = %s", (key, scope))


def claim_sql(db: Any, key: str, scope: str = "") -> Tuple[Any, ...]:
    """(outcome, attempt, token, phase, phase_data) of a plain SQL claim."""
    row = db.execute("SELECT outcome, attempt, token, phase, phase_data FROM "
                     "idempotency.idem_claim(key => %s, scope => %s, lease => '1 hour')",
                     (key, scope)).fetchone()
    assert row is not None
    return tuple(row)


# ---- recovery points ------------------------------------------------------------------


def test_checkpoint_is_stored_and_handed_to_the_takeover(pool: ConnectionPool, db: Any,
                                                         key: str) -> None:
    with pytest.raises(KeyLostError):
        with idempotent(pool, key, request={"order": 1}, scope="shop", lease=60) as first:
            assert (first.attempt, first.phase, first.phase_data) == (1, None, None)
            first.checkpoint("reserved")
            assert checkpoint_of(db, key, "shop") == ("reserved", None)
            first.checkpoint("charge_created", {"charge": "ch_1", "amount": 1250})
            # committed at once (external-call mode), the later one replacing the first
            assert checkpoint_of(db, key, "shop") == (
                "charge_created", {"charge": "ch_1", "amount": 1250})
            assert (first.phase, first.phase_data) == (None, None), "the claim's, unchanged"

            end_lease(db, key, "shop")                # the first attempt "dies" here
            with idempotent(pool, key, request={"order": 1}, scope="shop") as second:
                assert not second.replayed
                assert second.attempt == 2 and int(second.token) > int(first.token)  # type: ignore
                assert second.phase == "charge_created"
                assert second.phase_data == {"charge": "ch_1", "amount": 1250}
                second.set_result({"shipped": second.phase_data["charge"]})
    # the first attempt's exit found the key finished by the second
    assert stored(db, key, "shop") == ("succeeded", 2, None,
                                       {"v": 1, "json": {"shipped": "ch_1"}})
    assert db.execute("SELECT phase FROM idempotency.idem_lookup(%s, 'shop')",
                      (key,)).fetchone()[0] == "charge_created", "finish keeps the phase"
    with idempotent(pool, key, request={"order": 1}, scope="shop") as again:
        assert again.replayed and (again.phase, again.phase_data) == (None, None)


async def test_async_checkpoint_and_takeover(apool: AsyncConnectionPool, db: Any,
                                             key: str) -> None:
    with pytest.raises(KeyLostError):
        async with idempotent(apool, key, lease=60) as first:
            assert (first.attempt, first.phase) == (1, None)
            await first.checkpoint("step_1", [1, "two", None])
            assert checkpoint_of(db, key) == ("step_1", [1, "two", None])
            end_lease(db, key)
            async with idempotent(apool, key) as second:
                assert (second.attempt, second.phase, second.phase_data) == (
                    2, "step_1", [1, "two", None])
                second.set_result("done")
    assert stored(db, key) == ("succeeded", 2, None, {"v": 1, "json": "done"})


def test_decorated_functions_checkpoint_through_current_job(pool: ConnectionPool, db: Any,
                                                            key: str) -> None:
    seen: List[Tuple[Any, ...]] = []

    @idempotent_job(pool, key=lambda order: order, lease=60, scope="")
    def ship(order: str) -> str:
        job = current_job()
        assert isinstance(job, Job)
        seen.append((job.attempt, job.phase, job.phase_data))
        if job.phase is None:
            job.checkpoint("charge_created", {"charge": "ch_9"})
            end_lease(db, order)                 # dies after the charge ...
            return ship(order)                   # ... and a successor takes over
        return f"shipped {job.phase_data['charge']}"

    with pytest.raises(KeyLostError):
        ship(key)
    assert seen == [(1, None, None), (2, "charge_created", {"charge": "ch_9"})]
    assert stored(db, key) == ("succeeded", 2, None, {"v": 1, "json": "shipped ch_9"})


async def test_async_decorated_function_checkpoints(apool: AsyncConnectionPool, db: Any,
                                                    key: str) -> None:
    @idempotent_job(apool, key=lambda order: order, scope="")
    async def charge(order: str) -> str:
        job = current_job()
        assert isinstance(job, AsyncJob) and job.phase is None
        await job.checkpoint("charged", {"n": 1})
        return "ok"

    assert await charge(key) == "ok"
    assert checkpoint_of(db, key) == ("charged", {"n": 1})


def test_checkpoint_commits_with_the_step_on_conn(pool: ConnectionPool, db: Any,
                                                  key: str) -> None:
    with idempotent(pool, key, lease=60) as job:
        with pool.connection() as c:
            # the step's transaction fails: neither its row nor its checkpoint stays
            with pytest.raises(Rollback):
                with c.transaction():
                    c.execute("INSERT INTO public.steps_py VALUES (%s, 'charge')", (key,))
                    job.checkpoint("charge_created", {"charge": "ch_2"}, conn=c)
                    # not visible outside the transaction until it commits
                    assert checkpoint_of(db, key) == (None, None)
                    raise Rollback()
            assert checkpoint_of(db, key) == (None, None)
            assert steps(db, key) == []
            with c.transaction():
                c.execute("INSERT INTO public.steps_py VALUES (%s, 'charge')", (key,))
                job.checkpoint("charge_created", {"charge": "ch_3"}, conn=c)
        assert checkpoint_of(db, key) == ("charge_created", {"charge": "ch_3"})
        assert steps(db, key) == ["charge"]
        job.set_result("shipped")
    assert stored(db, key)[:2] == ("succeeded", 1)  # type: ignore[index]


def extends_waiting(db: Any) -> int:
    """How many idem_extend calls wait for a lock right now."""
    return int(db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
        "AND query LIKE '%idem_extend%' AND pid <> pg_backend_pid()").fetchone()[0])


def test_checkpoint_and_finish_in_one_transaction_with_a_heartbeat(pool: ConnectionPool,
                                                                   db: Any, key: str) -> None:
    """While a checkpoint waits in the caller's transaction, the heartbeat does
    not beat (an extend would wait for that transaction, and a finish in it
    for the extend): the finish in the same transaction completes."""
    with idempotent(pool, key, lease=0.3) as job:
        with pool.connection() as c:
            with c.transaction():
                c.execute("INSERT INTO public.steps_py VALUES (%s, 'last')", (key,))
                job.checkpoint("last_step", {"n": 1}, conn=c)
                wait_past_lease(db, key)          # beats were due meanwhile
                assert extends_waiting(db) == 0
                # other claims stay off the key: the checkpoint is in flight
                assert claim_sql(db, key)[0] == "in_progress"
                finished = threading.Thread(target=job.finish, args=("done",),
                                            kwargs={"conn": c})
                finished.start()
                finished.join(30)
                assert not finished.is_alive(), "the finish waits for a heartbeat"
        assert not job.lost
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "done"})
    assert checkpoint_of(db, key) == ("last_step", {"n": 1})
    assert steps(db, key) == ["last"]


async def test_async_checkpoint_and_finish_in_one_transaction(apool: AsyncConnectionPool,
                                                              db: Any, key: str) -> None:
    async with idempotent(apool, key, lease=0.3) as job:
        async with apool.connection() as c:
            async with c.transaction():
                await job.checkpoint("last_step", conn=c)
                await asyncio.to_thread(wait_past_lease, db, key)
                assert extends_waiting(db) == 0
                await asyncio.wait_for(job.finish("done", conn=c), 30)
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "done"})
    assert checkpoint_of(db, key) == ("last_step", None)


def test_checkpoint_in_transaction_mode_rolls_back_with_the_step(db: Any, key: str) -> None:
    with psycopg.connect(autocommit=True) as conn:
        with conn.transaction():
            with idempotent(conn, key) as job:
                # a step in a savepoint of the caller's transaction, rolled back:
                # its checkpoint goes with it
                with pytest.raises(Rollback):
                    with conn.transaction():
                        conn.execute("INSERT INTO public.steps_py VALUES (%s, 'a')", (key,))
                        job.checkpoint("a_done", {"a": 1})
                        assert checkpoint_of(conn, key) == ("a_done", {"a": 1})
                        raise Rollback()
                assert checkpoint_of(conn, key) == (None, None)
                # the checkpoint runs on the transaction's connection: nothing
                # is visible to others before the commit
                conn.execute("INSERT INTO public.steps_py VALUES (%s, 'b')", (key,))
                job.checkpoint("b_done", {"b": 2})
                assert checkpoint_of(conn, key) == ("b_done", {"b": 2})
                assert checkpoint_of(db, key) is None
                job.set_result("ok")
        assert checkpoint_of(db, key) == ("b_done", {"b": 2})
        assert steps(db, key) == ["b"]

        # the whole transaction rolled back: no key, no step, no checkpoint
        key2 = key + "-2"
        with pytest.raises(Rollback):
            with conn.transaction():
                with idempotent(conn, key2) as job:
                    conn.execute("INSERT INTO public.steps_py VALUES (%s, 'a')", (key2,))
                    job.checkpoint("a_done")
                    job.set_result("ok")
                raise Rollback()
    assert checkpoint_of(db, key2) is None
    assert steps(db, key2) == []


async def test_async_checkpoint_in_transaction_mode(db: Any, key: str) -> None:
    async with await psycopg.AsyncConnection.connect(autocommit=True) as conn:
        async with conn.transaction():
            async with idempotent(conn, key) as job:
                with pytest.raises(Rollback):
                    async with conn.transaction():
                        await conn.execute("INSERT INTO public.steps_py VALUES (%s, 'a')",
                                           (key,))
                        await job.checkpoint("a_done")
                        raise Rollback()
                await job.checkpoint("b_done", {"b": True})
                job.set_result(1)
    assert checkpoint_of(db, key) == ("b_done", {"b": True})
    assert steps(db, key) == []


@pytest.mark.parametrize("then,sqlstate", [(None, "55006"), ("finish", "55000"),
                                           ("release", "P0002")])
def test_checkpoint_with_a_stale_token_raises_key_lost(then: Optional[str], sqlstate: str,
                                                       pool: ConnectionPool, db: Any,
                                                       key: str) -> None:
    with pytest.raises(KeyLostError) as caught:
        with idempotent(pool, key, lease=60) as job:
            job.checkpoint("mine", {"n": 1})
            end_lease(db, key)
            _, attempt, token, phase, _ = claim_sql(db, key)
            assert (attempt, phase) == (2, "mine")
            if then == "finish":
                db.execute("SELECT idempotency.idem_finish(%s, %s)", (key, token))
            elif then == "release":
                db.execute("SELECT idempotency.idem_release(%s, %s)", (key, token))
            before = db.execute("SELECT count(*), md5(string_agg(k::text, ',')) "
                                "FROM idempotency.keys k WHERE key = %s", (key,)).fetchone()
            with pytest.raises(KeyLostError) as inner:
                job.checkpoint("too_late", {"n": 2})
            assert inner.value.sqlstate == sqlstate
            assert job.lost
            assert db.execute("SELECT count(*), md5(string_agg(k::text, ',')) "
                              "FROM idempotency.keys k WHERE key = %s", (key,)
                              ).fetchone() == before, "the new owner's row is untouched"
            raise inner.value
    assert caught.value.sqlstate == sqlstate


def test_checkpoint_misuse(pool: ConnectionPool, db: Any, key: str) -> None:
    with idempotent(pool, key) as job:
        with pytest.raises(TypeError):
            job.checkpoint(None)  # type: ignore[arg-type]
        before = checkpoint_of(db, key)
        with pytest.raises(psycopg.errors.InvalidParameterValue):      # 22023
            job.checkpoint("")
        with pytest.raises(psycopg.errors.StringDataRightTruncation):  # 22001
            job.checkpoint("p" * 256)
        assert checkpoint_of(db, key) == before == (None, None)
        assert not job.lost
        job.set_result(1)
    with idempotent(pool, key) as job:
        assert job.replayed
        with pytest.raises(RuntimeError):
            job.checkpoint("after the fact")


# ---- session-bound claims ---------------------------------------------------------------


def owner_session(db: Any, key: str, scope: str = "") -> Any:
    return db.execute("SELECT owner_session FROM idempotency.keys WHERE key = %s "
                      "AND scope = %s", (key, scope)).fetchone()[0]  # type: ignore[index]


def claim_backend(db: Any, key: str) -> int:
    """The server process of the idle session whose last statement was the
    session-bound claim of this key."""
    rows = db.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
        "AND state = 'idle' AND query LIKE '%session_bound => true%' "
        "AND pid <> pg_backend_pid()").fetchall()
    assert len(rows) == 1, rows
    return int(rows[0][0])


def test_plain_claims_are_not_session_bound(pool: ConnectionPool, db: Any, key: str) -> None:
    with idempotent(pool, key):
        assert owner_session(db, key) is None


def test_session_bound_holds_its_pool_connection_for_the_attempt(db: Any, key: str) -> None:
    with ConnectionPool("", min_size=2, max_size=2, kwargs={"autocommit": True}) as pool:
        pool.wait()
        with idempotent(pool, key, session_bound=True, lease=3600) as job:
            assert owner_session(db, key) is not None
            assert pool.get_stats()["pool_available"] == 1, "the claim's connection is held"
            job.checkpoint("half_way")            # on the other connection
            job.set_result("bound")
        assert pool.get_stats()["pool_available"] == 2, "and given back"
        assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "bound"})

        # the claim's session ends while the work runs (the process died, the
        # backend was terminated): the key is free at once, lease or not
        key2 = key + "-2"
        with pytest.raises(KeyLostError):
            with idempotent(pool, key2, session_bound=True, lease=3600) as job:
                job.checkpoint("charge_created", {"charge": "ch_7"})
                db.execute("SELECT pg_terminate_backend(%s)", (claim_backend(db, key2),))

                def take_over() -> Optional[Tuple[Any, ...]]:
                    row = claim_sql(db, key2)
                    return row if row[0] == "claimed" else None
                _, attempt, _, phase, data = wait_for(take_over, what="the takeover")
                assert (attempt, phase, data) == (2, "charge_created", {"charge": "ch_7"})
                job.set_result("too late")
        assert stored(db, key2)[:2] == ("pending", 2)  # type: ignore[index]


def test_session_bound_on_a_connection_and_when_not_claimed(db: Any, key: str) -> None:
    with psycopg.connect(autocommit=True) as conn:
        with idempotent(conn, key, session_bound=True) as job:
            assert owner_session(db, key) is not None
            job.set_result(1)
        # a replay holds nothing and binds nothing
        with idempotent(conn, key, session_bound=True) as job:
            assert job.replayed
    with ConnectionPool("", min_size=1, max_size=1, kwargs={"autocommit": True}) as pool:
        with idempotent(pool, key, session_bound=True) as job:
            assert job.replayed
            assert pool.get_stats()["pool_available"] == 1


async def test_async_session_bound(db: Any, key: str) -> None:
    async with AsyncConnectionPool("", min_size=2, max_size=2) as apool:
        await apool.wait()
        async with idempotent(apool, key, session_bound=True) as job:
            assert owner_session(db, key) is not None
            assert apool.get_stats()["pool_available"] == 1
            await job.checkpoint("bound")
            job.set_result("ok")
        assert apool.get_stats()["pool_available"] == 2
    assert stored(db, key) == ("succeeded", 1, None, {"v": 1, "json": "ok"})

    @idempotent_job(db, key=lambda k: k, session_bound=True, scope="")
    def bound(k: str) -> Any:
        return owner_session(db, k) is not None

    assert bound(key + "-decorated") is True


# ---- extension versions before 1.4 -----------------------------------------------------


@pytest.fixture
def old_db(db: Any) -> Iterator[str]:
    with database_with_extension(db, "idem_py_v13_", "1.3") as name:
        yield name


def test_jobs_work_on_extension_1_3(old_db: str, key: str) -> None:
    with psycopg.connect(dbname=old_db, autocommit=True) as conn:
        with idempotent(conn, key) as job:
            assert (job.attempt, job.phase, job.phase_data) == (1, None, None)
            job.set_result("old")
        with idempotent(conn, key) as job:
            assert job.replayed and job.value == "old"
        # the new calls need 1.4: refused before any statement, naming the fix
        with pytest.raises(MisconfiguredError, match=r"session_bound=True\) needs the "
                           r"idempotency extension 1\.4 or later; database \"idem_py_v13_\w+\" "
                           r"has 1\.3: run ALTER EXTENSION idempotency UPDATE"):
            with idempotent(conn, key + "-b", session_bound=True):
                pytest.fail("no session-bound claims before 1.4")
        assert conn.execute("SELECT count(*) FROM idempotency.keys WHERE key = %s",
                            (key + "-b",)).fetchone()[0] == 0
        with pytest.raises(MisconfiguredError, match=r"checkpoint\(\)\) needs the "
                           r"idempotency extension 1\.4"):
            with idempotent(conn, key + "-c") as job:
                job.checkpoint("x")
