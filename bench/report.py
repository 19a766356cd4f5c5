#!/usr/bin/python3
"""bench/report.py RESULTS_TSV EXTRA_TSV BENCH_DIR: turns bench/run's raw numbers into
bench/RESULTS.md and bench/chart.png (through gnuplot and bench/chart.gp).

results.tsv: label row variant round ops_per_s mean_ms p50_ms p99_ms n
extra.tsv:   key value   (machine, settings, WAL, wait latency, Redis, sizes ...)
Every ratio is the median over rounds of the ratio measured within one round
(the scripts of a round run back to back, interleaved A B A B)."""
import collections
import glob
import os
import re
import statistics
import subprocess
import sys

res_path, extra_path, bench = sys.argv[1:4]
out_dir = os.path.join(bench, "out")
work_dir = os.path.dirname(os.path.abspath(res_path))   # bench/run's temp dir (pg_waldump output)

runs = collections.defaultdict(dict)      # label -> round -> dict
for line in open(res_path):
    f = line.rstrip("\n").split("\t")
    if len(f) < 9 or not f[4]:
        continue
    label, row, variant, rnd = f[0], f[1], f[2], int(f[3])

    def num(x):
        try:
            return float(x)
        except ValueError:
            return None
    runs[label][rnd] = dict(row=row, variant=variant, tps=num(f[4]), mean=num(f[5]),
                            p50=num(f[6]), p99=num(f[7]), n=num(f[8]))

extra = {}
for line in open(extra_path):
    if "\t" in line:
        k, v = line.rstrip("\n").split("\t", 1)
        extra[k] = v

# Row 15's and row 22's transactions hold BATCH keys each: its throughput is counted in
# keys per second (pgbench's tps times BATCH), which its ratios compare with
# row 1's ops per second.
BATCH = int(extra.get("batch", "100"))
for _label in ["r15a", "r15b", "r15c", "r22", "r22c", "r22f"] + [lb for lb in runs if lb.startswith("r23_") and "_batch_" in lb]:
    for _r in runs.get(_label, {}).values():
        if _r["tps"] is not None:
            _r["tps"] *= BATCH


def med(label, field="tps"):
    vals = [r[field] for r in runs.get(label, {}).values() if r.get(field) is not None]
    return statistics.median(vals) if vals else None


def ratio(a, b, field="tps"):
    """median over rounds of a/b, for rounds where both ran."""
    ra, rb = runs.get(a, {}), runs.get(b, {})
    vals = [ra[k][field] / rb[k][field] for k in ra if k in rb
            and ra[k].get(field) and rb[k].get(field)]
    return statistics.median(vals) if vals else None


def ratios_list(a, b):
    ra, rb = runs.get(a, {}), runs.get(b, {})
    return [ra[k]["tps"] / rb[k]["tps"] for k in sorted(ra) if k in rb and rb[k]["tps"]]


def per_round(a, b):
    return ", ".join("%.2f" % x for x in ratios_list(a, b))


def fmt(x, spec="%.0f", none="n/a"):
    return none if x is None else spec % x


def fx(x):
    return fmt(x, "%.2fx")


def yes(cond):
    if cond is None:
        return "not measured"
    return "**met**" if cond else "**missed**"


# ------------------------------------------------------------------ WAL
def waldump(label):
    # this run's temp dir, else bench/out (rows a partial run did not measure)
    path = os.path.join(work_dir, "waldump_%s.log" % label)
    if not os.path.exists(path):
        path = os.path.join(out_dir, "waldump_%s.log" % label)
    recs, total = [], None
    if not os.path.exists(path):
        return recs, total
    for line in open(path):
        m = re.match(r"^(\S+)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)\s+\(\s*[\d.]+\)\s+(\d+)", line)
        if m and m.group(1) != "Type":
            recs.append((m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4)), int(m.group(5))))
        m = re.match(r"^Total\s+(\d+)\s+(\d+)\s+\[[^]]*\]\s+(\d+)\s+\[[^]]*\]\s+(\d+)", line)
        if m:
            total = tuple(int(x) for x in m.groups())
    return recs, total


wal = {}
for k, v in extra.items():
    if k.startswith("wal_"):
        b, n = v.split()
        wal[k[4:]] = (float(b), int(n))


def wal_per_op(label):
    if label not in wal:
        return None
    b, n = wal[label]
    return b / n


# ------------------------------------------------------------------ table
ROWS = [
    # label, row, description, reference label for "vs floor", peer label
    ("r1", "1", "extension, autocommit: `idem_claim` + `idem_finish` (2 commits)", "r7", "r6"),
    ("r2", "2", "extension, one transaction: claim + business INSERT + finish", "r7", None),
    ("r3", "3", "seed pattern, one transaction: INSERT ON CONFLICT, SELECT FOR UPDATE, business INSERT, UPDATE", "r7", None),
    ("r4", "4", "seed pattern, autocommit: INSERT ON CONFLICT RETURNING, UPDATE", "r7", None),
    ("r5", "5", "seed pattern, advisory lock: try_lock, SELECT, INSERT, unlock, UPDATE", "r7", None),
    ("r6", "6", "PL/pgSQL peer (bench/plpgsql_peer.sql), autocommit claim + finish", "r7", None),
    ("r7", "7", "**floor**: bare INSERT + bare UPDATE, 2 commits, no checks", "r7", None),
    ("r7c", "7", "bound of any 2-commit claim + finish: two one-row INSERTs into an unindexed table, 2 commits", "r7", "r6"),
    ("r1t", "1", "row 1 again, as a pair with row 7 only (%s rounds: the target's measurement)" % (re.search(r"PAIR_RUNS=(\d+)", extra.get("params", "")) or [None, "?"])[1], "r7t", None),
    ("r7t", "7", "row 7 again, as a pair with row 1 only", "r7t", None),
    ("r8", "8", "replay: `idem_claim` of a finished key (%s keys)" % extra.get("n_replay", "?"), "r8b", "r8p"),
    ("r8b", "8", "reference: bare primary-key SELECT of the same row", "r8b", None),
    ("r8p", "8", "PL/pgSQL peer replay", "r8b", None),
    ("r9", "9", "retry storm: %s clients on 100 hot keys, extension" % (re.search(r"STORM_CLIENTS=(\d+)", extra.get("params", "")) or [None, "8"])[1], None, "r9p"),
    ("r9p", "9", "retry storm, PL/pgSQL peer", None, None),
    ("r9b", "9", "bound of any storm: a bare primary-key SELECT of the 100 hot rows, same clients", None, "r9p"),
    ("r10", "10", "in_progress storm: claims of keys pending under a live lease", "r10b", "r10p"),
    ("r10b", "10", "reference: bare primary-key SELECT of the pending row", "r10b", None),
    ("r10p", "10", "PL/pgSQL peer, same in_progress storm", "r10b", None),
    ("r11_worker_on", "11", "claim + finish while the worker sweeps a backlog", "r11_worker_off", None),
    ("r11_worker_off", "11", "claim + finish, worker off (sweep_interval = 0)", "r11_worker_off", None),
    ("r12s_ext", "12", "row 1 with %s keys in the table" % extra.get("n_small", "?"), "r12s_floor", None),
    ("r12s_floor", "12", "row 7 with %s keys in the table" % extra.get("n_small", "?"), "r12s_floor", None),
    ("r12b_ext", "12", "row 1 with %s keys in the table" % (extra.get("n_big_actual", "?").split() or ["?"])[0], "r12b_floor", None),
    ("r12b_floor", "12", "row 7 with %s keys in the table" % (extra.get("n_big_actual", "? ?").split() + ["?", "?"])[1], "r12b_floor", None),
    ("r15a", "15", "batch of %d fresh keys in one transaction: `idem_claim_many` + one `INSERT ... SELECT` + `idem_finish_many`: **keys/s** (latency per transaction)" % BATCH, "r15_r1", None),
    ("r15c", "15", "the same batch as `LATERAL idem_claim` over `unnest(keys)` + one `INSERT ... SELECT` + `LATERAL idem_finish`: **keys/s**", "r15_r1", None),
    ("r15b", "15", "the same batch as %d x (`idem_claim` + one-row `INSERT` + `idem_finish`), one statement each, one transaction: **keys/s**" % BATCH, "r15_r1", None),
    ("r15_r1", "15", "row 1 in the same rounds (one key per op, 2 commits)", "r15_r1", None),
    ("r16", "16", "business `INSERT` + `idem_checkpoint` of a pending key, one transaction", "r16b", None),
    ("r16b", "16", "reference: business `INSERT` + bare `UPDATE` of the same two columns of the same key in a plain copy of the table, one transaction", "r16b", None),
    ("r17", "17", "row 1 with `session_bound => true` (claim + finish, autocommit)", "r17_r1", None),
    ("r17_r1", "17", "row 1 as a pair with row 17", "r17_r1", None),
]

