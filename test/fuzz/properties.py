#!/usr/bin/python3
"""test/fuzz/properties.py: a property-based fuzzer of the extension's SQL API.

Several worker processes, each with connections of its own, draw calls of
every SQL function of the extension with Hypothesis (idem_claim, idem_finish,
idem_extend, idem_release, idem_checkpoint, idem_claim_many,
idem_finish_many, idem_claim_abandoned, idem_lookup, idem_forget,
idem_sweep, idem_version, stats_reset, bind_scope, unbind_scope,
distribute, the stats and cluster_stats views), remember among the
intervals of the claim and the two finishes, keep_request (true, false,
NULL or left out) among the claim's arguments, with requests of every size
up to past idempotency.max_response_size, and idem_claim_abandoned's
max_keys among NULL, 0, -1, 1, 2, 10, 10000, 10001 and 2^31-1:
NULLs, empty and 254..256-character keys, odd Unicode (combining marks,
right-to-left marks, emoji, U+FFFF, U+10FFFF), NUL and invalid UTF-8 sent as
bytes, zero, negative, sub-microsecond, over-10,000-year and infinite
intervals, huge and deeply nested jsonb, arrays with NULLs, of mismatched
lengths or of two dimensions, the keys' real and stale tokens next to random
and extreme ones (0, -1, 2^63-1, -2^63), keys in every state (remembered
ones too: finished with remember, then aged past their retention by the
superuser, compacted by a sweep or not yet, or past their remember as
well; abandoned ones: claimed with keep_request and a request and
checkpointed, then their lease ended (moved into the past by the
superuser), and reset by a sweep or not yet, so that idem_claim_abandoned
finds keys to take in the worker's own scope besides those whose lease or
session ended).  Half of the workers' sessions set idempotency.remember, so that
claims without the argument and idem_claim_many remember their keys too.
idem_forget is also called as fuzz_plain, a role without the grant.  Each call runs
in one of: autocommit, an explicit transaction (committed or rolled back), a
READ ONLY transaction, a savepoint rolled back to, a transaction with a 1-5 ms
statement_timeout, a REPEATABLE READ transaction.

Properties:
  P1 no connection is lost and the postmaster never restarts;
  P2 every error's SQLSTATE is one docs/api.md documents for that function
     (57014 under a statement_timeout, 40001 under REPEATABLE READ, 25006 in
     a READ ONLY transaction, 22021 for text sent as invalid bytes);
  P3 a call that failed, or whose transaction or savepoint rolled back,
     changed no row of the keys it names, in the worker's own scope (no
     other worker touches it; the background worker may, and what it may do
     is told apart: delete a key past its retention, reset a pending one's
     token, compact a remembered key (its response and recovery point go,
     the rest stays), move sweep_at); idem_claim_abandoned names every key
     of its scope, and one that succeeded changed none but those it
     returned;
  P4 in a READ ONLY transaction every function that writes fails, with
     25006 unless its arguments are bad (they are checked first);
  P5 (--amcheck) idempotency.keys and its indexes pass amcheck;
  P6 the answers agree with the API reference and with the keys of the
     worker's own scope: a claim's outcome is one of the five documented,
     an expired one has only status and response_code filled and names a
     finished key remembered past its retention; idem_lookup shows a key
     past its retention only while it is remembered, and then without its
     response and phase; idem_forget answers true or false, true only for
     a key finished before the call and absent after it, false never for a
     key that was live or remembered all through the call, 55000 only for
     a pending one; fuzz_plain is always refused; idem_claim raises 54000
     only with keep_request true and a request over
     idempotency.max_response_size, and always then (unless another error
     comes first); after a claimed answer the key keeps the request sent
     (a fresh claim, or a takeover with keep_request: none without it) or
     the one it kept (a takeover without keep_request), and after
     idem_finish or idem_finish_many none; idem_claim_abandoned returns at
     most max_keys rows, of distinct keys, in non-decreasing order of their
     lease's end, each of a key abandoned before the call (pending, within
     its retention, reset or past its lease, or bound to a session that
     ended), as a takeover: attempt + 1, a token larger than the key's
     earlier ones, the request it kept and its recovery point, and after
     the call the key is pending under that token, bound to no session,
     with a lease of the one asked for and its request and recovery point
     unchanged;
  P7 a remember that is negative or longer than 10000 years is refused.

Each worker records a failure and goes on instead of raising: the table
moves under the test, so a shrunk example would not replay the same state.
The time budget (--minutes) decides how long it runs; the summary counts
calls and errors per function, properties checked and failures, and the exit
status is 1 on any failure.  Connects as fuzz_app / fuzz_tenant and
fuzz_plain (made by test/fuzz/setup.sql) and as postgres to read the table,
to age the remembered and abandoned keys and to sweep them.
"""

import argparse
import collections
import hashlib
import json
import multiprocessing
import os
import random
import sys
import tempfile
import time
import traceback

# Hypothesis keeps a directory of its own; not in the tree this runs from
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY",
                      os.path.join(tempfile.gettempdir(), "idempotency-fuzz-hypothesis"))

import psycopg  # noqa: E402 - after the setting above
from psycopg.types.string import TextLoader  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings, strategies as st  # noqa: E402
from hypothesis import seed as hypothesis_seed  # noqa: E402

# --------------------------------------------------------------------------
# The documented SQLSTATEs (docs/api.md, "Errors and SQLSTATEs").
# --------------------------------------------------------------------------
BAD_ARGS = {"22004", "22023", "22001"}
TOKEN_STATES = {"P0002", "55000", "55006", "55P03"}
# idem_claim's 54000 is allowed only for a request kept over the limit
# (check_error)
ALLOWED = {
    "idem_claim": BAD_ARGS | {"42501"},
    "idem_claim_many": BAD_ARGS | {"42501"},
    "idem_claim_abandoned": BAD_ARGS | {"42501"},
    "idem_finish": BAD_ARGS | TOKEN_STATES | {"54000", "40P01", "42501"},
    "idem_finish_many": BAD_ARGS | TOKEN_STATES | {"54000", "40P01", "42501"},
    "idem_extend": BAD_ARGS | TOKEN_STATES | {"40P01", "42501"},
    "idem_release": BAD_ARGS | TOKEN_STATES | {"42501"},
    "idem_checkpoint": BAD_ARGS | TOKEN_STATES | {"54000", "42501"},
    "idem_lookup": BAD_ARGS | {"42501"},
    "idem_forget": BAD_ARGS | {"55000", "55P03", "42501"},
    "idem_sweep": {"22023", "42501"},
    "idem_version": set(),
    "stats": set(),
    "cluster_stats": set(),
    "stats_reset": {"42501"},
    "bind_scope": {"42501"},
    "unbind_scope": {"42501"},
    # no Citus here: 55000 with a hint
    "distribute": {"55000", "42501", "22023"},
}
# What a bound tenant may always meet: a scope outside its prefix, or a
# function not granted to it.
TENANT_ONLY = {"42501"}
# The functions each role calls without EXECUTE on them: 42501 always.
# fuzz_app has EXECUTE on every function; the tenant has idem_forget, so
# that its calls reach the tenant binding, and idem_claim_abandoned as
# PUBLIC has it; fuzz_plain calls only idem_forget.
NOT_GRANTED = {
    "fuzz_app": set(),
    "fuzz_tenant": {"bind_scope", "unbind_scope", "stats_reset", "distribute", "idem_sweep"},
    "fuzz_plain": {"idem_forget"},
}
# Functions that write: refused in a READ ONLY transaction (P4).  Not
# stats_reset: it zeroes only shared-memory counters, as pg_stat_reset does.
WRITERS = {"idem_claim", "idem_claim_many", "idem_claim_abandoned",
           "idem_finish", "idem_finish_many",
           "idem_extend", "idem_release", "idem_checkpoint", "idem_forget", "idem_sweep",
           "bind_scope", "unbind_scope", "distribute"}
# They read through the snapshot, or no table: no serialization failure.
READERS = {"idem_lookup", "idem_version", "stats", "cluster_stats", "stats_reset"}
# The SQLSTATEs of a lost connection or a server going down.
CONNECTION_LOST = {"57P01", "57P02", "57P03", "08006", "08003", "08000"}

FUNCTIONS = sorted(ALLOWED)
STATES = ["pending", "lease-ended", "checkpointed", "succeeded", "failed",
          "released", "retention-passed", "session-live", "session-ended",
          "claimed-in-batch", "remembered-compacted", "remembered", "remember-passed",
          "abandoned-kept", "abandoned-reset"]
