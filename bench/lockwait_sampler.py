#!/usr/bin/python3
"""bench/lockwait_sampler.py CONNSTR STOPFILE PATTERN: samples pg_stat_activity every
20 ms until STOPFILE exists, counting backends running a query LIKE PATTERN and
how many of them wait on a heavyweight lock (wait_event_type = 'Lock').
Prints: samples busy_samples lock_waits (row 10: "never waits on a lock")."""
import os
import sys
import time

import psycopg


def main():
    connstr, stop, pattern = sys.argv[1:4]
    conn = psycopg.connect(connstr, autocommit=True)
    samples = busy = waits = 0
    while not os.path.exists(stop):
        active, locked = conn.execute(
            "SELECT count(*), count(*) FILTER (WHERE wait_event_type = 'Lock') FROM pg_stat_activity"
            " WHERE state = 'active' AND query LIKE %s AND pid <> pg_backend_pid()",
            (pattern,)).fetchone()
        samples += 1
        busy += active > 0
        waits += locked
        time.sleep(0.02)
    print("%d %d %d" % (samples, busy, waits))


if __name__ == "__main__":
    main()
