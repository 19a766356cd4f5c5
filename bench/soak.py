#!/usr/bin/python3
"""bench/soak.py: a long mixed load on the idempotency extension, with a verdict.

Run by scripts/soak.sh (./run soak), which builds and installs the extension,
starts a throwaway cluster with the settings `soak.py --conf` prints, and
points libpq's environment (PGHOST, PGPORT, PGUSER, PGDATABASE) at it.

  /usr/bin/python3 bench/soak.py --conf --minutes 2       # postgresql.conf lines
  /usr/bin/python3 bench/soak.py --minutes 2 --out DIR    # the soak itself

The load: --clients threads, each with its own connection, run a mix of
operations (external claim/finish, transaction mode with a side effect,
checkpoint + extend, releases, claim_many/finish_many batches, session-bound
claims on connections that then disconnect, reclaims of those, lookups,
replays, same-session duplicates, payload mismatches, and calls that must fail
with a documented SQLSTATE).  Fresh keys are random and used by one thread
only, so each outcome is known in advance; a pool of shared "hot" keys makes
replays, in-progress answers and races between threads happen.  An outcome or
SQLSTATE that docs/api.md allows for the call is expected; anything else is
unexpected and counted (by SQLSTATE, or as "outcome" for a wrong answer).
Whether a key may have expired is decided from the wall clock read before and
after the call against the expiry the server returned, never from a sleep.
The clients offer a fixed rate of operations (--rate, 600/s by default, below
what a 2-core machine sustains; 0 lifts it): the number of live keys, and so
the table's size, follows the throughput, which on a shared machine would
otherwise move with everything else that runs there.

Every sample period (a twelfth of the run, at most 60 s) it records
throughput, errors, the RSS of the load's backends and of the worker,
relation sizes and tuple counts (samples.csv, one printed line per sample).
VmRSS counts the shared buffers a process has touched, so it rises while the
backends first reach the table's pages; RssAnon (private memory) is in the
CSV too.  The worker is the launcher: each sweep visit is a new process.
At the end: the worker must reset the orphaned session-bound keys, amcheck
must find nothing, and the verdict is printed:

  unexpected errors   none
  RSS flat            every sample after the midpoint within 10% of the
                      midpoint sample (the load's backends: sum and max of
                      VmRSS; the worker: the launcher's VmRSS)
  sizes steady        for the heap, its TOAST table and each index: the
                      median size in the last third is at most 1.10 x the
                      median from the end of the first third to the
                      midpoint (medians: a vacuum that starts late makes
                      one sample spike, a leak moves them all), plus 16
                      blocks
                      (so a relation of a hundred pages may still split a
                      few), times the growth of the rows: when the machine
                      is busier in the first half, fewer keys are live
                      then, and the table holds more of them later without
                      leaking a byte.  The rows are counted at each sample;
                      a leak grows the sizes, not the rows.  The retention
                      is a twelfth of the run (at most 2 minutes), so the
                      first third spans four retention periods, about what
                      a heap of churning keys takes to reach the size it
                      keeps; autovacuum runs at 5% dead rows, unthrottled,
                      about 20 times per retention period
  orphans reset       after the load stops, no session-bound key of an
                      ended session is left pending (waited for by polling,
                      up to three sweep intervals + 30 s)
  amcheck             bt_index_check(heapallindexed) and
                      bt_index_parent_check(heapallindexed) on each index of
                      the table and of its TOAST table, verify_heapam with
                      check_toast: no corruption reported

It ends with "N passed, N failed" and exits 0 only when every check passed.
"""

import argparse
import collections
import contextlib
import csv
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import traceback
import uuid
import zlib

import psycopg
from psycopg.types.json import Jsonb

# Keys shared by every thread, spread over a few scopes.
HOT_KEYS = 256
HOT_SCOPES = 4
# The scope of the fresh keys.
SCOPE = "soak"
# Slack when the client's clock is compared with a timestamptz the server
# computed from the same clock (microseconds; a float second is finer).
EPS = 0.002
# Unexpected errors whose message is printed at the end.
EXAMPLES = 20
# Sizes may grow by this factor plus this many bytes from the middle of the run to its last third.
# The bytes matter only to a short run's relations of a hundred pages or so,
# where a B-tree on random keys is still splitting a page now and then.
SIZE_FACTOR = 1.10
SIZE_SLACK = 16 * 8192
RSS_TOLERANCE = 0.10
CALL_KINDS = ("claim", "finish", "release", "extend", "checkpoint",
              "claim_many", "finish_many", "lookup")

SQL_CLAIM = ("SELECT outcome, token, attempt, status, response_code, response_body,"
             " retry_after, phase, phase_data FROM idempotency.idem_claim("
             "%s, %s::jsonb, %s, wait => %s::interval, session_bound => %s)")
SQL_FINISH = "SELECT idempotency.idem_finish(%s, %s, %s, %s::jsonb, %s, %s)"
SQL_EXTEND = "SELECT idempotency.idem_extend(%s, %s, NULL, %s)"
SQL_RELEASE = "SELECT idempotency.idem_release(%s, %s, %s)"
SQL_CHECKPOINT = "SELECT idempotency.idem_checkpoint(%s, %s, %s, %s::jsonb, %s)"
SQL_CLAIM_MANY = ("SELECT ord, key, outcome, token, attempt, status, response_code,"
                  " response_body, retry_after, phase FROM idempotency.idem_claim_many("
                  "%s::text[], %s::jsonb[], %s, session_bound => %s) ORDER BY ord")
SQL_FINISH_MANY = ("SELECT ord, key, expires_at FROM idempotency.idem_finish_many("
                   "%s::text[], %s::bigint[], %s::int[], %s::jsonb[], %s) ORDER BY ord")
SQL_LOOKUP = ("SELECT status, attempt, response_code, response_body, expires_at, phase"
              " FROM idempotency.idem_lookup(%s, %s)")


class Claim:
    """One row of idem_claim."""
    __slots__ = ("outcome", "token", "attempt", "status", "code", "body",
                 "retry_after", "phase", "phase_data")

    def __init__(self, row):
        (self.outcome, self.token, self.attempt, self.status, self.code,
         self.body, self.retry_after, self.phase, self.phase_data) = row[:9]


class Wrong(Exception):
    """An answer the documentation does not allow for the call."""


class Lost(Exception):
    """The owner's lease may have ended and the key went to another attempt:
    an expected end of the operation (already counted)."""


