#!/usr/bin/python3
"""bench/stats.py PREFIX: latency statistics of one pgbench run.

Reads every per-transaction log that `pgbench --log --log-prefix=PREFIX`
wrote (PREFIX.<pid> and PREFIX.<pid>.<thread>), where the third field is the
transaction's latency in microseconds, and prints
    <transactions> <mean ms> <p50 ms> <p99 ms>
p50/p99 are nearest-rank percentiles over all transactions of all clients.
"""
import glob
import math
import sys


def main():
    prefix = sys.argv[1]
    lat = []
    for path in glob.glob(glob.escape(prefix) + ".[0-9]*"):
        with open(path) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    lat.append(int(parts[2]))
    if not lat:
        print("0 nan nan nan")
        return
    lat.sort()
    n = len(lat)

    def pct(p):
        return lat[max(0, math.ceil(p / 100.0 * n) - 1)] / 1000.0

    print("%d %.4f %.4f %.4f" % (n, sum(lat) / n / 1000.0, pct(50), pct(99)))


if __name__ == "__main__":
    main()