# The remembered keys' states: the request they were claimed with (a
# JSON_KINDS choice), their remember, how long ago their retention passed
# (moved back by the superuser), and whether a sweep compacts them at once
# (the background worker compacts "remembered" within a second or so, too;
# until then its response and recovery point are still stored).
# "remember-passed" is absent: its remember ended too.
REMEMBERED_STATES = {
    "remembered-compacted": ("null-sql", "1 day", "1 second", True),
    "remembered": ("null-sql", "1 day", "1 second", False),
    "remember-passed": ("small", "1 second", "1 hour", False),
}
# The abandoned keys' states: claimed with keep_request, the request a
# drawn claim sends most often after none ("small"), so that drawn claims
# take them over too, with keep_request or without; checkpointed; then
# their lease moved that far into the past by the superuser; reset by a
# sweep at once, or left to the background worker.
ABANDONED_STATES = {
    "abandoned-kept": ("small", "1 minute", False),
    "abandoned-reset": ("small", "2 minutes", True),
}
CONTEXTS = ["autocommit", "commit", "rollback", "readonly", "savepoint",
            "timeout", "repeatable_read"]
OMIT = object()  # an argument left out: its default applies
# what idem_claim_abandoned names: every key of its scope
ALL_KEYS = "all keys of the scope"

# --------------------------------------------------------------------------
# Strategies: abstract choices, resolved against the worker's keys at run
# time (a key's token exists only once it has been claimed).
# --------------------------------------------------------------------------
ODD = ["\u0301", "\u200f", "\u202e", "\U0001F600", "\uffff", "\U0010FFFF",
       "'", '"', "\\", "%", "\n", "\t", " ", "é", "ß", "\u05d0", "\ufeff"]
