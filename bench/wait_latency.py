#!/usr/bin/python3
"""bench/wait_latency.py CONNSTR N LABEL: row 13, wake-up latency of idem_claim(wait => ...).

For each of N keys: session A claims the key (committed, pending under a
30 s lease); session B calls idem_claim(..., wait => '10 s') and blocks;
once B is seen waiting, session C runs BEGIN; idem_finish(...); COMMIT.
Measured: B's return minus the moment C sent COMMIT (includes the commit's
own WAL flush: the conservative number) and minus the moment C's COMMIT was
acknowledged (clamped at 0: B may return before C hears back).
Prints one line for bench/run's extra.tsv:
  wait_LABEL<TAB>p50_sent p99_sent max_sent p50_ack p99_ack n replays
(milliseconds).
"""
import math
import sys
import threading
import time

import psycopg


def pct(values, p):
    v = sorted(values)
    return v[max(0, math.ceil(p / 100.0 * len(v)) - 1)]


def main():
    connstr, n, label = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    a = psycopg.connect(connstr, autocommit=True)
    b = psycopg.connect(connstr, autocommit=True)
    c = psycopg.connect(connstr)
    b_pid = b.info.backend_pid
    scope = "wait-%s-%d" % (label, time.time_ns())
    sent, ack, replays = [], [], 0
    for i in range(n):
        key = str(i)
        token = a.execute("SELECT token FROM idempotency.idem_claim(%s, NULL, %s)",
                          (key, scope)).fetchone()[0]
        res = {}

        def waiter():
            row = b.execute("SELECT outcome FROM idempotency.idem_claim(%s, NULL, %s, NULL, NULL, '10 s')",
                            (key, scope)).fetchone()
            res["t"] = time.perf_counter()
            res["o"] = row[0]

        th = threading.Thread(target=waiter)
        th.start()
        deadline = time.time() + 5
        while time.time() < deadline:
            st = a.execute("SELECT state FROM pg_stat_activity WHERE pid = %s", (b_pid,)).fetchone()
            if st and st[0] == "active":
                break
            time.sleep(0.002)
        time.sleep(0.02)            # B is inside its wait now
        c.execute("SELECT idempotency.idem_finish(%s, %s, 200, NULL, %s)", (key, token, scope))
        t_sent = time.perf_counter()
        c.commit()
        t_ack = time.perf_counter()
        th.join()
        if res.get("o") == "replay":
            replays += 1
        sent.append((res["t"] - t_sent) * 1000.0)
        ack.append(max(0.0, (res["t"] - t_ack) * 1000.0))
    print("wait_%s\t%.3f %.3f %.3f %.3f %.3f %d %d" % (
        label, pct(sent, 50), pct(sent, 99), max(sent), pct(ack, 50), pct(ack, 99), n, replays))


if __name__ == "__main__":
    main()