lines = []
w = lines.append
w("# idempotency benchmark results")
w("")
w("Generated by `bench/run` on %s. Reproduce with `bench/run`, as root, on a clean clone "
  "(it installs what it needs and builds the extension; about 100 minutes); `QUICK=1 bench/run` is a "
  "smoke run, `ROWS=15-18 bench/run` runs some rows only. Raw pgbench logs and pg_waldump output land in `bench/out/`." % extra.get("date", "?"))
w("")
w("**Machine**: %s cores (%s), PostgreSQL %s, shared with other work (noisy: that is why every "
  "comparison interleaves its scripts and reports the median of per-round ratios)."
  % (extra.get("nproc", "?"), extra.get("cpu", "?"), extra.get("pg_version", "?")))
w("")
w("**Run parameters**: `%s`. pgbench `-M prepared`, each op on a fresh random key "
  "(`random(1, 10^18)` within a per-run scope; row 12 within the scope of the filled keys), each "
  "run after a CHECKPOINT and a warm-up of the "
  "same script; compared scripts run back to back, in reverse order every other round (A B, B A, ...), "
  "RUNS rounds per group and PAIR_RUNS rounds for the pairs whose target has a margin of a few percent "
  "(row 1 vs row 7, row 8, row 12, row 16, row 17); "
  "p99 from pgbench's per-transaction `--log`. Background work is paused for the whole run "
  "(`autovacuum = off`, `idempotency.sweep_interval = 0`) so that it does not land inside some "
  "runs and not others; each group of runs starts with a VACUUM ANALYZE, the sweeper's deferred "
  "work is measured on its own and claims with the worker on are row 11." % extra.get("params", "?"))
w("")
w("**Server settings** (throwaway cluster started by the command): " +
  ", ".join("`%s`" % s for s in extra.get("settings", "").split(";") if s))
w("")
runs_by = collections.defaultdict(list)
for k, v in extra.items():
    if k.startswith("run."):
        runs_by[v].append(int(k[4:]))
if runs_by:
    w("**Rows measured by a later run** (`ROWS=... bench/run`; every other row comes from the run above): " +
      "; ".join("rows %s: %s" % (", ".join(str(n) for n in sorted(ns)), v)
                for v, ns in sorted(runs_by.items(), key=lambda x: min(x[1]))) + ".")
    w("")
if extra.get("have_ext") != "1":
    w("**The extension was not installed: extension rows are missing.**")
    w("")
w("**Extension build measured**: idempotency.so md5 %s." % extra.get("so", "?"))
changed = sorted(k for k in extra if k.startswith("so_changed."))
if changed:
    w("")
    w("**WARNING: the extension was reinstalled while this run measured** (new connections load the "
      "new file, so rows measured after the change ran a different build): " +
      "; ".join("before %s: %s" % (k.split(".", 1)[1], extra[k]) for k in changed))
w("")
w("**Behavioural checks** (`bench/plpgsql_peer_check.sql`, the same checks against both): "
  "PL/pgSQL peer: %s; extension: %s." % (extra.get("check_peer", "not run"), extra.get("check_ext", "not run")))
fails = [k for k in extra if k.startswith("verify_failed_")]
if fails:
    w("")
    w("**Verification warnings**: " + ", ".join("%s %s" % (k[14:], extra[k]) for k in fails))
w("")
w("## Throughput and latency (medians over rounds)")
w("")
w("| row | operation | ops/s | mean ms | p99 ms | ratio vs reference | ratio vs peer |")
w("|---|---|---:|---:|---:|---:|---:|")
chart = []
sweep = [r["tps"] for r in runs.get("r11_sweep", {}).values()]
delete = [r["tps"] for r in runs.get("r11_delete", {}).values()]
r11a = ratio("r11_sweep", "r11_delete")
for label, row, desc, ref, peer in ROWS:
    if label == "r12s_ext" and sweep:
        w("| 11 | sweep: `idem_sweep` batches (committed one by one) expiring %s keys: **rows/s** | %s | | | %s bare DELETE | |"
          % (extra.get("n_sweep", "?"), fmt(statistics.median(sweep)), fx(r11a)))
        w("| 11 | reference: one bare `DELETE ... WHERE sweep_at <= now() AND expires_at <= now()`: **rows/s** | %s | | | | |"
          % fmt(statistics.median(delete)))
    if label not in runs:
        continue
    r_ref = ratio(label, ref) if ref and ref != label else None
    r_peer = ratio(label, peer) if peer else None
    refname = {"r7": "row 7", "r8b": "bare SELECT", "r10b": "bare SELECT",
               "r7t": "row 7 (pair)", "r15_r1": "row 1 (same rounds)",
               "r16b": "bare UPDATE", "r17_r1": "row 1 (pair)",
               "r11_worker_off": "worker off", "r12s_floor": "row 7 (same size)",
               "r12b_floor": "row 7 (same size)"}.get(ref, "")
    w("| %s | %s | %s | %s | %s | %s | %s |" % (
        row, desc, fmt(med(label)), fmt(med(label, "mean"), "%.3f"), fmt(med(label, "p99"), "%.3f"),
        (fx(r_ref) + " " + refname) if r_ref is not None else ("1.00x" if ref == label else ""),
        fx(r_peer) if r_peer is not None else ""))
    if label not in ("r1t", "r7t", "r7c", "r9b", "r15_r1", "r17_r1"):
        chart.append((label, med(label)))

w("")
w("Row 3 carries the same business INSERT as row 2, so rows 2 and 3 do the same work; row 2 vs row 3: %s."
  % fx(ratio("r2", "r3")))