odd_text = st.text(alphabet=st.one_of(
    st.sampled_from(ODD),
    st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")),
    max_size=40)


def sized(n):
    """A text of exactly n characters, multi-byte ones included."""
    return st.sampled_from(["x", "é", "\U0001F600", "\u0301"]).map(lambda c: c * n)


texts = st.one_of(odd_text, st.sampled_from(["", "%s%n%x", "' OR 1=1 --", "\u202eevil"]),
                  sized(254), sized(255), sized(256), sized(300))
# ('own', i): a key of the worker's own scope in state STATES[i % n];
# ('shared', i): one of the keys every worker uses; ('new', text): a key
# nobody claimed; ('raw', bytes): text sent as bytes, NUL or bad UTF-8 in it.
key_choice = st.one_of(
    st.tuples(st.just("own"), st.integers(0, 1000)),
    st.tuples(st.just("own"), st.integers(0, 1000)),
    st.tuples(st.just("own"), st.integers(0, 1000)),
    # the remembered ones once more: few calls would meet them otherwise
    st.tuples(st.just("own"), st.sampled_from([STATES.index(s) for s in REMEMBERED_STATES])),
    # and the abandoned ones: claims take them over, with keep_request or not
    st.tuples(st.just("own"), st.sampled_from([STATES.index(s) for s in ABANDONED_STATES])),
    st.tuples(st.just("shared"), st.integers(0, 7)),
    st.tuples(st.just("new"), texts),
    st.just(("null",)),
    st.tuples(st.just("raw"), st.sampled_from([b"a\x00b", b"\xff\xfe", b"\xc3", b"ok"])),
)
scope_choice = st.one_of(
    st.just(("own",)), st.just(("own",)), st.just(("own",)),
    st.just(("shared",)), st.just(("seed",)), st.just(("tenant",)),
    st.just(("null",)), st.tuples(st.just("new"), texts),
)
token_choice = st.one_of(
    st.just(("current",)), st.just(("current",)), st.just(("stale",)),
    st.just(("null",)),
    st.tuples(st.just("int"), st.sampled_from([0, -1, 1, 2**63 - 1, -2**63])),
    st.tuples(st.just("int"), st.integers(-2**63, 2**63 - 1)),
)
INTERVALS = ["1 millisecond", "1 microsecond", "0.4 microseconds", "0", "-1 second",
             "1 second", "30 seconds", "1 hour", "1 day", "1 mon", "9999 years",
             "10000 years", "10001 years", "177000000 years", "-177000000 years",
             "infinity", "-infinity", "1 year -1 second"]
# valid values are drawn as often as hostile ones, so that calls also get
# past the argument checks to the keys
SANE_INTERVALS = ["1 hour", "30 seconds", "1 millisecond", "1 day"]
interval = st.one_of(st.just(None), st.sampled_from(INTERVALS), st.sampled_from(SANE_INTERVALS))
# remember takes 0 (off) besides; a long one next to a retention of a
# millisecond makes a key remembered within the run
remembers = st.one_of(st.just(None), st.sampled_from(INTERVALS),
                      st.sampled_from(["0", "1 day", "1 hour", "1 second"]))
# the remembers that must be refused (22023) as sent: negative, or longer than
# 10000 years ("infinity" is sent as itself from PostgreSQL 17 on only, and
# "-1 hour" stands in for "-infinity" before)
BAD_REMEMBERS = {"-1 second", "-177000000 years", "10001 years", "177000000 years",
                 "infinity", "-infinity", "-1 hour"}
CLAIM_OUTCOMES = {"claimed", "replay", "in_progress", "mismatch", "expired"}
# a wait never longer than 50 ms: a worker must not sit on a shared key's lease
waits = st.one_of(st.just(None), st.sampled_from(
    ["0", "1 millisecond", "50 milliseconds", "-1 second", "-infinity"]))
JSON_KINDS = ["null-sql", "json-null", "small", "object", "unicode", "nested100",
              "nested10000", "huge", "limit-edge", "limit-at", "number-scale"]
jsonb = st.one_of(st.sampled_from(JSON_KINDS), st.sampled_from(["small", "null-sql"]))
statuses = st.one_of(st.just(None), st.sampled_from(
    ["succeeded", "failed", "", "SUCCEEDED", "succeeded ", "pending", "fail"]), odd_text,
    st.sampled_from(["succeeded", "failed"]), st.sampled_from(["succeeded", "failed"]))
phases = st.one_of(st.just(None), st.just("step-1"), st.just("step-2"), texts)
int4 = st.one_of(st.just(None), st.sampled_from([0, -1, 200, 2**31 - 1, -2**31]),
                 st.integers(-2**31, 2**31 - 1))
bools = st.sampled_from([None, True, False, False])
# idem_claim_abandoned's max_keys: the bounds (1 and 10000) either side,
# and valid counts as often again
max_keys = st.one_of(st.sampled_from([None, 0, -1, 1, 2, 10, 10000, 10001, 2**31 - 1]),
                     st.sampled_from([1, 2, 10]))


def arg(strategy):
    """An argument that is sometimes left out (its default applies)."""
    return st.one_of(st.just(OMIT), strategy, strategy)


def batch(of):
    """A batch argument: NULL, empty, a list (NULL elements possible), 2-D."""
    return st.one_of(
        st.just(None), st.just([]),
        st.lists(st.one_of(of, of, of, st.just(("null",))), min_size=1, max_size=6),
        st.tuples(st.just("2d"), st.lists(of, min_size=2, max_size=2)),
    )


CALLS = {
    "idem_claim": st.fixed_dictionaries({
        "key": key_choice, "request": arg(jsonb), "scope": arg(scope_choice),
        "lease": arg(interval), "retention": arg(interval), "wait": arg(waits),
        "session_bound": arg(bools), "remember": arg(remembers),
        "keep_request": arg(bools)}),
    "idem_finish": st.fixed_dictionaries({
        "key": key_choice, "token": token_choice, "response_code": arg(int4),
        "response_body": arg(jsonb), "scope": arg(scope_choice), "status": arg(statuses),
        "retention": arg(interval), "remember": arg(remembers)}),
    "idem_extend": st.fixed_dictionaries({
        "key": key_choice, "token": token_choice, "lease": arg(interval),
        "scope": arg(scope_choice)}),
    "idem_release": st.fixed_dictionaries({
        "key": key_choice, "token": token_choice, "scope": arg(scope_choice)}),
    "idem_checkpoint": st.fixed_dictionaries({
        "key": key_choice, "token": token_choice, "phase": phases,
        "data": arg(jsonb), "scope": arg(scope_choice)}),
    "idem_claim_many": st.fixed_dictionaries({
        "keys": batch(key_choice), "requests": arg(batch(jsonb)),
        "scope": arg(scope_choice), "lease": arg(interval), "retention": arg(interval),
        "session_bound": arg(bools)}),
    "idem_finish_many": st.fixed_dictionaries({
        "keys": batch(key_choice), "tokens": batch(token_choice),
        "response_codes": arg(batch(int4)), "response_bodies": arg(batch(jsonb)),
        "scope": arg(scope_choice), "status": arg(statuses), "retention": arg(interval),
        "remember": arg(remembers)}),
    "idem_claim_abandoned": st.fixed_dictionaries({
        "scope": arg(scope_choice), "max_keys": arg(max_keys), "lease": arg(interval)}),
    "idem_lookup": st.fixed_dictionaries({"key": key_choice, "scope": arg(scope_choice)}),
    # as_plain: called as fuzz_plain, which has no EXECUTE on it
    "idem_forget": st.fixed_dictionaries({
        "key": key_choice, "scope": arg(scope_choice),
        "as_plain": st.sampled_from([False, False, False, False, True])}),
    "idem_sweep": st.fixed_dictionaries({"batch_size": arg(st.one_of(
        st.just(None), st.sampled_from([0, -1, 1, 10, 1000, 2**31 - 1])))}),
    "idem_version": st.just({}),
    "stats": st.just({}),
    "cluster_stats": st.just({}),
    "stats_reset": st.just({}),
    # the tenant's role is bound only to prefixes of its workers' scopes
    # (or unbound), so that its worker keeps reaching its own keys
    "bind_scope": st.one_of(
        st.fixed_dictionaries({"role": st.just("fuzz_nobody"),
                               "scope_prefix": st.one_of(st.just(None), texts)}),
        st.fixed_dictionaries({"role": st.just("fuzz_tenant"),
                               "scope_prefix": st.sampled_from(["tenant:", "tenant:w", "", None])})),
    "unbind_scope": st.fixed_dictionaries({
        "role": st.sampled_from(["fuzz_nobody", "fuzz_tenant"])}),
    "distribute": st.fixed_dictionaries({"shard_count": arg(int4)}),
}
# the key functions are drawn more often than the rest
WEIGHTED = (["idem_claim"] * 6 + ["idem_finish"] * 5 + ["idem_extend"] * 3 +
            ["idem_release"] * 3 + ["idem_checkpoint"] * 3 + ["idem_claim_many"] * 3 +
            ["idem_finish_many"] * 3 + ["idem_claim_abandoned"] * 3 +
            ["idem_lookup"] * 2 + ["idem_forget"] * 3 +
            ["idem_sweep"] +
            [f for f in FUNCTIONS if not f.startswith("idem_")] + ["idem_version"])
call_strategy = st.sampled_from(WEIGHTED).flatmap(
    lambda fn: st.tuples(st.just(fn), CALLS[fn]))
context_strategy = st.tuples(st.sampled_from(CONTEXTS), st.integers(1, 5))


# --------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------
def nested(depth):
    return "[" * depth + "1" + "]" * depth


JSON_CACHE = {}


def json_text(kind, max_size):
    """The jsonb text of a JSON_KINDS choice (None: SQL NULL)."""
    if kind == "null-sql":
        return None
    if kind not in JSON_CACHE:
        JSON_CACHE[kind] = {
            "json-null": "null",
            "small": '{"amount": 100}',
            "object": '{"b": [1, 2, {"c": null}], "a": "x"}',
            "unicode": json.dumps({"k\u0301": "\U0001F600\u202e\uffff", "": ""}),
            "nested100": nested(100),
            "nested10000": nested(10000),
            "huge": json.dumps({"blob": "x" * (max_size + 1000)}),
            # within a few bytes of the limit: under it as text, 2 bytes
            # over it as the server measures a jsonb
            "limit-edge": json.dumps({"blob": "y" * (max_size - 14)}),
            # exactly the limit as the server measures it (16 bytes of
            # jsonb around the string): the largest accepted
            "limit-at": json.dumps({"blob": "z" * (max_size - 16)}),
            "number-scale": '{"amount": 100.0}',
        }[kind]
    return JSON_CACHE[kind]


class Failure(Exception):
    pass


class Worker:
    """One worker process: its connections, its keys, its tallies."""

    def __init__(self, idx, opts):
        self.idx = idx
        self.opts = opts
        self.role = "fuzz_tenant" if idx == opts.workers - 1 and opts.workers > 1 else "fuzz_app"
        self.own_scope = f"tenant:w{idx}" if self.role == "fuzz_tenant" else f"w{idx}"
        self.conn = self.connect(self.role)
        self.su = self.connect("postgres")   # reads the table for P3
        self.side = self.connect(self.role)  # holds live session-bound claims
        self.plain = self.connect("fuzz_plain")  # calls idem_forget without the grant
        self.acting = self.role  # the role of the call being run
        self.max_size = self.response_limit()
        self.over_limit = {}     # JSON_KINDS choice -> over max_response_size
        # the lease of a claim without one, as the worker's sessions have it
        self.lease_setting = self.conn.execute("SHOW idempotency.lease").fetchone()[0]
        self.pg_version = self.su.execute("SHOW server_version_num").fetchone()[0]
        self.started = self.ended = None
        self.tokens = {}         # (scope, key) -> [tokens, newest last]
        self.own = []            # own keys, one per STATES entry of a generation
        self.generation = 0
        self.calls = collections.Counter()
        self.ok = collections.Counter()
        self.errors = collections.defaultdict(collections.Counter)
        self.outcomes = collections.defaultdict(collections.Counter)
        self.contexts = collections.Counter()
        self.checked = collections.Counter()
        self.failures = []       # the first of each kind, with its call
        self.failure_count = collections.Counter()
        self.examples = 0
        self.make_states()

    def response_limit(self):
        row = self.su.execute("SELECT setting, unit FROM pg_catalog.pg_settings "
                              "WHERE name = 'idempotency.max_response_size'").fetchone()
        mult = {"B": 1, "kB": 1024, "MB": 1024 ** 2}.get(row[1], 1)
        return int(row[0]) * mult

    def connect(self, user):
        # no drawn call waits longer than 50 ms: one that still runs after a
        # minute is a finding (57014 outside a timed transaction), not a hung run
        options = "-c statement_timeout=60s"
        if user == self.role and self.idx % 2 == 1:
            # claims without a remember argument take the setting, and
            # idem_claim_many has no argument: half of the workers remember
            # such keys for an hour, the other half not at all (the default)
            options += " -c idempotency.remember=3600"
        conn = psycopg.connect(host=self.opts.host, port=self.opts.port,
                               dbname=self.opts.dbname, user=user, autocommit=True,
                               application_name=f"fuzz-properties-{self.idx}",
                               options=options)
        # times past year 9999 (a retention of 9999 years) are valid in
        # PostgreSQL and not in Python, and a 10,000-level jsonb is too deep
        # for Python's json: results are read as text
        for typ in ("timestamptz", "timestamp", "interval", "json", "jsonb"):
            conn.adapters.register_loader(typ, TextLoader)
        return conn

    # -- keys in every state, in the worker's own scope ----------------------
    def make_states(self):
        """Claim a new generation of own keys, one in each state."""
        g = self.generation
        self.generation += 1
        s = self.own_scope
        keys = []
        c = self.conn
        for state in STATES:
            k = f"{self.opts.run_id}-g{g}-{state}"
            keys.append(k)
            if state == "session-live":
                tok = self.claim_token(self.side, k, "'1 hour'", True)
            elif state == "session-ended":
                tmp = self.connect(self.role)
                tok = self.claim_token(tmp, k, "'1 hour'", True)
                tmp.close()
            elif state == "claimed-in-batch":
                tok = c.execute("SELECT token FROM idempotency.idem_claim_many(%s, scope => %s)",
                                ([k], s)).fetchone()[0]
            elif state in ABANDONED_STATES:
                tok = c.execute(
                    "SELECT token FROM idempotency.idem_claim(%s, %s::jsonb, %s, '1 hour', "
                    "remember => '0', keep_request => true)",
                    (k, json_text(ABANDONED_STATES[state][0], self.max_size), s)).fetchone()[0]
            elif state in REMEMBERED_STATES:
                # with the request a drawn claim sends most often (none),
                # or the most frequent payload ("small"), so that drawn
                # claims meet it as expired, not only as mismatch
                request = json_text(REMEMBERED_STATES[state][0], self.max_size)
                tok = self.claim_token(c, k, "'1 hour'", False, request)
            else:
                lease = "'1 millisecond'" if state == "lease-ended" else "'1 hour'"
                tok = self.claim_token(c, k, lease, False)
            self.remember(s, k, tok)
            if state == "checkpointed":
                c.execute("SELECT idempotency.idem_checkpoint(%s, %s, 'step-1', '{\"id\": 1}', %s)",
                          (k, tok, s))
            elif state in ("succeeded", "failed"):
                c.execute("SELECT idempotency.idem_finish(%s, %s, 200, '{}', %s, %s)",
                          (k, tok, s, state))
            elif state == "released":
                c.execute("SELECT idempotency.idem_release(%s, %s, %s)", (k, tok, s))
            elif state == "retention-passed":
                c.execute("SELECT idempotency.idem_finish(%s, %s, scope => %s, "
                          "retention => '1 millisecond')", (k, tok, s))
            elif state in REMEMBERED_STATES:
                self.age_remembered(k, tok, *REMEMBERED_STATES[state][1:])
            elif state in ABANDONED_STATES:
                self.abandon(k, tok, *ABANDONED_STATES[state][1:])
        self.own = keys

    def abandon(self, key, token, ago, reset):
        """Make own key <key> what an attempt leaves that dies after a
        checkpoint: its lease (and its sweep_at with it) moved <ago> into
        the past, its retention still running.  With <reset>, sweep until a
        sweep reset it (its token is NULL); a few tries, since a sweep takes
        a batch of the due keys at a time and skips busy ones."""
        c, s = self.conn, self.own_scope
        c.execute("SELECT idempotency.idem_checkpoint(%s, %s, 'step-2', '{\"resume\": 2}', %s)",
                  (key, token, s))
        self.su.execute(
            "UPDATE idempotency.keys SET lease_until = pg_catalog.clock_timestamp() - %s::interval,"
            " sweep_at = pg_catalog.clock_timestamp() - %s::interval"
            " WHERE scope = %s AND key = %s", (ago, ago, s, key))
        for _ in range(5 if reset else 0):
            self.su.execute("SELECT * FROM idempotency.idem_sweep()")
            if self.su.execute("SELECT token FROM idempotency.keys WHERE scope = %s AND key = %s",
                               (s, key)).fetchone() != (token,):
                break

    def age_remembered(self, key, token, remember, age, compact):
        """Finish own key <key> (with a recovery point and a response, which
        a compaction drops) to be remembered for <remember>, then move all
        of its times back so that its retention passed <age> ago: the row a
        key finished that long ago has, due for the sweep.  With <compact>,
        sweep until a sweep compacted it (a compacted row's sweep_at is past
        its expires_at); a few tries, since a sweep takes a batch of the
        due keys at a time and skips busy ones."""
        c, s = self.conn, self.own_scope
        c.execute("SELECT idempotency.idem_checkpoint(%s, %s, 'step-1', '{\"id\": 1}', %s)",
                  (key, token, s))
        c.execute("SELECT idempotency.idem_finish(%s, %s, 201, '{\"kept\": true}', %s, "
                  "remember => %s::interval)", (key, token, s, remember))
        self.su.execute(
            "UPDATE idempotency.keys k SET created_at = k.created_at - d.shift,"
            " finished_at = k.finished_at - d.shift, lease_until = k.lease_until - d.shift,"
            " expires_at = k.expires_at - d.shift, sweep_at = k.expires_at - d.shift"
            " FROM (SELECT k2.expires_at - pg_catalog.clock_timestamp() + %s::interval"
            "       AS shift FROM idempotency.keys k2 WHERE k2.scope = %s AND k2.key = %s) d"
            " WHERE k.scope = %s AND k.key = %s", (age, s, key, s, key))
        for _ in range(5 if compact else 0):
            self.su.execute("SELECT * FROM idempotency.idem_sweep()")
            if self.su.execute("SELECT sweep_at > expires_at FROM idempotency.keys"
                               " WHERE scope = %s AND key = %s", (s, key)).fetchone() != (False,):
                break

    def claim_token(self, conn, key, lease, bound, request='{"n": 1}'):
        return conn.execute(
            f"SELECT token FROM idempotency.idem_claim(%s, %s::jsonb, %s, {lease}, "
            "session_bound => %s, remember => '0')",
            (key, request, self.own_scope, bound)).fetchone()[0]

    def remember(self, scope, key, token):
        if token is not None and isinstance(scope, str) and isinstance(key, str):
            self.tokens.setdefault((scope, key), []).append(token)

    # -- resolving the drawn choices -----------------------------------------
    def scope_value(self, choice):
        kind = choice[0]
        return {"own": self.own_scope, "shared": "shared", "seed": "seed",
                "tenant": "tenant:seed", "null": None}.get(kind, choice[-1])

    def key_value(self, choice, scope):
        kind = choice[0]
        if kind == "own":
            return (self.own[choice[1] % len(self.own)] if scope == self.own_scope
                    else f"seed-{STATES[choice[1] % len(STATES)]}")
        if kind == "shared":
            return f"sh-{choice[1]}"
        if kind == "null":
            return None
        if kind == "raw":
            return Raw(choice[1])
        return choice[1]

    def batch_key_value(self, choice, scope):
        """A key of a batch: text only (an array element is no call argument)."""
        key = self.key_value(choice, scope)
        if isinstance(key, Raw):
            return key.data.decode("utf-8", "replace").replace("\x00", "?")
        return key

    def token_value(self, choice, scope, key):
        kind = choice[0]
        known = self.tokens.get((scope, key), [])
        if kind == "current":
            return known[-1] if known else random.getrandbits(20)
        if kind == "stale":
            # the key's token before its newest, or one it never had
            return known[-2] if len(known) > 1 else (known[0] - 1 if known else 1)
        if kind == "null":
            return None
        return choice[1]

    def json_value(self, kind):
        return json_text(kind, self.max_size)

    def interval_value(self, v):
        # infinite intervals exist from PostgreSQL 17 on; before, the text
        # would fail in the cast, not in the function.  The stand-ins keep
        # the sign: "-infinity" is drawn as a wait too, and a positive one
        # there would wait for a held key's whole lease.
        if v in ("infinity", "-infinity") and int(self.pg_version) < 170000:
            return "1 hour" if v == "infinity" else "-1 hour"
        return v

    # -- building the statement ----------------------------------------------
    def build(self, fn, a):
        """The SQL text, its parameters, and what the call touches."""
        if fn in ("stats", "cluster_stats"):
            return f"SELECT * FROM idempotency.{fn}", [], None, []
        if fn in ("idem_version", "stats_reset"):
            return f"SELECT idempotency.{fn}()", [], None, []
        if fn in ("bind_scope", "unbind_scope"):
            args = [("role", a["role"], "regrole")]
            if fn == "bind_scope":
                args.append(("scope_prefix", a["scope_prefix"], "text"))
            return self.statement(fn, args, scalar=True) + (None, [])
        if fn == "distribute":
            return self.statement(fn, self.present(a, [("shard_count", "int4")]),
                                  scalar=True) + (None, [])
        if fn == "idem_sweep":
            return self.statement(fn, self.present(a, [("batch_size", "int4")])) + (None, [])

        scope = self.scope_value(a["scope"]) if a.get("scope", OMIT) is not OMIT else ""
        args = []
        touched = []
        if "key" in a:
            key = self.key_value(a["key"], scope)
            args.append(("key", key, "text"))
            touched.append(key)
        if "keys" in a:
            keys = self.batch_value(a["keys"], lambda c: self.batch_key_value(c, scope))
            args.append(("keys", keys, "text[]"))
            touched.extend(flatten(keys))
        if "token" in a:
            args.append(("token", self.token_value(a["token"], scope, touched[0]), "int8"))
        if "tokens" in a:
            toks = []
            keys_list = flatten(keys) if isinstance(keys, list) else []
            for i, c in enumerate(flatten_choices(a["tokens"])):
                k = keys_list[i] if i < len(keys_list) else None
                toks.append(None if c == ("null",) else self.token_value(c, scope, k))
            args.append(("tokens", self.reshape(a["tokens"], toks), "int8[]"))
        for name, typ in [("request", "jsonb"), ("response_code", "int4"),
                          ("response_body", "jsonb"), ("data", "jsonb"),
                          ("requests", "jsonb[]"), ("response_codes", "int4[]"),
                          ("response_bodies", "jsonb[]"), ("phase", "text"),
                          ("lease", "interval"), ("retention", "interval"),
                          ("wait", "interval"), ("status", "text"),
                          ("session_bound", "bool"), ("remember", "interval"),
                          ("keep_request", "bool"), ("max_keys", "int4")]:
            v = a.get(name, OMIT)
            if v is OMIT:
                continue
            if typ == "jsonb":
                v = self.json_value(v)
            elif typ == "jsonb[]":
                v = self.batch_value(v, self.json_value)
            elif typ == "int4[]":
                v = self.batch_value(v, lambda x: x)
            elif typ == "interval" and v is not None:
                v = self.interval_value(v)
            args.append((name, v, typ))
        if a.get("scope", OMIT) is not OMIT:
            args.append(("scope", scope, "text"))
        sql, params = self.statement(fn, args)
        if fn == "idem_claim_abandoned":
            touched = ALL_KEYS
        return sql, params, scope, touched

    def batch_value(self, v, each):
        if v is None or v == []:
            return v
        if isinstance(v, tuple) and v[0] == "2d":
            return [[None if c == ("null",) else each(c)] * 2 for c in v[1]]
        return [None if c == ("null",) else each(c) for c in v]

    @staticmethod
    def reshape(choice, values):
        if choice is None:
            return None
        if isinstance(choice, tuple) and choice[0] == "2d":
            return [[x, x] for x in values]
        return values

    @staticmethod
    def present(a, names):
        return [(n, a[n], t) for n, t in names if a.get(n, OMIT) is not OMIT]

    @staticmethod
    def statement(fn, args, scalar=False):
        parts, params = [], []
        for name, value, typ in args:
            if isinstance(value, Raw):
                # text sent as bytes: the server's conversion must refuse it
                parts.append(f"{name} => pg_catalog.convert_from(%s::bytea, 'UTF8')")
                params.append(value.data)
            else:
                parts.append(f"{name} => %s::{typ}")
                params.append(value)
        call = f"idempotency.{fn}({', '.join(parts)})"
        return (f"SELECT {call}" if scalar else f"SELECT * FROM {call}"), params

    # -- P3: the rows of the keys a call names --------------------------------
    def snapshot(self, scope, keys):
        """The rows of the keys <keys> (or ALL_KEYS) of scope <scope>, if it
        is the worker's own, by key, and the keys named (ALL_KEYS kept)."""
        if scope != self.own_scope:
            return None
        names = keys if keys is ALL_KEYS else [k for k in keys if isinstance(k, str)]
        if not names:
            return None
        # compared as text: a 10,000-level jsonb is too deep for Python's
        # json; a long one as its start and md5, since every key of a scope
        # may hold a response or a request near max_response_size
        rows = self.su.execute(
            SNAPSHOT_SQL + ("" if names is ALL_KEYS else " AND k.key = ANY(%s)"),
            (scope,) if names is ALL_KEYS else (scope, names)).fetchall()
        return {r[0]: Row(*r[1:]) for r in rows}, names

    def compare(self, before, why, sql, params, skip=frozenset()):
        rows, names = before
        after, _ = self.snapshot(self.own_scope, names)
        if names is ALL_KEYS:
            # a key that appeared is a change too
            names = sorted(set(rows) | set(after))
        self.checked["P3 row unchanged"] += 1
        for k in names:
            if k in skip:
                continue
            b, a = rows.get(k), after.get(k)
            if b == a:
                continue
            if b is not None and a is None and self.su.execute(
                    "SELECT %s::timestamptz <= pg_catalog.clock_timestamp()",
                    (b.expires_at,)).fetchone()[0]:
                continue  # the worker deleted it: its retention had passed
            if (b is not None and a is not None and b.status == "pending"
                    and a.token is None and a.rest == b.rest):
                continue  # the worker reset it: its lease or session had ended
            if (b is not None and a is not None and b.status in ("succeeded", "failed")
                    and a.compact and a.core == b.core and self.su.execute(
                        "SELECT %s::timestamptz <= pg_catalog.clock_timestamp()",
                        (b.expires_at,)).fetchone()[0]):
                continue  # a sweep compacted it: remembered past its retention
            self.fail("P3", f"a call that {why} changed the row of key {k!r}",
                      sql, params, extra=f"before: {short(b)}\n   after:  {short(a)}")

    # -- running one drawn call ----------------------------------------------
    def run(self, call, context):
        fn, a = call
        ctx, ms = context
        self.examples += 1
        if self.examples % 300 == 0:
            self.make_states()
        sql, params, scope, touched = self.build(fn, a)
        self.calls[fn] += 1
        self.contexts[ctx] += 1
        before = self.snapshot(scope, touched)
        # a lookup is judged by what it could know at the start of the call,
        # idem_claim_abandoned by when its call may have looked at the keys
        timed = fn in ("idem_lookup", "idem_claim_abandoned")
        self.started = (self.su.execute("SELECT pg_catalog.clock_timestamp()").fetchone()[0]
                        if timed else None)
        plain = bool(a.get("as_plain")) if isinstance(a, dict) else False
        c = self.plain if plain else self.conn
        self.acting = "fuzz_plain" if plain else self.role
        rows, state, rolled_back = None, None, ctx in ("rollback", "readonly", "savepoint")
        try:
            if ctx != "autocommit":
                c.execute({"readonly": "BEGIN READ ONLY",
                           "repeatable_read": "BEGIN ISOLATION LEVEL REPEATABLE READ"}
                          .get(ctx, "BEGIN"))
            if ctx == "savepoint":
                c.execute("SAVEPOINT fuzz")
            if ctx == "timeout":
                c.execute(f"SET LOCAL statement_timeout = '{ms}ms'")
            if ctx == "repeatable_read":
                c.execute("SELECT 1")  # takes the snapshot before the call
            try:
                rows = c.execute(sql, params).fetchall()
            except psycopg.Error as e:
                state = e.sqlstate
                if lost(c, e) or state is None:
                    raise
            if ctx == "savepoint":
                c.execute("ROLLBACK TO SAVEPOINT fuzz")
            if ctx != "autocommit":
                c.execute("ROLLBACK" if rolled_back or state else "COMMIT")
        except psycopg.Error as e:
            if lost(c, e):
                self.fail("P1", f"connection lost ({e.sqlstate}: {first_line(e)})", sql, params)
                self.reconnect()
                return
            if e.sqlstate is None:
                self.fail("harness", f"client-side error: {first_line(e)}", sql, params)
                if not c.closed:
                    c.rollback()
                return
            # COMMIT itself may fail: a deferred serialization failure
            state = state or e.sqlstate
            c.execute("ROLLBACK")
        self.ended = (self.su.execute("SELECT pg_catalog.clock_timestamp()").fetchone()[0]
                      if timed else None)
        self.check_error(fn, a, ctx, state, sql, params)
        self.check_answer(fn, a, rows, state, rolled_back, before, scope, touched, sql, params)
        if state is None:
            self.ok[fn] += 1
            if not rolled_back:
                self.learn(fn, rows, scope, touched)
        if before is not None and (state is not None or rolled_back):
            self.compare(before, "failed" if state else f"was rolled back ({ctx})", sql, params)

    def check_error(self, fn, a, ctx, state, sql, params):
        raw = any(isinstance(p, bytes) for p in params)
        if ctx == "readonly" and fn in WRITERS and not strict_null(fn, a):
            self.checked["P4 read-only refused"] += 1
            if state is None:
                self.fail("P4", "succeeded in a READ ONLY transaction", sql, params)
            elif state not in {"25006", "54000", "42501", "22021"} | BAD_ARGS:
                self.fail("P4", f"raised {state}, not 25006, in a READ ONLY transaction",
                          sql, params)
        # a request kept over max_response_size: 54000 before anything else
        # is read or written, and only then
        kept_over = (fn == "idem_claim" and a.get("keep_request") is True
                     and self.over(a.get("request", OMIT)))
        if fn == "idem_claim" and state in (None, "54000"):
            self.checked["P6 claim: 54000 only for a request kept over the limit"] += 1
            if state is None and kept_over:
                self.fail("P6", "idem_claim kept a request over idempotency.max_response_size",
                          sql, params)
            elif state == "54000" and not kept_over:
                self.fail("P6", "idem_claim raised 54000 without keep_request => true and a "
                          "request over idempotency.max_response_size", sql, params)
        if state is None:
            if raw and any(b"\x00" in p or b"\xff" in p or p == b"\xc3"
                           for p in params if isinstance(p, bytes)):
                self.fail("P2", "text with a NUL or invalid UTF-8 was accepted", sql, params)
            return
        self.errors[fn][state] += 1
        self.checked["P2 documented SQLSTATE"] += 1
        allowed = set(ALLOWED[fn])
        if self.acting != "fuzz_tenant":
            allowed -= TENANT_ONLY
        if fn in NOT_GRANTED[self.acting]:
            allowed |= TENANT_ONLY  # not granted to this role
        if ctx == "timeout":
            allowed.add("57014")
        if ctx == "readonly" and fn in WRITERS:
            allowed.add("25006")
        if ctx == "repeatable_read" and fn not in READERS:
            allowed.add("40001")
        if raw:
            allowed.add("22021")
        if kept_over:
            allowed.add("54000")
        if state not in allowed:
            self.fail("P2", f"{fn} raised {state}, which docs/api.md does not list for it"
                      f" (context {ctx})", sql, params)

    def check_answer(self, fn, a, rows, state, rolled_back, before, scope, touched,
                     sql, params):
        """P6 and P7: what a call answered, against the API reference and,
        in the worker's own scope, against the key's row (only this worker
        and the sweeps change those: a sweep deletes a key past its
        retention or remember, compacts or resets one, never makes a key
        finished or pending)."""
        if (fn in ("idem_claim", "idem_finish", "idem_finish_many")
                and a.get("remember", OMIT) not in (OMIT, None)
                and self.interval_value(a["remember"]) in BAD_REMEMBERS):
            self.checked["P7 bad remember refused"] += 1
            if state is None:
                self.fail("P7", f"{fn} accepted remember => {a['remember']!r}", sql, params)
        if self.acting == "fuzz_plain":
            self.checked["P6 refused without the grant"] += 1
            if state is None:
                self.fail("P6", f"{fn} ran for a role without EXECUTE on it", sql, params)
        own = scope == self.own_scope and before is not None
        prior = before[0] if own else {}
        if fn == "idem_forget" and state == "55000" and own:
            b = prior.get(touched[0])
            self.checked["P6 forget: 55000 for a pending key"] += 1
            if b is None or b.status != "pending":
                self.fail("P6", "idem_forget raised 55000 for a key that was not pending",
                          sql, params, extra=f"before: {short(b)}")
        if state is not None:
            return
        if fn in ("idem_claim", "idem_claim_many"):
            for r in rows or []:
                ans = r if fn == "idem_claim" else r[2:]
                key = touched[0] if fn == "idem_claim" else r[1]
                self.outcomes[fn][ans[0]] += 1
                self.checked["P6 claim outcome"] += 1
                if ans[0] not in CLAIM_OUTCOMES:
                    self.fail("P6", f"{fn} answered the undocumented outcome {ans[0]!r}",
                              sql, params)
                elif ans[0] == "expired":
                    self.check_expired(fn, ans, key, own, sql, params)
            if (fn == "idem_claim" and own and not rolled_back and rows
                    and rows[0][0] == "claimed" and isinstance(touched[0], str)):
                self.check_kept_request(a, rows[0], touched[0], prior.get(touched[0]),
                                        sql, params)
        elif fn in ("idem_finish", "idem_finish_many"):
            if own and not rolled_back:
                keys = touched[:1] if fn == "idem_finish" else [r[1] for r in rows or []]
                self.check_request_dropped(fn, [k for k in keys if isinstance(k, str)],
                                           sql, params)
        elif fn == "idem_claim_abandoned":
            self.check_abandoned(a, rows or [], scope, before if own else None, rolled_back,
                                 sql, params)
        elif fn == "idem_lookup":
            self.check_lookup(rows, sql, params)
        elif fn == "idem_forget":
            answer = rows[0][0] if rows and len(rows) == 1 else rows
            self.outcomes[fn][str(answer).lower()] += 1
            self.checked["P6 forget answer"] += 1
            b = prior.get(touched[0])
            if answer not in (True, False):
                self.fail("P6", f"idem_forget answered {answer!r}, not true or false",
                          sql, params)
            elif not answer and b is not None and self.su.execute(
                    "SELECT %s::timestamptz > pg_catalog.clock_timestamp()",
                    (b.gone_at,)).fetchone()[0]:
                # it was still there for a claim all through the call
                self.fail("P6", "idem_forget answered false for a key that was "
                          + ("pending (55000)" if b.status == "pending"
                             else "finished, live or remembered (true)"),
                          sql, params, extra=f"before: {short(b)}")
            elif answer and own:
                if b is None or b.status not in ("succeeded", "failed"):
                    self.fail("P6", "idem_forget answered true for a key that was not finished",
                              sql, params, extra=f"before: {short(b)}")
                if not rolled_back and self.su.execute(
                        "SELECT 1 FROM idempotency.keys WHERE scope = %s AND key = %s",
                        (scope, touched[0])).fetchone():
                    self.fail("P6", "idem_forget answered true and the key's row is still there",
                              sql, params)

    def check_lookup(self, rows, sql, params):
        """A lookup's row: remembered_until only for a finished key; past
        its retention at the start of the call, a key is shown only while
        remembered, and then without its response and recovery point."""
        if not rows:
            return
        self.checked["P6 lookup row"] += 1
        (status, _, _, body, _, _, expires_at, phase, until) = rows[0]
        if len(rows) != 1 or (until is not None and status not in ("succeeded", "failed")):
            self.fail("P6", f"idem_lookup answered {rows!r}", sql, params)
            return
        past, remembered = self.su.execute(
            "SELECT %s::timestamptz <= %s::timestamptz, %s::timestamptz > %s::timestamptz",
            (expires_at, self.started, until, self.started)).fetchone()
        if past and not remembered:
            self.fail("P6", "idem_lookup showed a key past its retention and not remembered",
                      sql, params, extra=f"row: {rows[0]!r}")
        elif past and (body is not None or phase is not None):
            self.fail("P6", "idem_lookup showed a remembered key's response or phase",
                      sql, params, extra=f"row: {rows[0]!r}")
        elif past:
            self.checked["P6 lookup of a remembered key"] += 1

    def over(self, kind):
        """Whether the request of JSON_KINDS choice <kind> is over
        idempotency.max_response_size, as the server measures it (the
        bytes of the jsonb, without its header)."""
        if kind is OMIT or kind is None or self.json_value(kind) is None:
            return False
        if kind not in self.over_limit:
            self.over_limit[kind] = self.su.execute(
                "SELECT pg_catalog.pg_column_size(%s::jsonb) - 4 > %s",
                (self.json_value(kind), self.max_size)).fetchone()[0]
        return self.over_limit[kind]

    def check_kept_request(self, a, ans, key, b, sql, params):
        """After a claimed answer the key keeps the request sent when the
        claim kept it (a fresh claim, or a takeover with keep_request), none
        after a fresh claim without keep_request, and the one it kept before
        after a takeover without it."""
        keep = a.get("keep_request") is True
        sent = self.json_value(a["request"]) if a.get("request", OMIT) is not OMIT else None
        row = self.su.execute(
            "SELECT pg_catalog.md5(request::text), pg_catalog.md5(%s::jsonb::text)"
            " FROM idempotency.keys WHERE scope = %s AND key = %s",
            (sent if keep else None, self.own_scope, key)).fetchone()
        if row is None:
            return  # a sweep deleted it since: its lease and retention were that short
        stored, expected = row
        takeover = ans[2] is not None and ans[2] > 1
        self.checked["P6 claim: the request kept"] += 1
        if takeover and not keep:
            if b is None:
                self.fail("P6", f"idem_claim answered attempt {ans[2]} for a key with no row "
                          "before the call", sql, params)
                return
            expected = b.request
        if stored != expected:
            what = ("the request sent" if keep else
                    "the request it kept before" if takeover else "no request")
            given_as = a.get("keep_request", OMIT)
            self.fail("P6", f"after a claimed answer (attempt {ans[2]}, keep_request "
                      f"{'omitted' if given_as is OMIT else given_as}) the key does not "
                      f"keep {what}", sql, params,
                      extra=f"stored request md5 {stored}, expected {expected};"
                      f" before: {short(b)}")

    def check_request_dropped(self, fn, keys, sql, params):
        """A key finished keeps no request."""
        if not keys:
            return
        self.checked["P6 finish: no request kept"] += 1
        left = self.su.execute(
            "SELECT key FROM idempotency.keys WHERE scope = %s AND key = ANY(%s)"
            " AND request IS NOT NULL", (self.own_scope, keys)).fetchall()
        if left:
            self.fail("P6", f"{fn} finished keys that still keep a request", sql, params,
                      extra=f"keys: {[r[0] for r in left]!r}")

    def check_abandoned(self, a, rows, scope, before, rolled_back, sql, params):
        """idem_claim_abandoned's answer: at most max_keys rows of distinct
        keys, each a takeover; in the worker's own scope, each of a key
        abandoned before the call, taken over as a claim would, oldest key
        (first claimed earliest) first, and (once committed) none of the
        other keys changed."""
        fn = "idem_claim_abandoned"
        self.outcomes[fn][{0: "no key", 1: "1 key"}.get(len(rows), "2+ keys")] += 1
        limit = 1 if a.get("max_keys", OMIT) is OMIT else a["max_keys"]
        keys = [r[0] for r in rows]
        self.checked["P6 claim_abandoned: at most max_keys rows, distinct keys"] += 1
        if len(rows) > limit or len(set(keys)) != len(keys):
            self.fail("P6", f"{fn} answered {len(rows)} rows for max_keys {limit}, of "
                      f"{len(set(keys))} keys", sql, params, extra=f"keys: {keys!r}")
        for r in rows:
            if r[0] is None or r[1] is None or r[2] is None or r[2] < 2:
                self.fail("P6", f"{fn} answered a row that is no takeover: {r[:3]!r}",
                          sql, params)
        if before is None:
            return
        prior = before[0]
        lease = (self.lease_setting if a.get("lease", OMIT) in (OMIT, None)
                 else self.interval_value(a["lease"]))
        ends = []
        for key, token, attempt, request, phase, phase_data in rows:
            b = prior.get(key)
            self.checked["P6 claim_abandoned: the key was abandoned"] += 1
            if b is None:
                self.fail("P6", f"{fn} answered a key that had no row before the call",
                          sql, params, extra=f"key: {key!r}")
                continue
            if not self.su.execute(ABANDONED_SQL, {
                    "status": b.status, "expires_at": b.expires_at, "started": self.started,
                    "token": b.token, "lease_until": b.lease_until, "ended": self.ended,
                    "owner": b.owner_session}).fetchone()[0]:
                self.fail("P6", f"{fn} answered a key that was not abandoned", sql, params,
                          extra=f"before: {short(b)}")
            ends.append(b.created_at)
            self.checked["P6 claim_abandoned: a takeover of the key"] += 1
            earlier = [t for t in self.tokens.get((scope, key), []) + [b.token] if t is not None]
            if (attempt != b.attempt + 1 or (earlier and token <= max(earlier))
                    or md5(request) != b.request or phase != b.phase
                    or md5(phase_data) != b.phase_data):
                self.fail("P6", f"{fn} answered a row that is not a takeover of the key's row",
                          sql, params, extra=f"answer: token {token}, attempt {attempt}, "
                          f"request md5 {md5(request)}, phase {phase!r}, phase_data md5 "
                          f"{md5(phase_data)}; earlier tokens {earlier}; before: {short(b)}")
        if len(ends) > 1:
            self.checked["P6 claim_abandoned: oldest key first"] += 1
            if not self.su.execute(
                    "SELECT pg_catalog.bool_and(l <= n) FROM (SELECT l, pg_catalog.lead(l)"
                    " OVER (ORDER BY o) AS n FROM pg_catalog.unnest(%s::timestamptz[])"
                    " WITH ORDINALITY u(l, o)) s", (ends,)).fetchone()[0]:
                self.fail("P6", f"{fn} answered keys out of the order of their first claim",
                          sql, params, extra=f"keys {keys!r}, created at {ends!r}")
        if rolled_back:
            return  # P3 compares every key
        after = self.snapshot(scope, ALL_KEYS)[0]
        for key, token, attempt, _, _, _ in rows:
            b, x = prior.get(key), after.get(key)
            if b is None:
                continue
            self.checked["P6 claim_abandoned: the key taken over"] += 1
            if x is None:
                # a sweep deleted it since: past its new lease and retention
                if self.su.execute("SELECT %s::timestamptz + %s::interval"
                                   " > pg_catalog.clock_timestamp()",
                                   (self.started, lease)).fetchone()[0]:
                    self.fail("P6", f"{fn} took a key and its row is gone within its lease",
                              sql, params, extra=f"key {key!r}; before: {short(b)}")
                continue
            lease_ok, lease_ended, expires_ok = self.su.execute(
                "SELECT %(l)s::timestamptz BETWEEN %(s)s::timestamptz + %(i)s::interval"
                "  AND pg_catalog.clock_timestamp() + %(i)s::interval,"
                " %(l)s::timestamptz <= pg_catalog.clock_timestamp(),"
                " %(e)s::timestamptz >= %(l)s::timestamptz",
                {"l": x.lease_until, "s": self.started, "i": lease,
                 "e": x.expires_at}).fetchone()
            # the background worker resets it once the new lease ended
            token_ok = x.token == token or (x.token is None and lease_ended)
            if (x.status != "pending" or x.attempt != attempt or not token_ok
                    or x.owner_session is not None or not lease_ok or not expires_ok
                    or x.request != b.request or x.phase != b.phase
                    or x.phase_data != b.phase_data):
                self.fail("P6", f"{fn} took a key over, and its row is not pending under the "
                          "token answered, with a lease of the one asked for and its request "
                          "and recovery point", sql, params,
                          extra=f"answer: token {token}, attempt {attempt}, lease {lease}\n"
                          f"   before: {short(b)}\n   after:  {short(x)}")
        self.compare(before, "took other keys", sql, params, skip=set(keys))

    def check_expired(self, fn, ans, key, own, sql, params):
        """An expired answer: status and response_code only, of a finished
        key remembered past its retention (a claim of it writes nothing)."""
        _, token, attempt, status, code, body, retry_after, phase, phase_data = ans
        self.checked["P6 expired answer"] += 1
        if (status not in ("succeeded", "failed")
                or any(v is not None for v in (token, attempt, body, retry_after,
                                               phase, phase_data))):
            self.fail("P6", f"{fn} answered expired with other columns than status and "
                      f"response_code: {ans!r}", sql, params)
        if not own or not isinstance(key, str):
            return
        row = self.su.execute(
            "SELECT status, response_code, remember IS NOT NULL AND remember > '0',"
            " expires_at <= pg_catalog.clock_timestamp()"
            " FROM idempotency.keys WHERE scope = %s AND key = %s",
            (self.own_scope, key)).fetchone()
        self.checked["P6 expired: the key is remembered"] += 1
        # no row: a sweep deleted it since, its remember having passed too
        if row is not None and row != (status, code, True, True):
            self.fail("P6", f"{fn} answered expired ({status}, {code}) for a key that is not "
                      "remembered past its retention", sql, params,
                      extra=f"row (status, response_code, remembered, retention passed): {row}")

    def learn(self, fn, rows, scope, touched):
        """Remember the tokens that claims handed out."""
        if fn == "idem_claim" and rows and rows[0][0] == "claimed":
            self.remember(scope, touched[0], rows[0][1])
        elif fn == "idem_claim_abandoned":
            for r in rows or []:
                self.remember(scope, r[0], r[1])
        elif fn == "idem_claim_many":
            for r in rows or []:
                if r[2] == "claimed":
                    self.remember(scope, r[1], r[3])

    def fail(self, prop, what, sql, params, extra=""):
        shown = [p if not isinstance(p, str) or len(p) < 300 else p[:60] + f"...({len(p)} chars)"
                 for p in params]
        msg = f"{prop} (worker {self.idx}, role {self.acting}): {what}\n   {sql}\n   params: {shown!r}"
        if extra:
            msg += "\n   " + extra
        # the same failure of the same statement is shown once, and counted
        kind = (prop, what, sql)
        self.failure_count[kind] += 1
        if self.failure_count[kind] == 1:
            self.failures.append(msg)
            print("FAIL " + msg, flush=True)

    def reset(self):
        """After a harness error: no transaction left open."""
        if self.conn.closed or self.plain.closed:
            self.reconnect()
        for conn in (self.conn, self.plain):
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                conn.execute("ROLLBACK")

    def reconnect(self):
        for _ in range(50):
            try:
                self.conn = self.connect(self.role)
                self.su = self.connect("postgres")
                self.side = self.connect(self.role)
                self.plain = self.connect("fuzz_plain")
                return
            except psycopg.OperationalError:
                time.sleep(0.2)
        raise Failure("the server does not accept connections any more")

    def summary(self):
        return {"calls": dict(self.calls), "ok": dict(self.ok),
                "errors": {f: dict(c) for f, c in self.errors.items()},
                "outcomes": {f: dict(c) for f, c in self.outcomes.items()},
                "contexts": dict(self.contexts), "checked": dict(self.checked),
                "failures": self.failures,
                "failed_calls": sum(self.failure_count.values())}


class Raw:
    """A text argument sent as bytes and converted by the server."""

    def __init__(self, data):
        self.data = data

    def __repr__(self):
        return f"Raw({self.data!r})"


# A row of idempotency.keys as P3 compares it: all of it but sweep_at (text),
# and what tells a reset by the background worker apart (rest: the row
# without token and owner_session) and a compaction (core: the row without
# what a compaction drops; compact: none of that is left); gone_at: when
# the key stops being there for a claim, its retention or remember passing;
# then what idem_claim_abandoned's answer is held against (request and
# phase_data as md5s of their text).
Row = collections.namedtuple("Row", "text status token expires_at rest core compact gone_at"
                             " attempt lease_until owner_session request phase phase_data"
                             " created_at")


def fit(expr):
    """SQL: the text of jsonb <expr>, or, past 2000 characters, its start,
    length and md5 (what tells two of them apart, and reads in a failure)."""
    return ("(SELECT CASE WHEN pg_catalog.length(t) > 2000 THEN pg_catalog.left(t, 600)"
            " || '...(' || pg_catalog.length(t) || ' characters, md5 ' || pg_catalog.md5(t)"
            f" || ')' ELSE t END FROM (SELECT ({expr})::text AS t) f)")


# Whether a key's row before a call (its status, expires_at, token,
# lease_until and owner_session) was abandoned at some time of the call
# (between started and ended): pending, within its retention, and reset,
# past its lease, or bound to a session whose binding lock (an advisory
# lock, its fourth field 0x1de8) nobody holds.
ABANDONED_SQL = (
    "SELECT %(status)s = 'pending' AND %(expires_at)s::timestamptz > %(started)s::timestamptz"
    " AND (%(token)s::int8 IS NULL OR %(lease_until)s::timestamptz <= %(ended)s::timestamptz"
    "  OR (%(owner)s::int8 IS NOT NULL AND NOT EXISTS (SELECT FROM pg_catalog.pg_locks l"
    "   WHERE l.locktype = 'advisory' AND l.mode = 'ExclusiveLock' AND l.granted"
    "    AND l.database = (SELECT oid FROM pg_catalog.pg_database"
    "                      WHERE datname = pg_catalog.current_database())"
    "    AND l.classid::int8 = (%(owner)s::int8 >> 32) & 4294967295"
    "    AND l.objid::int8 = %(owner)s::int8 & 4294967295 AND l.objsubid = 7656)))")

# The rows of a scope's keys, as Row has them (the first column is the key).
SNAPSHOT_SQL = (
    "SELECT k.key, " + fit("j - 'sweep_at'") + ", k.status, k.token, k.expires_at::text, "
    + fit("j - 'sweep_at' - 'token' - 'owner_session'") + ", "
    + fit("j - 'sweep_at' - 'response_body' - 'phase' - 'phase_data'") + ","
    " k.response_body IS NULL AND k.phase IS NULL AND k.phase_data IS NULL,"
    " (CASE WHEN k.status = 'pending' OR k.remember IS NULL THEN k.expires_at"
    "  ELSE k.expires_at + k.remember END)::text,"
    " k.attempt, k.lease_until::text, k.owner_session, pg_catalog.md5(k.request::text),"
    " k.phase, pg_catalog.md5(k.phase_data::text), k.created_at::text"
    " FROM idempotency.keys k, LATERAL (SELECT pg_catalog.to_jsonb(k) AS j) r"
    " WHERE k.scope = %s")


def md5(text):
    """The md5 of a text as PostgreSQL's md5() has it (NULL: None)."""
    return None if text is None else hashlib.md5(text.encode("utf-8")).hexdigest()


def short(row):
    if row is None or len(row.text) < 600:
        return row and row.text
    return row.text[:600] + f"...({len(row.text)} characters)"


def strict_null(fn, a):
    """A STRICT SQL function called with a NULL: it returns NULL unrun."""
    return fn in ("bind_scope", "unbind_scope") and None in a.values()


def flatten(v):
    if not isinstance(v, list):
        return []
    out = []
    for x in v:
        out.extend(flatten(x) if isinstance(x, list) else [x])
    return out


def flatten_choices(choice):
    if choice is None or choice == []:
        return []
    if isinstance(choice, tuple) and choice[0] == "2d":
        return list(choice[1])
    return list(choice)


def lost(conn, e):
    """Whether error e means that the connection or the server went away."""
    return (conn.closed or e.sqlstate in CONNECTION_LOST
            or (e.sqlstate is None and isinstance(e, psycopg.OperationalError)))


def first_line(e):
    return str(e).splitlines()[0] if str(e) else type(e).__name__


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------
def worker_main(idx, opts, deadline, queue):
    random.seed(opts.seed + idx)
    worker = None
    try:
        worker = Worker(idx, opts)

        @settings(max_examples=200, deadline=None, database=None, derandomize=False,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(call=call_strategy, context=context_strategy)
        def prop(call, context):
            if time.monotonic() < deadline:
                try:
                    worker.run(call, context)
                except Failure:
                    raise
                except Exception:  # noqa: BLE001 - the harness's own mistake
                    worker.fail("harness", traceback.format_exc().strip().splitlines()[-1],
                                repr(call), [repr(context)])
                    worker.reset()

        rnd = 0
        while time.monotonic() < deadline:
            hypothesis_seed(opts.seed + 1000003 * idx + rnd)(prop)()
            rnd += 1
        queue.put(worker.summary())
    except BaseException:  # noqa: BLE001 - reported as a failure of the run
        summary = worker.summary() if worker else {"failures": []}
        summary["failures"].append(f"worker {idx} stopped: {traceback.format_exc()}")
        queue.put(summary)


def merge(summaries):
    total = {"calls": collections.Counter(), "ok": collections.Counter(),
             "errors": collections.defaultdict(collections.Counter),
             "outcomes": collections.defaultdict(collections.Counter),
             "contexts": collections.Counter(), "checked": collections.Counter(),
             "failures": [], "failed_calls": 0}
    for s in summaries:
        for k in ("calls", "ok", "contexts", "checked"):
            total[k].update(s.get(k, {}))
        for f, c in s.get("errors", {}).items():
            total["errors"][f].update(c)
        for f, c in s.get("outcomes", {}).items():
            total["outcomes"][f].update(c)
        total["failures"].extend(s.get("failures", []))
        total["failed_calls"] += s.get("failed_calls", 0)
    return total


def server_start(opts):
    with psycopg.connect(host=opts.host, port=opts.port, dbname=opts.dbname,
                         user="postgres") as c:
        return c.execute("SELECT pg_catalog.pg_postmaster_start_time()").fetchone()[0]


def amcheck(opts):
    """P5: the table and every index of it pass amcheck.  Returns failures."""
    out = []
    with psycopg.connect(host=opts.host, port=opts.port, dbname=opts.dbname,
                         user="postgres", autocommit=True) as c:
        c.execute("CREATE EXTENSION IF NOT EXISTS amcheck")
        for (index,) in c.execute(
                "SELECT i.indexrelid::regclass::text FROM pg_catalog.pg_index i "
                "WHERE i.indrelid = 'idempotency.keys'::regclass ORDER BY 1").fetchall():
            c.execute("SELECT bt_index_check(%s::regclass, true)", (index,))
            print(f"amcheck: bt_index_check({index}, true): ok")
        bad = c.execute("SELECT * FROM verify_heapam('idempotency.keys')").fetchall()
        print(f"amcheck: verify_heapam('idempotency.keys'): {len(bad)} problem(s)")
        out += [f"P5 verify_heapam: {r}" for r in bad]
    return out


def print_summary(total, seed, elapsed):
    print(f"\n== properties: seed {seed}, {elapsed:.0f}s")
    print("calls per function (ok / errors by SQLSTATE):")
    for f in sorted(total["calls"]):
        errs = ", ".join(f"{s} {n}" for s, n in sorted(total["errors"][f].items()))
        print(f"  {f:18} {total['calls'][f]:7d} calls, {total['ok'][f]:7d} ok"
              + (f"; {errs}" if errs else ""))
    print("answers: " + "; ".join(
        f"{f} " + ", ".join(f"{o} {n}" for o, n in sorted(c.items()))
        for f, c in sorted(total["outcomes"].items())))
    print("contexts: " + ", ".join(f"{k} {v}" for k, v in sorted(total["contexts"].items())))
    print("properties checked: " + ", ".join(
        f"{k}: {v}" for k, v in sorted(total["checked"].items())))
    print(f"calls: {sum(total['calls'].values())}, failed checks: {total['failed_calls']}"
          f" ({len(total['failures'])} distinct, listed below)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--host", default=os.environ.get("PGHOST", "/tmp"))
    p.add_argument("--port", type=int, default=int(os.environ.get("PGPORT", "5432")))
    p.add_argument("--dbname", default="fuzz")
    p.add_argument("--minutes", type=float, default=1.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--amcheck", action="store_true", help="only P5, then exit")
    p.add_argument("--json", help="write the summary here")
    opts = p.parse_args()
    # names this run's keys: a second run against the same database starts afresh
    opts.run_id = f"r{int(time.time())}"
    if opts.amcheck:
        failures = amcheck(opts)
        for f in failures:
            print("FAIL " + f)
        return 1 if failures else 0
    if opts.seed is None:
        opts.seed = random.SystemRandom().randrange(2**31)
    print(f"== properties: seed {opts.seed} (--seed {opts.seed} draws the same calls),"
          f" {opts.workers} workers, {opts.minutes} minutes", flush=True)
    started = time.monotonic()
    start_time = server_start(opts)
    deadline = started + opts.minutes * 60
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker_main, args=(i, opts, deadline, queue))
             for i in range(opts.workers)]
    for proc in procs:
        proc.start()
    summaries = []
    for proc in procs:
        try:
            summaries.append(queue.get(timeout=max(60, deadline - time.monotonic() + 600)))
        except Exception:  # noqa: BLE001 - a worker that never reported
            summaries.append({"failures": ["a worker never reported"]})
    for proc in procs:
        proc.join(timeout=60)
    total = merge(summaries)
    try:
        if server_start(opts) != start_time:
            total["failures"].append("P1 the postmaster restarted during the run")
        total["checked"]["P1 server up, not restarted"] += 1
    except psycopg.Error as e:
        total["failures"].append(f"P1 the server does not answer: {first_line(e)}")
    print_summary(total, opts.seed, time.monotonic() - started)
    if opts.json:
        with open(opts.json, "w", encoding="utf-8") as f:
            json.dump(total, f, indent=1, default=str)
    for f in total["failures"][:40]:
        print("FAILED: " + f)
    if len(total["failures"]) > 40:
        print(f"FAILED: ... and {len(total['failures']) - 40} more")
    return 1 if total["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
