#!/usr/bin/python3
"""bench/takeover_latency.py CONNSTR N: row 18, how soon a session-bound key is
taken over after the session that claimed it dies.

For each of N fresh keys and each way of dying:
  kill       session A is a client process of its own (this script, run with
             --child) that claims the key with session_bound => true
             (autocommit, so the claim is committed) and then waits on its
             stdin; the driver kills that process with SIGKILL;
  terminate  session A is a connection of the driver, and the driver runs
             pg_terminate_backend(A's backend) on a third connection.
Session B calls idem_claim(key, wait => '60 s') in a thread; once B is seen
waiting in the extension's wait (pg_stat_activity: wait_event_type
'Extension'), the driver notes the time and kills A.  Measured: B's return
minus that moment.  B must answer claimed, attempt 2; it then finishes the
key.  Without the session binding B would wait for the lease (30 s by
default).
Prints one line per mode for bench/run's extra.tsv:
  takeover_MODE<TAB>p50 p99 max mean n claimed_attempt_2
(milliseconds).
"""
import math
import os
import signal
import subprocess
import sys
import threading
import time

import psycopg

CLAIM = ("SELECT token, outcome FROM idempotency.idem_claim(%s, NULL, %s, "
         "session_bound => true)")


def pct(values, p):
    v = sorted(values)
    return v[max(0, math.ceil(p / 100.0 * len(v)) - 1)]


def child(connstr, key, scope):
    """Session A of the kill mode: claim, say so, then wait to be killed."""
    conn = psycopg.connect(connstr, autocommit=True)
    token, outcome = conn.execute(CLAIM, (key, scope)).fetchone()
    print(outcome, token, conn.info.backend_pid, flush=True)
    sys.stdin.read()


def wait_until_waiting(ctl, pid):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = ctl.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                          (pid,)).fetchone()
        if row and row[0] == "Extension":
            return
        time.sleep(0.001)
    raise RuntimeError("session B never waited in idem_claim")


def one(connstr, ctl, b, mode, key, scope):
    proc = a = None
    if mode == "kill":
        proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                                 connstr, key, scope],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        outcome, _, a_pid = proc.stdout.readline().decode().split()
    else:
        a = psycopg.connect(connstr, autocommit=True)
        outcome = a.execute(CLAIM, (key, scope)).fetchone()[1]
        a_pid = a.info.backend_pid
    if outcome != "claimed":
        raise RuntimeError("session A's claim answered %s" % outcome)

    res = {}

    def waiter():
        try:
            res["row"] = b.execute(
                "SELECT outcome, attempt, token FROM idempotency.idem_claim(%s, NULL, %s, "
                "wait => '60 s')", (key, scope)).fetchone()
        except Exception as e:  # noqa: BLE001 - reported below
            res["error"] = e
        res["t"] = time.perf_counter()

    th = threading.Thread(target=waiter)
    th.start()
    wait_until_waiting(ctl, b.info.backend_pid)
    t0 = time.perf_counter()
    if mode == "kill":
        os.kill(proc.pid, signal.SIGKILL)
    else:
        ctl.execute("SELECT pg_terminate_backend(%s)", (int(a_pid),))
    th.join()
    if proc is not None:
        proc.wait()
    if a is not None:
        try:
            a.close()
        except Exception:  # noqa: BLE001 - its backend is gone
            pass
    if "error" in res:
        raise res["error"]
    outcome, attempt, token = res["row"]
    b.execute("SELECT idempotency.idem_finish(%s, %s, 200, NULL, %s)", (key, token, scope))
    return (res["t"] - t0) * 1000.0, outcome == "claimed" and attempt == 2


def main():
    if sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return
    connstr, n = sys.argv[1], int(sys.argv[2])
    ctl = psycopg.connect(connstr, autocommit=True)
    b = psycopg.connect(connstr, autocommit=True)
    scope = "takeover-%d" % time.time_ns()
    for mode in ("kill", "terminate"):
        lat, ok = [], 0
        for i in range(n):
            ms, good = one(connstr, ctl, b, mode, "%s-%d" % (mode, i), scope)
            lat.append(ms)
            ok += good
        print("takeover_%s\t%.3f %.3f %.3f %.3f %d %d" % (
            mode, pct(lat, 50), pct(lat, 99), max(lat), sum(lat) / n, n, ok), flush=True)


if __name__ == "__main__":
    main()
