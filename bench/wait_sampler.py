#!/usr/bin/python3
"""bench/wait_sampler.py CONNSTR STOPFILE PREFIX NAME=PATTERN...: samples
pg_stat_activity every 20 ms until STOPFILE exists.  Each active backend
(other than its own) whose query is LIKE a PATTERN counts for that NAME, under
its wait event ("wait_event_type:wait_event", or "CPU" when it waits on
nothing).  Prints one line per NAME for bench/run's extra.tsv:
    waits_PREFIX.NAME <TAB> <samples> <backend samples> event=count event=count ...
(events by count, highest first; samples: how many times it looked)."""
import collections
import os
import sys
import time

import psycopg


def main():
    connstr, stop, prefix = sys.argv[1:4]
    pats = [a.split("=", 1) for a in sys.argv[4:]]
    conn = psycopg.connect(connstr, autocommit=True)
    counts = {name: collections.Counter() for name, _ in pats}
    samples = 0
    while not os.path.exists(stop):
        rows = conn.execute(
            "SELECT query, coalesce(wait_event_type || ':' || wait_event, 'CPU') FROM pg_stat_activity"
            " WHERE state = 'active' AND backend_type = 'client backend' AND pid <> pg_backend_pid()").fetchall()
        samples += 1
        for query, ev in rows:
            for name, pat in pats:
                if query and like(query, pat):
                    counts[name][ev] += 1
                    break
        time.sleep(0.02)
    for name, _ in pats:
        c = counts[name]
        print("waits_%s.%s\t%d %d %s" % (prefix, name, samples, sum(c.values()),
                                         " ".join("%s=%d" % kv for kv in c.most_common())))


def like(s, pat):
    """SQL LIKE with % only (what bench/run passes)."""
    parts = pat.split("%")
    if not s.startswith(parts[0]) or not s.endswith(parts[-1]):
        return False
    pos = len(parts[0])
    for p in parts[1:-1]:
        i = s.find(p, pos)
        if i < 0:
            return False
        pos = i + len(p)
    return pos <= len(s) - len(parts[-1])


if __name__ == "__main__":
    main()