def settings(minutes):
    """The run's timing: sample period, retention, lease, sweep interval and
    autovacuum naptime (seconds), scaled to the length of the run so that a
    short run still sees many retention periods."""
    run_s = minutes * 60.0
    period = min(60.0, run_s / 12)
    retention = int(min(120, max(5, run_s / 12)))
    return {
        "run_s": run_s,
        "period": period,
        "retention": retention,
        # A pending key lives until the later of its retention and its lease:
        # a lease no longer than the retention keeps abandoned keys to it.
        "lease": min(30, retention),
        # Keys are swept within a fraction of their retention.
        "sweep_interval": min(5, max(1, retention // 4)),
        # Autovacuum looks at the table many times per retention period, so
        # that dead rows stay a small share of the live ones and the sizes
        # settle within the first third of a short run too.
        "naptime": int(min(60, max(1, retention / 20))),
    }


def conf_lines(cfg):
    """postgresql.conf lines of the soak's cluster."""
    return [
        "shared_preload_libraries = 'idempotency'",
        f"idempotency.sweep_interval = '{cfg['sweep_interval']}s'",
        f"idempotency.retention = '{cfg['retention']}s'",
        f"idempotency.lease = '{cfg['lease']}s'",
        f"autovacuum_naptime = '{cfg['naptime']}s'",
        # Vacuum at 5% dead rows, unthrottled: the sizes then follow the live
        # keys, not when a vacuum happened to start.
        "autovacuum_vacuum_scale_factor = 0.05",
        "autovacuum_vacuum_cost_delay = 0",
        "max_connections = 100",
        "log_min_messages = warning",
        "log_min_error_statement = panic",
    ]


def expected_result(scope, key):
    """The result a key is finished with: status, response code and body.
    Fixed per key, so that a replay can be checked whoever finished it.
    One key in eight has a body large enough to be stored in TOAST, enough
    of them that the TOAST table's size is not just noise."""
    h = zlib.crc32(f"{scope}/{key}".encode())
    failed = h % 13 == 0
    body = {"key": key, "ok": not failed}
    if h % 8 == 3:
        body["pad"] = random.Random(h).randbytes(1600).hex()
    return ("failed" if failed else "succeeded", 422 if failed else 201, body)


def request_of(scope, key):
    """The request payload of a key (its fingerprint's source)."""
    return {"key": key, "scope": scope, "amount": zlib.crc32(key.encode()) % 1000}


def hot_key(i):
    return f"tenant{i % HOT_SCOPES}", f"h{i:04d}"


def proc_status(pid):
    """VmRSS, RssAnon and RssShmem of a process in kB, or None once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name in ("VmRSS", "RssAnon", "RssShmem", "State"):
                    out[name] = value.split()[0]
    except OSError:
        return None
    if out.get("State") == "Z" or "VmRSS" not in out:
        return None
    return {k: int(out.get(k, 0)) for k in ("VmRSS", "RssAnon", "RssShmem")}


def pid_alive(pid):
    return proc_status(pid) is not None


class Tally:
    """Counters shared by the load threads and the sampler."""

    def __init__(self):
        self.lock = threading.Lock()
        self.calls = collections.Counter()
        self.outcomes = collections.Counter()
        self.expected = collections.Counter()
        self.unexpected = collections.Counter()
        self.info = collections.Counter()
        self.examples = []

    def call(self, kind, n=1):
        with self.lock:
            self.calls[kind] += n

    def outcome(self, outcome, n=1):
        with self.lock:
            self.outcomes[outcome] += n

    def note(self, what, n=1):
        with self.lock:
            self.info[what] += n

    def expect(self, state):
        with self.lock:
            self.expected[state] += 1

    def fail(self, state, message):
        with self.lock:
            self.unexpected[state] += 1
            if len(self.examples) < EXAMPLES:
                self.examples.append(f"{state}: {message}")

    def snapshot(self):
        with self.lock:
            return (collections.Counter(self.calls), collections.Counter(self.expected),
                    collections.Counter(self.unexpected))


class Worker(threading.Thread):
    """One load connection running the operation mix until told to stop."""

    def __init__(self, num, tally, cfg, stop, orphans, seed, interval):
        super().__init__(name=f"soak-{num}", daemon=True)
        self.num = num
        self.tally = tally
        self.cfg = cfg
        self.stop = stop
        self.orphans = orphans
        self.rng = random.Random(seed)
        self.conn = None
        self.lease = cfg["lease"]
        self.interval = interval   # seconds between this thread's operations, 0: no pacing
        # Fresh keys this thread finished: key -> (request, token, expires_at, phase)
        self.finished = collections.OrderedDict()
        self.committed_hot = 0     # transaction-mode jobs on hot keys committed
        self.committed_fresh = 0   # side effects on this thread's counter row
        ops = [
            (self.op_external, 18), (self.op_hot, 10), (self.op_transaction, 12),
            (self.op_checkpoint, 8), (self.op_release, 6), (self.op_batch, 4),
            (self.op_orphan, 1), (self.op_reclaim, 3), (self.op_lookup, 8),
            (self.op_replay, 10), (self.op_duplicate, 4), (self.op_mismatch, 6),
            (self.op_stale, 5),
        ]
        self.ops = [op for op, _ in ops]
        self.weights = [w for _, w in ops]

    # -- connections and calls ------------------------------------------------

    def connect(self, name="soak load"):
        return psycopg.connect("", autocommit=True, application_name=name,
                               options="-c statement_timeout=60s")

    def q(self, kind, sql, params, conn=None):
        self.tally.call(kind)
        return (conn or self.conn).execute(sql, params)

    def claim(self, scope, key, request, session_bound=False, wait="0", conn=None):
        cur = self.q("claim", SQL_CLAIM,
                     (key, Jsonb(request) if request is not None else None, scope,
                      wait, session_bound), conn)
        c = Claim(cur.fetchone())
        self.tally.outcome(c.outcome)
        if c.outcome == "claimed" and c.attempt > 1:
            self.tally.outcome("takeover")
        return c

    def finish(self, scope, key, token, conn=None):
        status, code, body = expected_result(scope, key)
        cur = self.q("finish", SQL_FINISH, (key, token, code, Jsonb(body), scope, status), conn)
        return cur.fetchone()[0].timestamp()

    def checkpoint(self, scope, key, token, phase, data, conn=None):
        self.q("checkpoint", SQL_CHECKPOINT, (key, token, phase, Jsonb(data), scope), conn)

    def release(self, scope, key, token):
        self.q("release", SQL_RELEASE, (key, token, scope))

    def extend(self, scope, key, token):
        return self.q("extend", SQL_EXTEND, (key, token, scope)).fetchone()[0].timestamp()

    def lookup(self, scope, key):
        return self.q("lookup", SQL_LOOKUP, (key, scope)).fetchone()

    def owned(self, claimed_before, fn, *args):
        """A call of the key's owner (finish, extend, checkpoint, release).  A
        dead token (55006) or an absent key (P0002) is expected only once the
        lease may have ended: it runs from a moment after claimed_before, so
        before claimed_before + lease nobody could take the key over or reset
        it.  Such an expected loss raises Lost."""
        try:
            return fn(*args)
        except psycopg.Error as e:
            if e.sqlstate in ("55006", "P0002") and time.time() >= claimed_before + self.lease:
                self.tally.expect(e.sqlstate)
                raise Lost(e.sqlstate) from e
            raise

    def owner_finish(self, scope, key, token, claimed_before, conn=None):
        return self.owned(claimed_before, self.finish, scope, key, token, conn)

    def must_fail(self, states, what, fn, *args):
        """A call that the documentation says raises one of states."""
        try:
            fn(*args)
        except psycopg.Error as e:
            if e.sqlstate in states:
                self.tally.expect(e.sqlstate)
                return e.sqlstate
            raise
        raise Wrong(f"{what} succeeded; expected SQLSTATE {'/'.join(states)}")

    def first_claim(self, prefix, session_bound=False, conn=None):
        """The first claim of a fresh key, which only this thread knows: it
        must be claimed, attempt 1.  Returns the key, its request, the time
        before the claim and the claim."""
        key = self.fresh(prefix)
        req = request_of(SCOPE, key)
        t0 = time.time()
        c = self.claim(SCOPE, key, req, session_bound=session_bound, conn=conn)
        if c.outcome != "claimed" or c.attempt != 1:
            raise Wrong(f"first claim of fresh key {key}: {c.outcome} attempt {c.attempt}")
        return key, req, t0, c

    def fresh(self, prefix, batchable=False):
        while True:
            key = f"{prefix}-{self.num}-{uuid.uuid4().hex[:20]}"
            if not batchable or expected_result(SCOPE, key)[0] == "succeeded":
                return key

    def remember(self, key, request, token, expires_at, phase=None):
        self.finished[key] = (request, token, expires_at, phase)
        self.finished.move_to_end(key)
        while len(self.finished) > 512:
            self.finished.popitem(last=False)

    def pick_finished(self):
        if not self.finished:
            return None
        key = self.rng.choice(list(self.finished))
        return (key,) + self.finished[key]

    def busy(self, c):
        """in_progress with retry_after 1 for a key no attempt holds: another
        transaction (the sweeper rescheduling, resetting or deleting it) is
        writing the key right now, and a claim never waits for that."""
        if c.outcome == "in_progress" and c.retry_after == 1:
            self.tally.note("in_progress (retry_after 1) while another transaction wrote the key")
            return True
        return False

    def check_replay(self, scope, key, c):
        want = expected_result(scope, key)
        got = (c.status, c.code, c.body)
        if got != want:
            raise Wrong(f"replay of {scope}/{key} returned {got[:2]}, stored {want[:2]}"
                        f"{'' if got[2] == want[2] else ' (another body)'}")

    # -- the operations -------------------------------------------------------

    def op_external(self):
        """External mode: the claim commits, the finish is a transaction of its
        own; some claims are session-bound on this long-lived connection."""
        key, req, t0, c = self.first_claim("ext", session_bound=self.rng.random() < 0.2)
        self.remember(key, req, c.token, self.owner_finish(SCOPE, key, c.token, t0))

    def op_hot(self):
        """A shared key: any of claimed, replay, in_progress; never mismatch."""
        scope, key = hot_key(self.rng.randrange(HOT_KEYS))
        wait = "50 milliseconds" if self.rng.random() < 0.3 else "0"
        t0 = time.time()
        c = self.claim(scope, key, request_of(scope, key), wait=wait)
        if c.outcome == "claimed":
            if self.rng.random() < 0.15:
                self.owned(t0, self.release, scope, key, c.token)
            else:
                self.owner_finish(scope, key, c.token, t0)
        elif c.outcome == "replay":
            self.check_replay(scope, key, c)
        elif c.outcome != "in_progress":
            raise Wrong(f"hot key {scope}/{key} answered {c.outcome}")

    def op_transaction(self):
        """Transaction mode: claim, the side effect and finish commit together."""
        hot = self.rng.random() < 0.5
        if hot:
            scope, key = hot_key(self.rng.randrange(HOT_KEYS))
        else:
            scope, key = SCOPE, self.fresh("txn")
        req = request_of(scope, key)
        expires = None
        with self.conn.transaction():
            c = self.claim(scope, key, req)
            if c.outcome == "claimed":
                if hot:
                    self.conn.execute(
                        "INSERT INTO soak.ledger AS l (scope, key, n) VALUES (%s, %s, 1)"
                        " ON CONFLICT (scope, key) DO UPDATE SET n = l.n + 1", (scope, key))
                else:
                    self.conn.execute("UPDATE soak.counters SET n = n + 1 WHERE worker = %s",
                                      (self.num,))
                expires = self.finish(scope, key, c.token)
            elif hot and c.outcome == "replay":
                self.check_replay(scope, key, c)
            elif not (hot and c.outcome == "in_progress"):
                raise Wrong(f"transaction-mode claim of {scope}/{key}: {c.outcome}")
        if expires is not None:
            if hot:
                self.committed_hot += 1
            else:
                self.committed_fresh += 1
                self.remember(key, req, c.token, expires)

    def op_checkpoint(self):
        """A long external job: checkpoints and a heartbeat before its finish."""
        key, req, t0, c = self.first_claim("ckpt")
        self.owned(t0, self.checkpoint, SCOPE, key, c.token, "charged", {"charge": key[-8:]})
        t1 = time.time()
        deadline = self.owned(t0, self.extend, SCOPE, key, c.token)
        if deadline < t1 + self.lease - EPS:
            raise Wrong(f"idem_extend's deadline is {t1 + self.lease - deadline:.3f}s short")
        with self.conn.transaction():
            self.owned(t1, self.checkpoint, SCOPE, key, c.token, "booked", {"ledger": 1})
            self.conn.execute("UPDATE soak.counters SET n = n + 1 WHERE worker = %s",
                              (self.num,))
        self.committed_fresh += 1
        # The heartbeat moved the lease on, from a moment after t1.
        expires = self.owner_finish(SCOPE, key, c.token, t1)
        self.remember(key, req, c.token, expires, "booked")

    def op_release(self):
        """A retryable failure: release, and the next claim is a first attempt
        that has forgotten the checkpoint."""
        key, req, t0, c = self.first_claim("rel")
        if self.rng.random() < 0.3:
            self.owned(t0, self.checkpoint, SCOPE, key, c.token, "half", None)
        self.owned(t0, self.release, SCOPE, key, c.token)
        t0 = time.time()
        c = self.claim(SCOPE, key, req)
        if c.outcome != "claimed" or c.attempt != 1 or c.phase is not None:
            raise Wrong(f"claim after release: {c.outcome} attempt {c.attempt} phase {c.phase}")
        self.remember(key, req, c.token, self.owner_finish(SCOPE, key, c.token, t0))

    def op_batch(self):
        """claim_many and finish_many over fresh keys, in one transaction or in
        two, with one key repeated (the repeat answers in_progress); then a
        batch over shared keys."""
        fresh = [self.fresh("batch", batchable=True) for _ in range(self.rng.randint(3, 30))]
        keys = fresh + [fresh[0]]
        self.rng.shuffle(keys)
        reqs = [Jsonb(request_of(SCOPE, k)) for k in keys]
        in_txn = self.rng.random() < 0.5
        session_bound = not in_txn and self.rng.random() < 0.3
        t0 = time.time()
        with self.conn.transaction() if in_txn else contextlib.nullcontext():
            rows = self.q("claim_many", SQL_CLAIM_MANY,
                          (keys, reqs, SCOPE, session_bound)).fetchall()
            self.tally.call("batch_elements", len(keys))
            if len(rows) != len(keys):
                raise Wrong(f"idem_claim_many returned {len(rows)} rows for {len(keys)} keys")
            seen = set()
            claimed = []
            for ord_, key, outcome, token, attempt, _, _, _, retry_after, _ in rows:
                self.tally.outcome(outcome)
                if key in seen:
                    if outcome != "in_progress" or retry_after != 1:
                        raise Wrong(f"repeated element {ord_} of a batch: {outcome}"
                                    f" retry_after {retry_after}")
                    continue
                seen.add(key)
                if outcome != "claimed" or attempt != 1:
                    raise Wrong(f"batch element {ord_} (fresh key): {outcome} attempt {attempt}")
                claimed.append((key, token))
            out = self.finish_many(SCOPE, claimed, None if in_txn else t0)
        for (key, token), expires in zip(claimed, out):
            self.remember(key, request_of(SCOPE, key), token, expires)
        self.op_hot_batch()

    def finish_many(self, scope, claimed, claimed_before):
        """idem_finish_many of (key, token) pairs; returns their expiries.
        claimed_before: as for owned(), or None when the claims are part of
        this transaction (no lease can end under them)."""
        results = [expected_result(scope, k) for k, _ in claimed]
        args = ("finish_many", SQL_FINISH_MANY,
                ([k for k, _ in claimed], [t for _, t in claimed],
                 [r[1] for r in results], [Jsonb(r[2]) for r in results], scope))
        if claimed_before is None:
            out = self.q(*args).fetchall()
        else:
            out = self.owned(claimed_before, lambda: self.q(*args).fetchall())
        if [r[1] for r in out] != [k for k, _ in claimed]:
            raise Wrong("idem_finish_many's rows are not its keys in order")
        return [r[2].timestamp() for r in out]

    def op_hot_batch(self):
        """claim_many over shared keys of one scope: claimed, replay or
        in_progress per element; the claimed ones are finished together."""
        first = self.rng.randrange(HOT_SCOPES)
        picks = {i for i in (self.rng.randrange(first, HOT_KEYS, HOT_SCOPES) for _ in range(4))
                 if expected_result(*hot_key(i))[0] == "succeeded"}
        if not picks:
            return
        scope = hot_key(first)[0]
        keys = [hot_key(i)[1] for i in sorted(picks)]
        reqs = [Jsonb(request_of(scope, k)) for k in keys]
        t0 = time.time()
        rows = self.q("claim_many", SQL_CLAIM_MANY, (keys, reqs, scope, False)).fetchall()
        self.tally.call("batch_elements", len(keys))
        claimed = []
        for ord_, key, outcome, token, _, status, code, body, _, _ in rows:
            self.tally.outcome(outcome)
            if outcome == "claimed":
                claimed.append((key, token))
            elif outcome == "replay":
                if (status, code, body) != expected_result(scope, key):
                    raise Wrong(f"batch replay of {scope}/{key}: {status} {code}")
            elif outcome != "in_progress":
                raise Wrong(f"batch element {ord_} (hot key {scope}/{key}): {outcome}")
        if claimed:
            self.finish_many(scope, claimed, t0)

    def op_orphan(self):
        """Session-bound claims on a connection that then goes away without
        finishing: one with a checkpoint, and a batch.  Half are handed to
        reclaimers; the worker must reset the others."""
        conn = self.connect("soak orphan")
        self.tally.call("connect")
        try:
            pid = conn.info.backend_pid
            left = []
            key, _, t0, c = self.first_claim("orph", session_bound=True, conn=conn)
            self.checkpoint(SCOPE, key, c.token, "charged", {"charge": key[-8:]}, conn=conn)
            left.append((key, c.token, "charged"))
            keys = [self.fresh("orphb") for _ in range(4)]
            rows = self.q("claim_many", SQL_CLAIM_MANY,
                          (keys, [Jsonb(request_of(SCOPE, k)) for k in keys], SCOPE, True),
                          conn=conn).fetchall()
            self.tally.call("batch_elements", len(keys))
            for _, k, outcome, token, *_ in rows:
                self.tally.outcome(outcome)
                if outcome != "claimed":
                    raise Wrong(f"session-bound batch element (fresh key): {outcome}")
                left.append((k, token, None))
        finally:
            conn.close()
        for key, token, phase in left:
            if self.rng.random() < 0.5:
                self.orphans.append((key, token, phase, pid, t0))
            else:
                self.tally.note("orphans left to the worker")

    def op_reclaim(self):
        """Take over a key whose session-bound owner disconnected: at once,
        without waiting for its lease, resuming from its checkpoint."""
        try:
            key, old_token, phase, pid, t0 = self.orphans.popleft()
        except IndexError:
            return self.op_lookup()
        alive = pid_alive(pid)
        c = self.claim(SCOPE, key, request_of(SCOPE, key))
        t1 = time.time()
        expiry_bound = t0 + max(self.cfg["retention"], self.lease)
        if c.outcome == "in_progress" and (alive or self.busy(c)):
            # its backend had not exited yet, or the sweeper is resetting
            # it: try again later
            if alive:
                self.tally.note("reclaims before the owner's backend exited")
            self.orphans.append((key, old_token, phase, pid, t0))
            return
        if c.outcome == "in_progress":
            raise Wrong(f"orphaned key {key}: in_progress (retry_after {c.retry_after})"
                        " although its session ended")
        if c.outcome != "claimed":
            raise Wrong(f"orphaned key {key}: {c.outcome}")
        if c.attempt == 1:
            # a fresh claim: only once the orphan's retention ended
            if t1 < expiry_bound - EPS or c.phase is not None:
                raise Wrong(f"orphaned key {key}: attempt 1 before its expiry")
        elif c.attempt != 2 or c.phase != phase:
            raise Wrong(f"orphaned key {key}: attempt {c.attempt} phase {c.phase},"
                        f" expected attempt 2 phase {phase}")
        else:
            self.tally.note("orphans taken over by a client")
        # The old owner's token is dead now.
        self.must_fail(("55006",), "finish with the orphan's token",
                       self.finish, SCOPE, key, old_token)
        self.remember(key, request_of(SCOPE, key), c.token,
                      self.owner_finish(SCOPE, key, c.token, t1), c.phase)

    def op_lookup(self):
        if self.rng.random() < 0.3 or not self.finished:
            scope, key = hot_key(self.rng.randrange(HOT_KEYS))
            row = self.lookup(scope, key)
            if row and row[0] != "pending" and (row[0], row[2], row[3]) != \
                    expected_result(scope, key):
                raise Wrong(f"lookup of hot key {scope}/{key}: {row[0]} {row[2]}")
            return
        key, _, _, expires, phase = self.pick_finished()
        t0 = time.time()
        row = self.lookup(SCOPE, key)
        t1 = time.time()
        if row is None:
            if t1 < expires - EPS:
                raise Wrong(f"lookup of {key}: no row before its expiry")
            return
        if t0 >= expires + EPS:
            raise Wrong(f"lookup of {key}: a row after its expiry")
        status, _, code, body, _, got_phase = row
        if (status, code, body) != expected_result(SCOPE, key) or got_phase != phase:
            raise Wrong(f"lookup of {key}: {status} {code} phase {got_phase}")

    def op_replay(self):
        """A retry of a finished request: the stored result, until its expiry."""
        item = self.pick_finished()
        if item is None:
            return self.op_external()
        key, req, _, expires, _ = item
        t0 = time.time()
        c = self.claim(SCOPE, key, req)
        t1 = time.time()
        if c.outcome == "replay":
            if t0 >= expires + EPS:
                raise Wrong(f"replay of {key} after its expiry")
            self.check_replay(SCOPE, key, c)
        elif c.outcome == "claimed" and t1 >= expires - EPS:
            self.finished.pop(key, None)
            self.remember(key, req, c.token, self.owner_finish(SCOPE, key, c.token, t0))
        elif not self.busy(c):
            raise Wrong(f"retry of finished {key}: {c.outcome}")

    def op_duplicate(self):
        """A duplicate while the first attempt runs: in_progress, then replay."""
        key, req, t0, c = self.first_claim("dup", session_bound=self.rng.random() < 0.3)
        wait = "10 milliseconds" if self.rng.random() < 0.3 else "0"
        td = time.time()
        d = self.claim(SCOPE, key, req, wait=wait)
        if d.outcome == "claimed" and time.time() >= t0 + self.lease:
            c, t0 = d, td   # the first attempt's lease ended: a takeover
        elif d.outcome != "in_progress" or not d.retry_after or d.retry_after < 1:
            raise Wrong(f"duplicate of a pending key: {d.outcome} retry_after {d.retry_after}")
        expires = self.owner_finish(SCOPE, key, c.token, t0)
        r = self.claim(SCOPE, key, req)
        if r.outcome == "claimed" and time.time() >= expires - EPS:
            self.owned(time.time(), self.release, SCOPE, key, r.token)
            return
        if r.outcome == "replay":
            self.check_replay(SCOPE, key, r)
        elif not self.busy(r):
            raise Wrong(f"claim after finish: {r.outcome}")
        self.remember(key, req, c.token, expires)

    def op_mismatch(self):
        """The same key with another payload (422), in a transaction that is
        rolled back, so that a claim of an expired key leaves nothing."""
        item = self.pick_finished()
        if item is None:
            return self.op_external()
        key, req, _, expires, _ = item
        other = dict(req, amount=req["amount"] + 1)
        t0 = time.time()
        with self.conn.transaction(force_rollback=True):
            c = self.claim(SCOPE, key, other)
        t1 = time.time()
        if c.outcome == "mismatch":
            if t0 >= expires + EPS:
                raise Wrong(f"mismatch for {key} after its expiry")
        elif not (c.outcome == "claimed" and t1 >= expires - EPS) and not self.busy(c):
            raise Wrong(f"another payload for finished {key}: {c.outcome}")

    def op_stale(self):
        """Calls that must fail: a finish repeated (the same expiry back), and
        finish/extend/release/checkpoint of a finished key, of an absent one."""
        item = self.pick_finished()
        case = self.rng.randrange(6)
        if item is None or case == 5:
            self.must_fail(("P0002",), "finish of an absent key",
                           self.finish, SCOPE, self.fresh("absent"), 1)
            return
        key, _, token, expires, _ = item
        try:
            if case == 0:
                again = self.finish(SCOPE, key, token)
                if abs(again - expires) > 1e-6:
                    raise Wrong(f"repeated finish of {key}: expiry {again} instead of {expires}")
                return
            fn, args = {
                1: (self.finish, (SCOPE, key, token + 1)),
                2: (self.extend, (SCOPE, key, token)),
                3: (self.release, (SCOPE, key, token)),
                4: (self.checkpoint, (SCOPE, key, token, "late", None)),
            }[case]
            self.must_fail(("55000",), f"call {case} on finished {key}", fn, *args)
        except psycopg.Error as e:
            if e.sqlstate == "P0002" and time.time() >= expires - EPS:
                self.tally.expect(e.sqlstate)
                return
            raise

    # -- the loop -------------------------------------------------------------

    def pace(self, next_start):
        """Wait for this thread's next start at the offered rate; a thread
        that fell behind starts at once but does not catch up in a burst.
        Returns the start after this one."""
        if not self.interval:
            return 0
        now = time.monotonic()
        if next_start > now:
            self.stop.wait(next_start - now)
        return max(next_start, time.monotonic() - 1) + self.interval

    def run(self):
        next_start = time.monotonic()
        while not self.stop.is_set():
            next_start = self.pace(next_start)
            if self.stop.is_set():
                break
            op = self.rng.choices(self.ops, self.weights)[0]
            self.tally.call("op")
            try:
                if self.conn is None or self.conn.closed:
                    self.conn = self.connect()
                    self.tally.call("connect")
                op()
            except Lost:
                pass
            except Wrong as e:
                self.tally.fail("outcome", str(e))
            except psycopg.Error as e:
                detail = e.diag.message_detail
                self.tally.fail(e.sqlstate or "connection",
                                f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                                + (f" ({detail})" if detail else "")
                                + f" in {op.__name__}")
                if self.conn is not None and (self.conn.closed or self.conn.broken):
                    self.conn = None
                    time.sleep(0.1)
            except Exception as e:  # a bug of this program: count it, carry on
                self.tally.fail("soak", f"{type(e).__name__}: {e} "
                                f"{traceback.format_exc(limit=3)}")
        if self.conn is not None:
            self.conn.close()


class Sampler:
    """Reads the server's side of things: processes, sizes, counters."""

    def __init__(self):
        self.conn = psycopg.connect("", autocommit=True, application_name="soak monitor")
        self.indexes = [r[0] for r in self.conn.execute(
            "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid"
            " WHERE i.indrelid = 'idempotency.keys'::regclass ORDER BY c.relname")]
        self.launcher_pids = set()

    def processes(self):
        rows = self.conn.execute(
            "SELECT pid, backend_type, application_name FROM pg_stat_activity").fetchall()
        load, launcher, sweeper = [], [], []
        for pid, btype, app in rows:
            if btype == "client backend" and app == "soak load":
                load.append(pid)
            elif btype == "idempotency launcher":
                launcher.append(pid)
            elif btype == "idempotency sweeper":
                sweeper.append(pid)
        return load, launcher, sweeper

    def sample(self):
        load, launcher, sweeper = self.processes()
        rss = [s for s in map(proc_status, load) if s]
        lstat = [s for s in map(proc_status, launcher) if s]
        sstat = [s for s in map(proc_status, sweeper) if s]
        self.launcher_pids.update(launcher)
        out = {
            "backends": len(rss),
            "backend_rss_sum_kb": sum(s["VmRSS"] for s in rss),
            "backend_rss_max_kb": max((s["VmRSS"] for s in rss), default=0),
            "backend_anon_sum_kb": sum(s["RssAnon"] for s in rss),
            "backend_anon_max_kb": max((s["RssAnon"] for s in rss), default=0),
            "worker_pid": launcher[0] if launcher else "",
            "worker_rss_kb": lstat[0]["VmRSS"] if lstat else "",
            "worker_anon_kb": lstat[0]["RssAnon"] if lstat else "",
            "sweeper_rss_kb": max((s["VmRSS"] for s in sstat), default=""),
        }
        sizes = self.conn.execute(
            "SELECT pg_relation_size('idempotency.keys'),"
            " coalesce(pg_relation_size(nullif(reltoastrelid, 0)), 0)"
            " FROM pg_class WHERE oid = 'idempotency.keys'::regclass").fetchone()
        out["table_bytes"], out["toast_bytes"] = sizes
        for name in self.indexes:
            out[f"{name}_bytes"] = self.conn.execute(
                "SELECT pg_relation_size(%s::regclass)", (f"idempotency.{name}",)).fetchone()[0]
        out["rows"] = self.conn.execute("SELECT count(*) FROM idempotency.keys").fetchone()[0]
        out.update(zip(("n_live_tup", "n_dead_tup", "autovacuums"), self.conn.execute(
            "SELECT n_live_tup, n_dead_tup, autovacuum_count FROM pg_stat_user_tables"
            " WHERE relid = 'idempotency.keys'::regclass").fetchone()))
        out.update(zip(("swept_expired", "swept_reset", "pending", "bound_pending"),
                       self.conn.execute(
            "SELECT s.expired, s.reset, s.pending,"
            " (SELECT count(*) FROM idempotency.keys WHERE owner_session IS NOT NULL)"
            " FROM idempotency.stats s WHERE s.database = current_database()").fetchone()))
        return out

    def close(self):
        self.conn.close()


def fmt_mb(kb):
    return f"{kb / 1024:.1f}"


def print_sample(t, rates, exp, unexp, s, indexes):
    kinds = " ".join(f"{k} {rates[k]:.0f}" for k in CALL_KINDS if rates.get(k))
    idx = ", ".join(f"{n} {s[f'{n}_bytes'] / 1048576:.2f}" for n in indexes)
    print(f"[{t:6.0f}s] {rates.get('op', 0):.0f} ops/s, {rates['total']:.0f} calls/s ({kinds})"
          f" | errors expected {exp}"
          f" unexpected {unexp} | RSS MB: backends sum {fmt_mb(s['backend_rss_sum_kb'])}"
          f" max {fmt_mb(s['backend_rss_max_kb'])}, worker "
          f"{fmt_mb(s['worker_rss_kb']) if s['worker_rss_kb'] != '' else '-'}"
          f" | sizes MB: heap {s['table_bytes'] / 1048576:.2f} toast "
          f"{s['toast_bytes'] / 1048576:.2f}, {idx} | rows {s['rows']} live {s['n_live_tup']}"
          f" dead {s['n_dead_tup']} bound-pending {s['bound_pending']}", flush=True)


def states(counter):
    return ";".join(f"{k}:{v}" for k, v in sorted(counter.items()))


def setup_database():
    with psycopg.connect("", autocommit=True) as conn:
        conn.execute("CREATE EXTENSION IF NOT EXISTS idempotency")
        conn.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
        conn.execute("CREATE SCHEMA soak")
        conn.execute("CREATE TABLE soak.ledger (scope text, key text, n int NOT NULL,"
                     " PRIMARY KEY (scope, key))")
        conn.execute("CREATE TABLE soak.counters (worker int PRIMARY KEY, n bigint NOT NULL)")
        return conn.execute("SELECT version(), idempotency.idem_version(),"
                            " current_setting('shared_buffers')").fetchone()


def run_load(args, cfg, tally):
    """The load and the samples.  Returns the samples, the workers, the
    sampler and the CSV's path."""
    stop = threading.Event()
    orphans = collections.deque()
    sampler = Sampler()
    interval = args.clients / args.rate if args.rate > 0 else 0
    workers = [Worker(i, tally, cfg, stop, orphans, args.seed * 1000 + i, interval)
               for i in range(args.clients)]
    with psycopg.connect("", autocommit=True) as conn:
        conn.execute("INSERT INTO soak.counters SELECT g, 0 FROM generate_series(0, %s) g",
                     (args.clients - 1,))
    for w in workers:
        w.start()
    period = cfg["period"]
    n = max(1, round(cfg["run_s"] / period))
    samples = []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "samples.csv")
    start = time.monotonic()
    last_calls, last_exp, last_unexp = tally.snapshot()
    last_t = start
    with open(path, "w", newline="") as f:
        writer = None
        for i in range(1, n + 1):
            delay = start + i * period - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            now = time.monotonic()
            calls, exp, unexp = tally.snapshot()
            dt = now - last_t
            rates = {k: (calls[k] - last_calls[k]) / dt for k in set(calls) | set(CALL_KINDS)}
            rates["total"] = sum(rates[k] for k in CALL_KINDS)
            s = sampler.sample()
            d_exp, d_unexp = exp - last_exp, unexp - last_unexp
            row = {"t_s": round(now - start, 1), "ops_per_s": round(rates.get("op", 0), 1),
                   "calls_per_s": round(rates["total"], 1)}
            row.update({f"{k}_per_s": round(rates[k], 1) for k in CALL_KINDS})
            row["batch_elements_per_s"] = round(rates.get("batch_elements", 0), 1)
            row["connects_per_s"] = round(rates.get("connect", 0), 2)
            row.update({"expected_errors": sum(d_exp.values()),
                        "unexpected_errors": sum(d_unexp.values()),
                        "expected_by_state": states(d_exp),
                        "unexpected_by_state": states(d_unexp)})
            row.update(s)
            if writer is None:
                writer = csv.DictWriter(f, fieldnames=list(row))
                writer.writeheader()
            writer.writerow(row)
            f.flush()
            samples.append(row)
            print_sample(row["t_s"], rates, sum(d_exp.values()), sum(d_unexp.values()), s,
                         sampler.indexes)
            last_calls, last_exp, last_unexp, last_t = calls, exp, unexp, now
    stop.set()
    for w in workers:
        w.join(120)
        if w.is_alive():
            tally.fail("soak", f"{w.name} did not stop within 120s")
    return samples, workers, sampler, path


def wait_orphans_reset(sampler, cfg):
    """After the load: every session that bound keys has ended, so the worker
    must reset each session-bound key still pending.  Polls until none is
    left, or gives up after three sweep intervals + 30 s."""
    deadline = time.monotonic() + 3 * cfg["sweep_interval"] + 30
    start = time.monotonic()
    first = None
    while True:
        n = sampler.conn.execute(
            "SELECT count(*) FROM idempotency.keys WHERE owner_session IS NOT NULL").fetchone()[0]
        if first is None:
            first = n
        if n == 0 or time.monotonic() > deadline:
            return first, n, time.monotonic() - start
        time.sleep(0.2)


def run_amcheck(sampler):
    """amcheck on the table, its TOAST table and every index of both."""
    conn = sampler.conn
    problems = []
    rels = conn.execute(
        "SELECT i.indexrelid::regclass::text FROM pg_index i"
        " JOIN pg_class t ON i.indrelid IN (t.oid, t.reltoastrelid)"
        " WHERE t.oid = 'idempotency.keys'::regclass ORDER BY 1").fetchall()
    checked = []
    for (idx,) in rels:
        for fn in ("bt_index_check", "bt_index_parent_check"):
            try:
                conn.execute(f"SELECT {fn}(index => %s::regclass, heapallindexed => true)", (idx,))
                checked.append(f"{fn}({idx})")
            except psycopg.Error as e:
                problems.append(f"{fn}({idx}): {e.sqlstate} {str(e).splitlines()[0]}")
    rows = conn.execute("SELECT blkno, offnum, attnum, msg FROM"
                        " verify_heapam('idempotency.keys', check_toast => true)").fetchall()
    checked.append("verify_heapam(idempotency.keys, check_toast)")
    problems += [f"verify_heapam: block {b} offset {o} attribute {a}: {m}" for b, o, a, m in rows]
    return checked, problems


def side_effect_check(sampler, workers, tally):
    """The side effects that committed with a finish, counted in the database
    and by the clients, must agree."""
    ledger, counters = sampler.conn.execute(
        "SELECT (SELECT coalesce(sum(n), 0) FROM soak.ledger),"
        " (SELECT coalesce(sum(n), 0) FROM soak.counters)").fetchone()
    hot = sum(w.committed_hot for w in workers)
    fresh = sum(w.committed_fresh for w in workers)
    if ledger != hot:
        tally.fail("outcome", f"side effects on hot keys: {ledger} in the ledger, {hot} committed")
    if counters != fresh:
        tally.fail("outcome", f"side effects on fresh keys: {counters} counted, {fresh} committed")
    return ledger, hot, counters, fresh


def server_log_problems(path, tally):
    """Warnings and crashes in the server log count as unexpected errors (the
    worker reports its failures there)."""
    if not path or not os.path.exists(path):
        return
    with open(path, errors="replace") as f:
        for line in f:
            for marker, state in (("WARNING:", "log-warning"), ("PANIC:", "log-panic"),
                                  ("was terminated by signal", "log-crash"),
                                  ("idempotency sweep of database", "log-sweep-failed")):
                if marker in line:
                    tally.fail(state, line.strip())


def midpoint(samples, run_s):
    """The index of the sample taken at the middle of the run."""
    return min(range(len(samples)), key=lambda i: abs(samples[i]["t_s"] - run_s / 2))


def flat(samples, column, label, run_s):
    """RSS flatness: each sample after the midpoint within 10% of the midpoint's."""
    mid = midpoint(samples, run_s)
    ref = samples[mid][column]
    later = [s[column] for s in samples[mid + 1:]]
    if ref in ("", 0) or not later or "" in later:
        return False, f"{label}: no value at the midpoint or after it"
    dev = max(abs(v - ref) / ref for v in later)
    return dev <= RSS_TOLERANCE, (
        f"{label}: {ref / 1024:.1f} MB at {samples[mid]['t_s']:.0f}s (midpoint), after it "
        f"{min(later) / 1024:.1f}..{max(later) / 1024:.1f} MB, largest deviation "
        f"{dev * 100:.1f}% (limit {RSS_TOLERANCE * 100:.0f}%)")


def steady(samples, column, label, run_s):
    """Sizes: the median in the last third against the median from the end of
    the first third to the midpoint (a sample is taken at most a second after
    its time), scaled by how much the largest row count grew between the two."""
    mid = midpoint(samples, run_s)
    early = [s for s in samples[:mid + 1] if s["t_s"] >= run_s / 3]
    late = [s for s in samples if s["t_s"] >= run_s * 2 / 3]
    if not early or not late:
        return False, f"{label}: too few samples"
    early_median = statistics.median(s[column] for s in early)
    late_median = statistics.median(s[column] for s in late)
    rows_early = max(s["rows"] for s in early)
    rows_late = max(s["rows"] for s in late)
    growth = max(1.0, rows_late / rows_early) if rows_early else 1.0
    limit = early_median * growth * SIZE_FACTOR + SIZE_SLACK
    return late_median <= limit, (
        f"{label}: median {early_median / 1048576:.2f} MB from {run_s / 3:.0f}s to"
        f" {samples[mid]['t_s']:.0f}s, median {late_median / 1048576:.2f} MB from"
        f" {run_s * 2 / 3:.0f}s (largest {max(s[column] for s in late) / 1048576:.2f})"
        f" (limit {limit / 1048576:.2f} MB = {growth:.2f} rows growth ({rows_early} -> {rows_late})"
        f" x {SIZE_FACTOR:.2f} + {SIZE_SLACK // 1024} kB)")


def plot(out, csv_path, indexes):
    """throughput, RSS and sizes over time in one PNG (gnuplot)."""
    png = os.path.join(out, "soak.png")
    idx = ", \\\n     ".join(
        f"'' using 't_s':(column('{n}_bytes')/1048576) with lines lw 2 title '{n}'"
        for n in indexes)
    script = f"""set terminal pngcairo size 1200,1100 font "DejaVu Sans,10" noenhanced
set output '{png}'
set datafile separator ','
set key outside right top
set lmargin 10
set rmargin 30
set grid
set xlabel 'seconds'
set multiplot layout 3,1 title 'idempotency soak'
set title 'throughput (per second)'
plot '{csv_path}' using 't_s':'calls_per_s' with lines lw 2 title 'all calls', \\
     '' using 't_s':'ops_per_s' with lines lw 2 title 'operations', \\
     '' using 't_s':'claim_per_s' with lines title 'claim', \\
     '' using 't_s':'finish_per_s' with lines title 'finish', \\
     '' using 't_s':'lookup_per_s' with lines title 'lookup', \\
     '' using 't_s':'batch_elements_per_s' with lines title 'batch elements'
set title 'RSS (MB, VmRSS)'
plot '{csv_path}' using 't_s':(column('backend_rss_sum_kb')/1024) with lines lw 2 title 'load backends, sum', \\
     '' using 't_s':(column('backend_rss_max_kb')/1024) with lines lw 2 title 'load backends, max', \\
     '' using 't_s':(column('worker_rss_kb')/1024) with lines lw 2 title 'launcher'
set title 'sizes (MB)'
plot '{csv_path}' using 't_s':(column('table_bytes')/1048576) with lines lw 2 title 'keys (heap)', \\
     '' using 't_s':(column('toast_bytes')/1048576) with lines lw 2 title 'keys (TOAST)', \\
     {idx}
unset multiplot
"""
    gp = os.path.join(out, "soak.gp")
    with open(gp, "w") as f:
        f.write(script)
    try:
        r = subprocess.run(["gnuplot", gp], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"plot not written: {e}"
    if r.returncode != 0:
        return f"plot not written: gnuplot: {r.stderr.strip()}"
    return f"plot: {png}"


def report(samples, tally, cfg, sampler, orphan_result, amcheck_result, workers, side):
    run_s = cfg["run_s"]
    calls, exp, unexp = tally.snapshot()
    total = sum(calls[k] for k in CALL_KINDS)
    print()
    print("== totals")
    print(f"operations: {calls['op']} ({calls['op'] / run_s:.0f}/s)")
    print(f"calls: {total} in {run_s:.0f}s ({total / run_s:.0f}/s): "
          + ", ".join(f"{k} {calls[k]}" for k in CALL_KINDS)
          + f"; batch elements {calls['batch_elements']}; connections {calls['connect']}")
    print("claim outcomes: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
    print("expected errors by SQLSTATE: " + (states(exp) or "none"))
    print("unexpected errors by SQLSTATE: " + (states(unexp) or "none"))
    for line in tally.examples:
        print(f"  {line}")
    for k, v in sorted(tally.info.items()):
        print(f"{k}: {v}")
    print(f"side effects: ledger {side[0]} (clients committed {side[1]}),"
          f" counters {side[2]} (clients committed {side[3]})")
    st = sampler.conn.execute(
        "SELECT claims, takeovers, replays, in_progress, mismatches, finishes, releases,"
        " checkpoints, expired, reset, last_sweep_at, last_sweep_ms FROM idempotency.stats"
        " WHERE database = current_database()").fetchone()
    print("stats view: " + ", ".join(f"{n} {v}" for n, v in zip(
        ("claims", "takeovers", "replays", "in_progress", "mismatches", "finishes",
         "releases", "checkpoints", "expired", "reset", "last_sweep_at", "last_sweep_ms"), st)))
    if len(sampler.launcher_pids) > 1:
        tally.fail("worker-restart", f"launcher pids seen: {sorted(sampler.launcher_pids)}")

    checks = []
    n_unexp = sum(tally.snapshot()[2].values())
    checks.append((n_unexp == 0, f"unexpected errors: {n_unexp}"
                   + (f" ({states(tally.snapshot()[2])})" if n_unexp else "")))
    checks.append(flat(samples, "backend_rss_sum_kb",
                       f"RSS of the {workers} load backends, sum", run_s))
    checks.append(flat(samples, "backend_rss_max_kb", "RSS of the load backends, max", run_s))
    checks.append(flat(samples, "worker_rss_kb", "RSS of the worker (idempotency launcher)",
                       run_s))
    checks.append(steady(samples, "table_bytes", "size of idempotency.keys (heap)", run_s))
    checks.append(steady(samples, "toast_bytes", "size of its TOAST table", run_s))
    for name in sampler.indexes:
        checks.append(steady(samples, f"{name}_bytes", f"size of index {name}", run_s))
    first, left, took = orphan_result
    checks.append((left == 0, f"session-bound keys of ended sessions reset by the worker:"
                   f" {first} pending when the load stopped, {left} after {took:.1f}s"))
    checked, problems = amcheck_result
    checks.append((not problems, f"amcheck: {len(checked)} checks, "
                   + (f"{len(problems)} problems: " + "; ".join(problems[:5])
                      if problems else "no corruption")))
    print()
    print("== verdict")
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    passed = sum(1 for ok, _ in checks if ok)
    print(f"{passed} passed, {len(checks) - passed} failed")
    return passed == len(checks)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--rate", type=float, default=600,
                    help="operations per second offered by all clients together (each"
                    " is one to a few calls); 0: as fast as they go")
    ap.add_argument("--period", type=float, help="seconds between samples"
                    " (default: a twelfth of the run, at most 60)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                  "out", "soak"))
    ap.add_argument("--server-log", help="the server's log, read for warnings at the end")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--conf", action="store_true",
                    help="print the cluster's postgresql.conf lines and exit")
    args = ap.parse_args()
    if args.minutes <= 0 or args.clients < 1:
        ap.error("--minutes must be positive and --clients at least 1")
    cfg = settings(args.minutes)
    if args.period:
        cfg["period"] = args.period
    if args.conf:
        print("\n".join(conf_lines(cfg)))
        return 0

    version, idem_version, shared_buffers = setup_database()
    print(f"== soak: {args.minutes:g} min, {args.clients} clients offering "
          f"{f'{args.rate:g} operations/s' if args.rate > 0 else 'all they can'}, a sample every"
          f" {cfg['period']:g}s; {version.split(',')[0]}, idempotency {idem_version},"
          f" shared_buffers {shared_buffers}")
    print("== settings: " + "; ".join(conf_lines(cfg)), flush=True)
    tally = Tally()
    samples, workers, sampler, csv_path = run_load(args, cfg, tally)
    print("== load stopped; waiting for the worker to reset the orphaned session-bound keys",
          flush=True)
    orphan_result = wait_orphans_reset(sampler, cfg)
    side = side_effect_check(sampler, workers, tally)
    print("== amcheck", flush=True)
    amcheck_result = run_amcheck(sampler)
    server_log_problems(args.server_log, tally)
    print(plot(args.out, csv_path, sampler.indexes))
    print(f"samples: {csv_path}")
    ok = report(samples, tally, cfg, sampler, orphan_result, amcheck_result, args.clients, side)
    sampler.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