if runs.get("r11_worker_on"):
    sw = [extra[k] for k in sorted(extra) if k.startswith("r11_swept_worker_on")]
    w("Row 11, worker on: `sweep_interval = 1s` with %s expired keys queued before each run "
      "(harsher than the default 60 s pace: the worker deletes continuously); keys it expired "
      "during warm-up + run: %s." % (extra.get("n_backlog", "?"), ", ".join(sw)))
if "r11_drain" in extra:
    due, secs, calls, left, walb = extra["r11_drain"].split()
    due, secs, left, walb = int(due), float(secs), int(left), float(walb)
    w("Row 11, the sweeper's deferred work: before row 11, %d keys were due (`sweep_at <= now()`: mostly "
      "finished keys whose sweep_at is still their lease end, which the sweeper reschedules); calling "
      "`idem_sweep` until nothing was due took %.1f s in %s calls (%s), %s still due, %.0f WAL bytes per due key "
      "(%s without full-page images). This is write work per finished key that rows 1 and 2 do not show."
      % (due, secs, calls, ("%.0f keys/s" % (due / secs)) if secs > 0 else "?", left,
         walb / due if due else 0,
         ("%.0f" % ((walb - waldump("drain")[1][2]) / due)) if due and waldump("drain")[1] else "?"))
lefts = sorted(k for k in extra if k.startswith("r11_left."))
if lefts:
    w("")
    w("**Row 11a: `idem_sweep`, called again while it returned a full batch (the documented protocol), "
      "stopped with keys past retention left**: %s (they were deleted by hand before the next round; "
      "the rows/s above count only what the sweep deleted)." % ", ".join(
          "round %s: %s keys" % (k.split(".")[1], extra[k]) for k in lefts))
w("")

# row 12
r12s = ratio("r12s_ext", "r12s_floor")
r12b = ratio("r12b_ext", "r12b_floor")
# the four scripts run in the same rounds: the median of each round's
# (big ratio / small ratio), like every other ratio here
_b, _s = runs.get("r12b_ext", {}), runs.get("r12s_ext", {})
_bf, _sf = runs.get("r12b_floor", {}), runs.get("r12s_floor", {})
r12_rounds = [(_b[k]["tps"] / _bf[k]["tps"]) / (_s[k]["tps"] / _sf[k]["tps"])
              for k in sorted(_b) if k in _bf and k in _s and k in _sf
              and _bf[k]["tps"] and _s[k]["tps"] and _sf[k]["tps"]]
r12 = statistics.median(r12_rounds) if r12_rounds else None
w("## Row 12: scale")
w("")
nb = extra.get("n_big_actual", "? ?").split()
w("Row 1 / row 7 with %s keys in the tables: %s; with %s keys (%s in the floor's table): %s; "
  "big / small, the median of the per-round quotients = **%s**%s." % (extra.get("n_small", "?"), fx(r12s), nb[0] if nb else "?",
                               nb[1] if len(nb) > 1 else "?", fx(r12b), fx(r12),
                               "" if extra.get("n_big") == "10000000" else
                               " (smaller than the default 10M keys: a QUICK or `ROWS_10M=0` run)"))
w("")
w("How: the keys are filled with INSERT ... SELECT (36-character keys like a UUID, all finished), the "
  "small tables in a second database of the same cluster (`bench_small`), and the four scripts run "
  "in the same rounds (extension and floor on the small tables, then on the big ones; reversed "
  "every other round), so that both halves of the ratio see the same storage and the same WAL. "
  "Each run's new keys go into the filled scope, so they land among the filled keys, on random "
  "leaf pages of the primary key, as new keys of a busy production scope do. The small tables are "
  "truncated and filled again after every run (each run adds 20-30k keys; checked: every op left "
  "one finished key); the big ones keep their runs' keys (they grow by about 3% over the rounds; "
  "checked at the end). Per-round quotients: " + ", ".join("%.2f" % x for x in r12_rounds) + ". The cluster is "
  "restarted after the fill: the table filled last would otherwise start with its primary key in "
  "shared_buffers and the other one without.")
if "bytes_per_key" in extra:
    tot, heap, idx, n, ext_tot, ext_n = (int(x) for x in extra["bytes_per_key"].split())
    w("")
    w("Table + index bytes per finished key (clean copy of the table shape, %d finished keys with "
      "36-character keys, after VACUUM): **%.0f bytes** (heap %.0f, indexes %.0f). The benchmark's "
      "own table at that point: %.0f bytes per row over %d rows." %
      (n, tot / n, heap / n, idx / n, ext_tot / ext_n, ext_n))
w("")

# WAL
w("## WAL per operation (one client, pg_current_wal_insert_lsn before and after)")
w("")
w("Measured after the comparison runs (so after a CHECKPOINT): the full-page images (FPI) depend on "
  "how many pages an op touches first after a checkpoint; the bytes without FPI are the stable per-op cost.")
w("")
w("| row | ops | WAL bytes/op | without FPI | FPI bytes/op | records/op | main records per op (count, bytes incl. FPI) |")
w("|---|---:|---:|---:|---:|---:|---|")
for label, name in [("r1", "1 extension autocommit"), ("r2", "2 extension one transaction"),
                    ("r6", "6 PL/pgSQL peer"), ("r7", "7 floor"), ("r8", "8 replay"),
                    ("r8p", "8 PL/pgSQL peer replay"), ("r10", "10 in_progress"),
                    ("r15a", "15a `idem_claim_many` batch (one op = %d keys)" % BATCH),
                    ("r15c", "15c LATERAL batch (one op = %d keys)" % BATCH),
                    ("r16", "16 INSERT + `idem_checkpoint`"), ("r16b", "16 INSERT + bare UPDATE"),
                    ("r17", "17 session-bound claim + finish")]:
    if label not in wal:
        continue
    b, n = wal[label]
    recs, total = waldump(label)
    fpi = "%.1f" % (total[2] / n) if total else ("0" if b == 0 else "?")
    cnt = "%.2f" % (total[0] / n) if total else ("0" if b == 0 else "?")
    top = sorted(recs, key=lambda r: -r[4])[:6]
    nofpi = "%.1f" % ((b - total[2]) / n) if total else ("0" if b == 0 else "?")
    w("| %s | %d | %.1f | %s | %s | %s | %s |" % (
        name, n, b / n, nofpi, fpi, cnt,
        ", ".join("%s %.2f (%.0f B)" % (r[0], r[1] / n, r[4] / n) for r in top if r[1] / n >= 0.05)))
w("")

# row 13
w("## Row 13: `wait` wake-up latency")
w("")
w("Session A holds a committed claim; session B blocks in `idem_claim(..., wait => '10 s')`; "
  "session C runs `BEGIN; idem_finish(...); COMMIT`. Latency: B's return minus the moment C's "
  "COMMIT was acknowledged (the settling commit is then durable and visible; clamped at 0 when B "
  "returns first) and, as an upper bound, minus the moment C sent COMMIT (this one includes the "
  "commit's own WAL flush, which is the machine's fsync time, not wake-up time).")
w("")
w("| mode | p50 ms from COMMIT ack | p99 ms from COMMIT ack | p50 ms from COMMIT sent | p99 ms from COMMIT sent | max ms from sent | samples | outcome replay |")
w("|---|---:|---:|---:|---:|---:|---:|---:|")
wait = {}
for mode in ("preloaded", "not_preloaded"):
    v = extra.get("wait_" + mode)
    if v:
        f = v.split()
        wait[mode] = [float(x) for x in f[:5]]
        w("| %s | %s | %s | %s | %s | %s | %s | %s |" % (
            mode.replace("_", " "), f[3], f[4], f[0], f[1], f[2], f[5], f[6]))
w("")

# row 14
w("## Row 14: Redis peer (orientation only, no target)")
w("")
w("redis-benchmark, %s connections, no pipelining, loopback. A claim+finish is two round trips "
  "(SET NX EX, then SET EX): its ops/s is 1 / (1/a + 1/b) of the two measured commands, its mean the "
  "sum of their means." % re.search(r"CLIENTS=(\d+)", extra.get("params", "CLIENTS=?")).group(1)
  if "params" in extra else "")
w("")
w("| persistence | claim+finish ops/s | mean ms | vs row 1 | GET ops/s | GET p99 ms | vs row 8 |")
w("|---|---:|---:|---:|---:|---:|---:|")
for mode, name in (("default", "default (RDB snapshots, no AOF)"), ("always", "appendonly yes, appendfsync always")):
    try:
        s1 = [float(x) for x in extra["redis_%s_setnx" % mode].split()]
        s2 = [float(x) for x in extra["redis_%s_set" % mode].split()]
        g = [float(x) for x in extra["redis_%s_get" % mode].split()]
    except (KeyError, ValueError):
        continue
    op = 1.0 / (1.0 / s1[0] + 1.0 / s2[0])
    r1m, r8m = med("r1"), med("r8")
    w("| %s | %.0f | %.3f | %s | %.0f | %.3f | %s |" % (
        name, op, s1[1] + s2[1], fx(r1m / op) if r1m else "n/a", g[0], g[2],
        fx(r8m / g[0]) if r8m else "n/a"))
    chart.append(("redis_%s" % mode, op))
w("")
w("(\"vs row 1\" / \"vs row 8\": the extension's ops/s divided by Redis's.)")
w("")

# rows 15-18
r15 = {lb: ratio(lb, "r15_r1") for lb in ("r15a", "r15b", "r15c")}
r15_ac = ratio("r15a", "r15c")
redis15 = None
try:
    _a = [float(x) for x in extra["redis_always_p%d_setnx" % BATCH].split()]
    _b = [float(x) for x in extra["redis_always_p%d_set" % BATCH].split()]
    redis15 = (1.0 / (1.0 / _a[0] + 1.0 / _b[0]), _a, _b)
except (KeyError, ValueError, ZeroDivisionError):
    pass
if any(lb in runs for lb in ("r15a", "r15b", "r15c")) or redis15:
    w("## Row 15: a consumer's batch of %d keys per transaction" % BATCH)
    w("")
    w("Each pgbench transaction takes %d fresh keys, claims each, writes one business row per key into "
      "`bench.orders` and finishes each, then commits once (fsync on). (a) `idem_claim_many` over the "
      "key array (with a request per key), the business rows of the keys it answered `claimed` in one "
      "`INSERT ... SELECT unnest(keys)`, `idem_finish_many` with the keys and tokens; 4 statements and "
      "2 arrays back to the client. (c) the same statements with the one-key functions: "
      "`unnest(keys) ... LATERAL idem_claim(...)` and `unnest(keys, tokens) ... LATERAL idem_finish(...)`. "
      "(b) what a client does without either: %d x (`idem_claim`, one-row `INSERT`, `idem_finish`), one "
      "round trip each (%d statements) in one transaction. Row 1 (one key, claim and finish in 2 "
      "autocommit transactions) runs in the same rounds; each ratio is the median over rounds of "
      "(batch keys/s) / (row 1 ops/s) in the same round. Checked after every run: %d succeeded keys "
      "and %d business rows per transaction."
      % (BATCH, BATCH, 3 * BATCH + 2, BATCH, BATCH))
    w("")
    w("| variant | keys/s | transactions/s | mean ms per transaction | p99 ms | vs row 1 (same rounds) | per round |")
    w("|---|---:|---:|---:|---:|---:|---|")
    for lb, name in (("r15a", "(a) `idem_claim_many` + `idem_finish_many`"), ("r15b", "(b) %d single calls" % BATCH),
                     ("r15c", "(c) LATERAL one-key functions")):
        if lb in runs:
            w("| %s | %s | %s | %s | %s | %s | %s |" % (
                name, fmt(med(lb)), fmt(med(lb) / BATCH if med(lb) else None, "%.1f"),
                fmt(med(lb, "mean"), "%.2f"), fmt(med(lb, "p99"), "%.2f"), fx(r15[lb]), per_round(lb, "r15_r1")))
    if "r15_r1" in runs:
        w("| row 1 (one key per op) | %s ops/s | | %s | %s | 1.00x | |" % (
            fmt(med("r15_r1")), fmt(med("r15_r1", "mean"), "%.3f"), fmt(med("r15_r1", "p99"), "%.3f")))
    if redis15:
        op, _a, _b = redis15
        w("| (d) Redis, `appendfsync always`, pipelines of %d `SET NX EX` then %d `SET EX` | %.0f | | | | %s | not interleaved |"
          % (BATCH, BATCH, op, fx(op / med("r15_r1")) if med("r15_r1") else "n/a"))
    w("")
    if r15_ac is not None:
        w("(a) / (c) in the same rounds: %s (per round: %s); (a) / (b): %s."
          % (fx(r15_ac), per_round("r15a", "r15c"), fx(ratio("r15a", "r15b"))))
    if redis15:
        op, _a, _b = redis15
        w("")
        w("(d): redis-benchmark `-P %d`, %s connections, fresh random keys, Redis's append-only file "
          "fsynced before each reply (`appendfsync always`; one fsync per event-loop pass, so per "
          "pipeline or fewer): `SET NX EX` %.0f/s, `SET EX` %.0f/s, a key's claim + finish %.0f/s "
          "(1 / (1/a + 1/b)). It runs after PostgreSQL is stopped, not in the same rounds: its ratio "
          "to row 1 is orientation only."
          % (BATCH, (re.search(r"CLIENTS=(\d+)", extra.get("params", "")) or [None, "?"])[1],
             _a[0], _b[0], op))
    wl = ["(%s) %.0f" % (lb[-1], wal[lb][0] / wal[lb][1] / BATCH) for lb in ("r15a", "r15c") if lb in wal]
    if wl:
        w("")
        w("WAL bytes per key, one client, %d transactions of %d keys: %s (row 1: %s per claim + finish)."
          % (wal[("r15a" if "r15a" in wal else "r15c")][1], BATCH, ", ".join(wl), fmt(wal_per_op("r1"), "%.0f")))
    w("")

if "r16" in runs or "r17" in runs or any(k.startswith("takeover_") for k in extra):
    w("## Rows 16-18")
    w("")
if "r16" in runs:
    chk = extra.get("r16_checked", "").split()
    w("Row 16: %s pending keys (`bench.fill`, token = key) in `idempotency.keys` and in "
      "`bench.ckpt_plain` (`LIKE idempotency.keys INCLUDING ALL`: same columns and indexes). Each "
      "transaction: `BEGIN`, one business `INSERT`, then `idem_checkpoint(key, token, 'step', "
      "'{\"id\": 1}')` or `UPDATE bench.ckpt_plain SET phase = 'step', phase_data = '{\"id\": 1}' WHERE "
      "scope = 'ckpt' AND key = k AND token = t AND status = 'pending'`, `COMMIT`; each client on keys "
      "of its own. Checked: the `checkpoints` counter of `idempotency.stats` grew by %s for %s "
      "transactions (warm-ups included); keys with a checkpoint: %s (extension), %s (plain)."
      % (extra.get("n_ckpt", "?"), *(chk + ["?"] * 4)[:4]))
    w("")
if "r17" in runs:
    w("Row 17: row 1's script with `session_bound => true` in the claim, as a pair with row 1 "
      "(the session takes its binding, one advisory lock, at its first session-bound claim).")
    w("")
takeover = {}
for mode in ("kill", "terminate"):
    v = extra.get("takeover_" + mode)
    if v:
        f = v.split()
        takeover[mode] = [float(x) for x in f[:4]] + [int(f[4]), int(f[5])]
if takeover:
    lease = re.search(r"idempotency\.lease = (\d+) ms", extra.get("settings", "").replace(";", " "))
    lease_ms = float(lease.group(1)) if lease else 30000.0
    w("Row 18: session A claims a fresh key with `session_bound => true` (autocommit); session B "
      "calls `idem_claim(key, wait => '60 s')`; once B is seen waiting (`pg_stat_activity`: wait "
      "event type `Extension`), A dies: **kill** = SIGKILL of A's client process (a Python "
      "process of its own holding the connection), **terminate** = `pg_terminate_backend` of A's "
      "backend from a third session. Delay: from just before the kill (the signal or the "
      "`pg_terminate_backend` call) to B's claim returning; B must answer `claimed`, attempt 2 "
      "(`bench/takeover_latency.py`). Without the session binding B would get the key when the "
      "lease ends: %.0f s (`idempotency.lease`)." % (lease_ms / 1000))
    w("")
    w("| A dies by | p50 ms | p99 ms | max ms | mean ms | samples | claimed, attempt 2 | p99 / lease |")
    w("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, t in takeover.items():
        w("| %s | %.2f | %.2f | %.2f | %.2f | %d | %d | %.5f |" % (
            {"kill": "client killed (SIGKILL)", "terminate": "`pg_terminate_backend`"}[mode],
            t[0], t[1], t[2], t[3], t[4], t[5], t[1] / lease_ms))
    w("")

# rows 19-22
SQL_ROWS = [
    # row, SQL edition, C edition, floor, what, floor's description
    ("19", "r19", "r19c", "r19f", "claim + finish, autocommit (2 commits)", "bare `INSERT` + `UPDATE` (row 7)"),
    ("20", "r20", "r20c", "r20b", "replay of a finished key (%s keys)" % extra.get("n_replay", "?"),
     "bare primary-key `SELECT` (row 8)"),
    ("21", "r21", "r21c", "r21b", "retry storm, %s clients on 100 hot keys" % (
        re.search(r"STORM_CLIENTS=(\d+)", extra.get("params", "")) or [None, "8"])[1],
     "bound: bare `SELECT`s of the hot rows (row 9)"),
    ("22", "r22", "r22c", "r22f", "batch of %d keys: `idem_claim_many` + `INSERT ... SELECT` + `idem_finish_many`, **keys/s**" % BATCH,
     "bare `INSERT ... SELECT` of the pending rows + business rows + `INSERT ... ON CONFLICT DO UPDATE` to succeeded, one commit"),
]
if any(r[1] in runs for r in SQL_ROWS):
    w("## Rows 19-22: the SQL edition")
    w("")
    w("The SQL edition (`sql-edition/`, %s, installed by `idempotency-plain.sql` into database "
      "`bench_sql` of the same cluster) and the C edition (`CREATE EXTENSION` in database `bench`, "
      "the library preloaded) run the same pgbench script, each in its database, in the same rounds "
      "as the floor (in `bench`); each ratio is the median of the per-round ratios (each "
      "round's SQL / C below the table). *Time per call* is the inverse: SQL / C of 0.50x is 2x the C "
      "edition's time per call." % extra.get("sql_edition", "?"))
    w("")
    w("| row | operation | SQL edition | C edition | floor | SQL / C | SQL / floor | C / floor | floor |")
    w("|---|---|---:|---:|---:|---:|---:|---:|---|")
    for row, s_, c_, f_, what, fname in SQL_ROWS:
        if s_ not in runs:
            continue
        w("| %s | %s | %s | %s | %s | %s | %s | %s | %s |" % (
            row, what, fmt(med(s_)), fmt(med(c_)), fmt(med(f_)), fx(ratio(s_, c_)), fx(ratio(s_, f_)),
            fx(ratio(c_, f_)), fname))
        chart.append((s_, med(s_)))
    w("")
    w("Mean / p99 latency in ms (SQL edition, C edition, floor): " + "; ".join(
        "row %s: %s / %s, %s / %s, %s / %s" % (
            row, fmt(med(s_, "mean"), "%.3f"), fmt(med(s_, "p99"), "%.3f"), fmt(med(c_, "mean"), "%.3f"),
            fmt(med(c_, "p99"), "%.3f"), fmt(med(f_, "mean"), "%.3f"), fmt(med(f_, "p99"), "%.3f"))
        for row, s_, c_, f_, _w, _f in SQL_ROWS if s_ in runs) + ".")
    w("")
    w("SQL / C per round: " + "; ".join("row %s: %s" % (row, per_round(s_, c_))
                                         for row, s_, c_, _f, _w, _n in SQL_ROWS if s_ in runs) + ".")
    w("")
    for name, what in (("claim", "claim + finish (row 19's script)"), ("replay", "replay (row 20's script)")):
        head = extra.get("sqlprof_" + name)
        if not head:
            continue
        n, lat = head.split()[0], (head.split() + ["?"])[1]
        n = int(n)
        funcs = []
        for k, v in extra.items():
            if k.startswith("sqlprof_%s." % name):
                calls, total, self_ = v.split()
                if int(calls):      # pg_stat_reset() leaves the functions called before it at 0
                    funcs.append((k.split(".", 1)[1], int(calls), float(total), float(self_)))
        funcs.sort(key=lambda f: -f[3])
        top = [f for f in funcs if f[0] in ("idem_claim", "idem_finish")]
        client = sum(f[2] for f in top)
        checks = sum(f[3] for f in funcs if f[0] in ("_check_catalog", "_check_bindings"))
        w("Where the time goes, %s: %d ops by one client in `bench_sql` with `track_functions = all` "
          "(its clock reads slow each call down); pgbench's mean latency %s ms per op (the commits' "
          "flushes and round trips included). Total time per op of the client functions: %s. "
          "The catalog checks (`_check_catalog`, `_check_bindings`, self time): %.3f ms per op, %s of "
          "the client functions' time. Per function, largest self time first:" % (
              what, n, lat, ", ".join("`%s` %.3f ms" % (f[0], f[2] / n) for f in top) or "n/a",
              checks / n, ("%.0f%%" % (100 * checks / client)) if client else "n/a"))
        w("")
        w("| function | calls per op | self ms per op | total ms per op |")
        w("|---|---:|---:|---:|")
        for f in funcs[:12]:
            w("| `%s` | %.2f | %.4f | %.4f |" % (f[0], f[1] / n, f[3] / n, f[2] / n))
        w("")

# row 23
def spread(a, b):
    v = ratios_list(a, b)
    return "%.2f-%.2f" % (min(v), max(v)) if v else "n/a"


r23 = sorted({tuple(lb.split("_")[1:4]) for lb in runs if lb.startswith("r23_") and lb.endswith("_new")},
             key=lambda t: (int(t[0]), {"cf": 0, "cfa": 1}.get(t[1], 2), int(t[2])))
if r23:
    w("## Row 23: release 1.5 vs this tree, PostgreSQL %s" % " and ".join(sorted({t[0] for t in r23}, key=int)))
    w("")
    w("The same scripts against two builds of the extension: %s and %s. Each build is installed "
      "into a private copy of the PostgreSQL installation and runs in a cluster of its own (the main "
      "cluster's settings, ports PORT+1 and PORT+2); both clusters are up side by side and each round "
      "runs the two builds back to back, in reverse order every other round. Workloads: row 1's claim + "
      "finish (2 autocommit transactions, ops/s), the same with `synchronous_commit = off` in the session "
      "(the commits do not wait for fsync, so the code's own time shows) and row 15a's batch (`idem_claim_many` + `INSERT ... "
      "SELECT` + `idem_finish_many` of %d keys in one transaction, **keys/s**). Ratio: this tree / 1.5, "
      "the median of the per-round ratios; spread: the lowest and highest per-round ratio."
      % (extra.get("old_build", "?"), extra.get("new_build", "?"), BATCH))
    w("")
    for k, v in sorted(extra.items()):
        if k.startswith("r23_pg."):
            w("- PostgreSQL %s: %s" % (k[7:], v))
        if k.startswith("r23_skipped."):
            w("- PostgreSQL %s: skipped (%s)" % (k[12:], v))
    w("")
    w("| PostgreSQL | workload | clients | 1.5 ops/s (keys/s) | this tree ops/s (keys/s) | this tree / 1.5 | spread | p99 ms 1.5 | p99 ms this tree | rounds |")
    w("|---|---|---:|---:|---:|---:|---|---:|---:|---:|")
    for pg, wl, c in r23:
        o, n = "r23_%s_%s_%s_old" % (pg, wl, c), "r23_%s_%s_%s_new" % (pg, wl, c)
        w("| %s | %s | %s | %s | %s | %s | %s | %s | %s | %d |" % (
            pg, {"cf": "claim + finish", "cfa": "claim + finish, `synchronous_commit = off`"}.get(
                wl, "batch of %d (keys/s)" % BATCH), c,
            fmt(med(o)), fmt(med(n)), fx(ratio(n, o)), spread(n, o),
            fmt(med(o, "p99"), "%.2f"), fmt(med(n, "p99"), "%.2f"), len(ratios_list(n, o))))
    w("")
    w("Per round (this tree / 1.5): " + "; ".join(
        "PostgreSQL %s, %s, %s client(s): %s" % (pg, {"cf": "claim + finish", "cfa": "the same, asynchronous commit"}.get(wl, "batch"), c, per_round("r23_%s_%s_%s_new" % (pg, wl, c), "r23_%s_%s_%s_old" % (pg, wl, c)))
        for pg, wl, c in r23) + ".")
    w("")

# row 24
if "r24" in runs:
    r24 = ratio("r24", "r24f")
    w("## Row 24: claim + finish vs the floor at %s clients" % (
        re.search(r"CLIENTS_64=(\d+)", extra.get("params", "")) or [None, "64"])[1])
    w("")
    w("Row 1's script (claim + finish, 2 autocommit transactions) and row 7's (bare `INSERT` + `UPDATE` "
      "of `bench.floor_keys`) with many clients, so that commits share WAL flushes (group commit); "
      "interleaved rounds. p50 and p99 are of the whole pgbench transaction (both statements).")
    w("")
    w("| script | ops/s | p50 ms | p99 ms | p99 / p50 | mean ms |")
    w("|---|---:|---:|---:|---:|---:|")
    for lb, name in (("r24", "claim + finish (row 1)"), ("r24f", "floor (row 7)"),
                     ("r24s", "floor with the sweep_at index")):
        if lb not in runs:
            continue
        p50, p99 = med(lb, "p50"), med(lb, "p99")
        w("| %s | %s | %s | %s | %s | %s |" % (name, fmt(med(lb)), fmt(p50, "%.2f"), fmt(p99, "%.2f"),
                                              fmt(p99 / p50 if p50 and p99 else None, "%.1f"), fmt(med(lb, "mean"), "%.2f")))
    w("")
    w("Claim + finish / floor: %s (per round: %s)." % (fx(r24), per_round("r24", "r24f")))
    if "r24s" in runs:
        w("")
        w("The same floor on a table that also has an index on `sweep_at` (its `UPDATE` leaves "
          "`sweep_at` alone, as `idem_finish` does): floor with the index / floor %s (per round: %s); "
          "claim + finish / floor with the index %s (per round: %s)." % (
              fx(ratio("r24s", "r24f")), per_round("r24s", "r24f"),
              fx(ratio("r24", "r24s")), per_round("r24", "r24s")))
    for name in ("ext", "floor", "floor_sweep"):
        v = extra.get("waits_r24.%s" % name)
        if v:
            f = v.split()
            tot = int(f[1]) or 1
            w("")
            w("Wait events of the %s backends (`pg_stat_activity` every 20 ms, %s samples, %s backend "
              "samples; CPU = no wait event): %s." % (
                  {"ext": "claim + finish", "floor": "floor",
                   "floor_sweep": "floor-with-index"}[name], f[0], f[1],
                  ", ".join("%s %.0f%%" % (e.split("=")[0], 100.0 * int(e.split("=")[1]) / tot) for e in f[2:10])))
    w("")

# row 25
if "r25_bytes" in extra or "r25r" in runs:
    w("## Row 25: remembered keys")
    w("")
    if "r25_bytes" in extra:
        tot, heap, idx, n = (int(x) for x in extra["r25_bytes"].split())
        line = ("Table + index bytes per remembered key (the compact record a sweep leaves: a clean copy "
                "of the table shape holding %d of them with 36-character keys, after VACUUM): **%.0f bytes** "
                "(heap %.0f, indexes %.0f)" % (n, tot / n, heap / n, idx / n))
        if "r25_bytes_finished" in extra:
            ftot, fheap, fidx, fn = (int(x) for x in extra["r25_bytes_finished"].split())
            line += "; the same number of finished keys with their (small) response bodies: %.0f bytes" % (ftot / fn)
        w(line + ".")
        w("")
    sweeps = {}
    for k, v in extra.items():
        m = re.match(r"r25_sweep\.(compact|delete)\.(\d+)$", k)
        if m:
            secs, swept, n = v.split()
            sweeps.setdefault(m.group(1), []).append((float(secs), int(swept), int(n)))
    if sweeps:
        w("The sweep (`idem_sweep` batches of `idempotency.sweep_batch`, each committed, until none is due), "
          "on keys whose retention has just passed, %s rounds alternating the order: " % len(sweeps.get("compact", [])) +
          "; ".join("%s %s keys: median %.2f s, **%.1f µs per key**" % (
              {"compact": "compacting (remembered)", "delete": "deleting (not remembered)"}[v],
              sweeps[v][0][2], statistics.median(x[0] for x in sweeps[v]),
              1e6 * statistics.median(x[0] / x[2] for x in sweeps[v]))
              for v in ("compact", "delete") if v in sweeps) + ".")
        w("")
    if "r25r" in runs:
        nrem = (extra.get("r25_n_remembered", "? ?").split() + ["?"])[0]
        w("Row 1 (claim + finish, autocommit) with its new keys landing among %s remembered keys of the same "
          "scope, among as many finished keys (live, with their bodies: what the same keys cost before their "
          "retention ends), and on an empty table (emptied after every run), %s interleaved rounds:" % (
              nrem, len(ratios_list("r25r", "r25e"))))
        w("")
        w("| table | ops/s | mean ms | p99 ms |")
        w("|---|---:|---:|---:|")
        for lb, name in (("r25e", "empty"), ("r25r", "%s remembered keys" % nrem),
                         ("r25f", "%s finished keys" % nrem)):
            if lb in runs:
                w("| %s | %s | %s | %s |" % (name, fmt(med(lb)), fmt(med(lb, "mean"), "%.2f"), fmt(med(lb, "p99"), "%.2f")))
        w("")
        w("Among remembered keys / empty: %s (per round: %s)." % (fx(ratio("r25r", "r25e")), per_round("r25r", "r25e")))
        if "r25f" in runs:
            w("Among remembered keys / among finished keys: %s (per round: %s)." % (
                fx(ratio("r25r", "r25f")), per_round("r25r", "r25f")))
        w("")

# row 26
r26 = {}
for k, v in extra.items():
    m = re.match(r"r26_sweep\.(one|many)\.(\d+)$", k)
    if m:
        secs, swept, n, q0, q1 = v.split()
        r26.setdefault(m.group(1), []).append((float(secs), int(swept), int(n), float(q1)))
takes = [tuple(float(x) for x in v.split()) for k, v in extra.items() if re.match(r"r26_take\.\d+$", k)]
if r26 or takes or "r26k" in runs:
    w("## Row 26: completers")
    w("")
    if r26:
        n = (r26.get("one") or r26.get("many"))[0][2]
        w("The sweep (`idem_sweep` batches of `idempotency.sweep_batch`, each committed, until none is due) "
          "resetting %d pending keys whose lease had ended, with a session listening on "
          "`idempotency_abandoned` that reads nothing, %d rounds alternating the order: " % (n, len(r26.get("one", []))) +
          "; ".join("%s: median %.2f s, **%.1f µs per key** (notification queue %.2f%% full after)" % (
              {"one": "all in one scope (one notification per sweep transaction)",
               "many": "each in a scope of its own (a notification per key)"}[v],
              statistics.median(x[0] for x in r26[v]), 1e6 * statistics.median(x[0] / x[2] for x in r26[v]),
              100 * statistics.median(x[3] for x in r26[v]))
              for v in ("one", "many") if v in r26) + ".")
        if "one" in r26 and "many" in r26:
            w("")
            w("One notification per key / one per sweep transaction: %.2fx the time." % (
                statistics.median(x[0] for x in r26["many"]) / statistics.median(x[0] for x in r26["one"])))
        w("")
    if takes:
        w("`idem_claim_abandoned(scope, 1000, '1 hour')`, each call committed, taking over the %d reset keys of one "
          "scope: median %.2f s, **%.1f µs per key**." % (
              int(takes[0][2]), statistics.median(t[0] for t in takes),
              1e6 * statistics.median(t[0] / max(t[1], 1) for t in takes)))
        w("")
    if "r26k" in runs:
        w("Row 1 (claim + finish, autocommit) with `keep_request => true` against without it, %s interleaved rounds:" %
          len(ratios_list("r26k", "r26p")))
        w("")
        w("| claim | ops/s | mean ms | p99 ms |")
        w("|---|---:|---:|---:|")
        for lb, name in (("r26p", "without keep_request"), ("r26k", "keep_request")):
            if lb in runs:
                w("| %s | %s | %s | %s |" % (name, fmt(med(lb)), fmt(med(lb, "mean"), "%.2f"), fmt(med(lb, "p99"), "%.2f")))
        w("")
        w("keep_request / without: %s (per round: %s)." % (fx(ratio("r26k", "r26p")), per_round("r26k", "r26p")))
        w("")

# targets
w("## Targets")
w("")
w("| target | measured | |")
w("|---|---|---|")
r1_7 = ratio("r1", "r7")
r1_7t = ratio("r1t", "r7t")
if r1_7t is not None:
    # the pair has PAIR_RUNS rounds; the group's 7 rounds are shown next to it
    w("| row 1 >= 0.9x row 7 (aim 0.95x) | %s as a pair over %d rounds (per round: %s); in the rows 1-7 group: %s (per round: %s) | %s |" % (
        fx(r1_7t), len(ratios_list("r1t", "r7t")), per_round("r1t", "r7t"),
        fx(r1_7), per_round("r1", "r7"), yes(r1_7t >= 0.9)))
else:
    w("| row 1 >= 0.9x row 7 (aim 0.95x) | %s (per round: %s) | %s |" % (
        fx(r1_7), per_round("r1", "r7"), yes(None if r1_7 is None else r1_7 >= 0.9)))


def bounded_target(name, label, peer, target, bound_label, bound_text):
    """A target against a peer, next to the bound: the least work any implementation must do,
    measured against the same peer; a target above the bound cannot be met by any."""
    value, bound = ratio(label, peer), ratio(bound_label, peer)
    if value is not None and value >= target:
        verdict = "**met**"
    elif bound is not None and bound < target:
        verdict = "**impossible** (the bound is %s)" % fx(bound)
    else:
        verdict = yes(None if value is None else value >= target)
    w("| %s | %s (per round: %s)%s | %s |" % (
        name, fx(value), per_round(label, peer),
        "; bound: %s run at %s (per round: %s)" % (
            bound_text, fx(bound), per_round(bound_label, peer))
        if bound is not None else "", verdict))


bounded_target("row 1 >= 2x row 6", "r1", "r6", 2, "r7c", "two minimal durable commits, against row 6,")
r8 = ratio("r8", "r8b")
w("| row 8 >= 0.9x bare PK read | %s (per round: %s) | %s |" % (
    fx(r8), per_round("r8", "r8b"), yes(None if r8 is None else r8 >= 0.9)))
# Records the measured ops do not write: opportunistic page pruning (any read of a page with
# dead tuples may do it, a bare SELECT too) and the background writer's periodic snapshot of
# running transactions (transaction 0, every 15 s whatever the load).
NOT_THE_OPS = {"Heap2/PRUNE": "page pruning done by the read, as a bare SELECT would",
               "Standby/RUNNING_XACTS": "the background writer's running-transactions snapshot, tx 0"}


def own_wal(label):
    """WAL bytes/op without the NOT_THE_OPS records; (bytes/op, {type: count})."""
    if label not in wal:
        return None, {}
    b, n = wal[label]
    recs, total = waldump(label)
    other = [r for r in recs if r[0] in NOT_THE_OPS]
    return (b - sum(r[4] for r in other)) / n, {r[0]: r[1] for r in other}


def wal_target(label, name):
    b, other = own_wal(label)
    note = "".join(" (plus %d %s record(s) over %d ops: %s)" % (c, t, wal[label][1], NOT_THE_OPS[t])
                   for t, c in sorted(other.items()))
    w("| %s | %s bytes/op%s | %s |" % (name, fmt(b, "%.2f"), note, yes(None if b is None else b < 1)))


wal_target("r8", "row 8: 0 WAL bytes per replay")
bounded_target("row 9 >= 2.5x row 6's storm", "r9", "r9p", 2.5, "r9b",
               "bare SELECTs of the hot rows, against the peer's storm,")
wal_target("r10", "row 10 writes no WAL")
lw = extra.get("lockwait_samples")
if lw:
    s, busy, waits = (int(x) for x in lw.split())
    w("| row 10 never waits on a lock | %d of %d samples of pg_stat_activity had a claim running; "
      "claims seen waiting on a lock: %d | %s |" % (busy, s, waits, yes(waits == 0)))
w("| row 11: sweep >= 0.5x bare DELETE | %s | %s |" % (fx(r11a), yes(None if r11a is None else r11a >= 0.5)))
r11b = ratio("r11_worker_on", "r11_worker_off")
w("| row 11: claims while the worker sweeps >= 0.8x without | %s | %s |" % (fx(r11b), yes(None if r11b is None else r11b >= 0.8)))
w("| row 12: big-table ratio >= 0.95x small-table ratio | %s, median of per-round quotients (%s keys: %s over %d rounds / %s over %d rounds) | %s |" % (
    fx(r12), nb[0] if nb else "?", fx(r12b), len(ratios_list("r12b_ext", "r12b_floor")),
    fx(r12s), len(ratios_list("r12s_ext", "r12s_floor")), yes(None if r12 is None else r12 >= 0.95)))
p = wait.get("preloaded")
w("| row 13: p99 <= 5 ms preloaded | %s ms from the COMMIT's acknowledgement (%s ms from COMMIT sent, fsync included) | %s |" % (
    fmt(p[4], "%.2f") if p else "n/a", fmt(p[1], "%.2f") if p else "n/a", yes(None if not p else p[4] <= 5)))
r15a_ = r15.get("r15a")
if r15a_ is not None:
    w("| row 15: batch of %d keys (a) >= 5x row 1's ops/s, keys per second (aim 10x) | (a) %s, (c) %s, (b) %s, Redis (d) %s; (a) / (c) %s | %s |" % (
        BATCH, fx(r15a_), fx(r15.get("r15c")), fx(r15.get("r15b")),
        fx(redis15[0] / med("r15_r1")) if redis15 and med("r15_r1") else "n/a", fx(r15_ac),
        yes(r15a_ >= 5)))
r16 = ratio("r16", "r16b")
if r16 is not None:
    w("| row 16: INSERT + `idem_checkpoint` >= 0.9x INSERT + bare UPDATE | %s over %d rounds (per round: %s) | %s |" % (
        fx(r16), len(ratios_list("r16", "r16b")), per_round("r16", "r16b"), yes(r16 >= 0.9)))
r17 = ratio("r17", "r17_r1")
if r17 is not None:
    w("| row 17: session-bound claim + finish >= 0.95x row 1 | %s over %d rounds (per round: %s) | %s |" % (
        fx(r17), len(ratios_list("r17", "r17_r1")), per_round("r17", "r17_r1"), yes(r17 >= 0.95)))
for row, what in (("19", "claim + finish"), ("20", "replay")):
    _r = ratio("r" + row, "r%sc" % row)
    if _r is not None:
        w("| row %s: the SQL edition's time per call <= 1.5x the C edition's, %s | %s the C edition's time per call (SQL / C ops/s %s over %d rounds; per round: %s) | %s |" % (
            row, what, fx(1 / _r), fx(_r), len(ratios_list("r" + row, "r%sc" % row)),
            per_round("r" + row, "r%sc" % row), yes(1 / _r <= 1.5)))
if "r24" in runs:
    _r, _p50, _p99 = ratio("r24", "r24f"), med("r24", "p50"), med("r24", "p99")
    w("| row 24: claim + finish at 64 clients >= 0.9x the floor, p99 <= 3x p50 | %s (per round: %s); p99 / p50 %s | %s |" % (
        fx(_r), per_round("r24", "r24f"), fmt(_p99 / _p50 if _p50 and _p99 else None, "%.1f"),
        yes(None if _r is None or not _p50 else _r >= 0.9 and _p99 <= 3 * _p50)))
for mode, t in takeover.items():
    w("| row 18: takeover after the session dies < 100 ms (%s) | p50 %.2f ms, p99 %.2f ms, max %.2f ms over %d; %d of %d claimed with attempt 2 | %s |" % (
        {"kill": "client killed", "terminate": "backend terminated"}[mode], t[0], t[1], t[2], t[4], t[5], t[4],
        yes(t[1] < 100 and t[5] == t[4])))
w("")
w("Ratios are medians of per-round ratios; a single round proves nothing on this machine.")
w("")
w("![ops/s per row](chart.png)")
w("")

with open(os.path.join(bench, "RESULTS.md"), "w") as f:
    f.write("\n".join(lines))

# ------------------------------------------------------------------ chart
names = {"r1": "1 ext autocommit", "r2": "2 ext one xact", "r3": "3 seed xact", "r4": "4 seed autocommit",
         "r5": "5 seed advisory", "r6": "6 PL/pgSQL peer", "r7": "7 floor",
         "r8": "8 ext replay", "r8b": "8 bare SELECT", "r8p": "8 peer replay",
         "r9": "9 ext storm", "r9p": "9 peer storm", "r10": "10 ext in_progress",
         "r10b": "10 bare SELECT", "r10p": "10 peer in_progress",
         "r11_worker_on": "11 claims, worker on", "r11_worker_off": "11 claims, worker off",
         "r12s_ext": "12 row1 small", "r12s_floor": "12 row7 small", "r12b_ext": "12 row1 big",
         "r12b_floor": "12 row7 big", "redis_default": "14 Redis claim", "redis_always": "14 Redis fsync always",
         "r15a": "15a keys/s, batch calls", "r15b": "15b keys/s, single",
         "r15c": "15c keys/s, LATERAL", "r16": "16 INSERT+checkpoint", "r16b": "16 INSERT+UPDATE",
         "r17": "17 session-bound claim", "r19": "19 SQL ed. claim", "r20": "20 SQL ed. replay",
         "r21": "21 SQL ed. storm", "r22": "22 SQL ed. keys/s, batch"}


def color(label):
    if label.startswith("redis"):
        return "0xC0392B"
    if label in ("r7", "r8b", "r10b", "r16b") or label.endswith("_floor"):
        return "0x27AE60"
    if label in ("r3", "r4", "r5", "r6", "r8p", "r9p", "r10p"):
        return "0x95A5A6"
    return "0x2E86C1"


dat = os.path.join(out_dir, "chart.dat")
os.makedirs(out_dir, exist_ok=True)
with open(dat, "w") as f:
    for i, (label, v) in enumerate(c for c in chart if c[1]):
        f.write('%d "%s" %.1f %s\n' % (i, names.get(label, label), v, color(label)))
subprocess.run(["gnuplot", "-e", "datafile='%s'; outfile='%s'" % (dat, os.path.join(bench, "chart.png")),
                os.path.join(bench, "chart.gp")], check=False)
