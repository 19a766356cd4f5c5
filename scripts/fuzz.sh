#!/usr/bin/env bash
# scripts/fuzz.sh: ./run fuzz, the project's own fuzzers with a verdict.
#   scripts/fuzz.sh [--minutes N] [--workers N] [--seed N] [--keep]
#                   [--no-build] [--out DIR]
#
# As root: installs what is missing (apt: sqlsmith, python3-hypothesis,
# python3-psycopg, and the build's packages), builds the extension from a
# copy of this tree and installs it into the PostgreSQL of PG_CONFIG, starts
# a throwaway cluster as the postgres user on a private port and socket
# directory (the library preloaded, the background worker sweeping every
# second, track_functions = all), makes a database with the extension, the
# fuzzers' roles and keys in every state (test/fuzz/setup.sql), then splits
# --minutes (default 10) in two halves:
#   1. SQLsmith, as the role fuzz_smith (EXECUTE on every function of the
#      extension, no superuser): random queries over every table, view and
#      function it can see, ours among them, in batches of 1,000 queries
#      with seeds from --seed on; it logs each error with its SQLSTATE into
#      a second database of the cluster, fuzzlog;
#   2. test/fuzz/properties.py (Hypothesis), --workers processes (4) with
#      connections of their own: calls of every function of the extension
#      with hostile arguments in every kind of transaction, checking that
#      no connection is lost, every SQLSTATE is documented, a failed or
#      rolled-back call changes no row, and READ ONLY refuses every write.
# Then the checks: the server never crashed (its log has no "terminated by
# signal", PANIC or TRAP, pg_postmaster_start_time() is unchanged, it still
# accepts connections) after each half, and amcheck finds idempotency.keys
# and its indexes clean.  Ends with "N passed, N failed"; exit status 0 only
# when every check passed.
#
# Counts go to the output and to --out (default bench/out/fuzz/):
# sqlsmith.log, sqlsmith-errors.txt (errors by SQLSTATE), properties.log,
# properties.json, server.log.  The cluster is stopped (by its data
# directory) and the scratch directory removed at exit; --keep keeps that
# directory (the cluster stopped).  --no-build runs against the extension
# already installed in PG_CONFIG's PostgreSQL (./run test's short run).
#
# Settings (environment): PG_CONFIG (default Debian's 15), IDEM_FUZZ_PORT
# (default 55472).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly ROOT
PY=/usr/bin/python3
: "${IDEM_FUZZ_PORT:=55472}"

# shellcheck source=scripts/cluster.sh
source "$ROOT/scripts/cluster.sh"
# shellcheck source=scripts/setup.sh
source "$ROOT/scripts/setup.sh"
# shellcheck source=scripts/suites.sh
source "$ROOT/scripts/suites.sh"

MINUTES=10 WORKERS=4 SEED="" KEEP=0 BUILD=1 WORK=""
SMITH_BATCH=1000  # queries per SQLsmith process; each batch has a seed of its own
out="$ROOT/bench/out/fuzz"

usage() {
	echo "usage: ./run fuzz [--minutes N] [--workers N] [--seed N] [--keep] [--no-build] [--out DIR]" >&2
	exit 2
}

while (($#)); do
	case $1 in
	--minutes)
		[[ ${2:-} =~ ^[0-9]+(\.[0-9]+)?$ ]] || usage
		MINUTES=$2
		shift 2
		;;
	--workers | --seed)
		[[ ${2:-} =~ ^[0-9]+$ ]] || usage
		if [[ $1 == --workers ]]; then WORKERS=$2; else SEED=$2; fi
		shift 2
		;;
	*)
		setup_run_option "$@" || usage
		shift "$SETUP_SHIFT"
		;;
	esac
done
[[ -n $SEED ]] || SEED=$((RANDOM * 32768 + RANDOM))

# psql as postgres to database <db> of the cluster, quiet, stopping on error.
fuzz_psql() {
	local db=$1
	shift
	cluster_psql "$dir" -q -d "$db" "$@"
}

# Record check <name>: the server did not crash.  It still accepts
# connections, its postmaster started when it did at first, and its log has
# none of the lines a crashed backend leaves.
check_no_crash() {
	local name=$1 now why=""
	now=$(fuzz_psql postgres -At -c 'SELECT pg_catalog.pg_postmaster_start_time()' 2>&1) ||
		why="the server does not accept connections: $now"
	if [[ -z $why && $now != "$START_TIME" ]]; then
		why="the postmaster restarted (started $START_TIME, now $now)"
	fi
	if [[ -z $why ]] && grep -Eq 'terminated by signal|was terminated by exception|PANIC:|TRAP:' "$dir/server.log"; then
		why="the server log reports a crash: $(grep -Em1 'terminated by signal|was terminated by exception|PANIC:|TRAP:' "$dir/server.log")"
	fi
	if [[ -z $why ]]; then
		test_pass "$name"
	else
		test_fail "$name" "$why"
	fi
}

# SQLsmith for <seconds>, in batches of SMITH_BATCH queries, each with a
# seed of its own; SMITH_QUERIES counts the queries they sent.
run_sqlsmith() {
	local seconds=$1 deadline=$((SECONDS + $1)) batch=0 left rc generated
	local host target logto
	host=$(cluster_host "$dir")
	target="host=$host port=$IDEM_FUZZ_PORT dbname=fuzz user=fuzz_smith"
	logto="host=$host port=$IDEM_FUZZ_PORT dbname=fuzzlog user=postgres"
	SMITH_QUERIES=0
	echo "== SQLsmith: ${seconds}s as fuzz_smith, seeds $SEED, $((SEED + 1)), ... ($SMITH_BATCH queries each)"
	while ((SECONDS < deadline)); do
		left=$((deadline - SECONDS))
		rc=0
		timeout -k 10 "$left" sqlsmith --target="$target" --log-to="$logto" \
			--seed=$((SEED + batch)) --max-queries=$SMITH_BATCH >>"$out/sqlsmith.log" 2>&1 || rc=$?
		if ((rc == 0)); then
			SMITH_QUERIES=$((SMITH_QUERIES + SMITH_BATCH))
		else
			# stopped by the time budget (or failed): what it logged it sent
			generated=$(fuzz_psql fuzzlog -At -c 'SELECT coalesce(generated, 0) FROM stat ORDER BY id DESC LIMIT 1')
			SMITH_QUERIES=$((SMITH_QUERIES + ${generated:-0}))
			if ((rc != 124 && rc != 137)); then
				echo "-- sqlsmith (seed $((SEED + batch))) exited with status $rc; the end of its output:"
				tail -n 5 "$out/sqlsmith.log"
				sleep 1 # a server that went away: the checks below say so
			fi
		fi
		batch=$((batch + 1))
	done
	sqlsmith_report
}

# Print SQLsmith's queries and errors by SQLSTATE (all of them, and those of
# queries that call the extension), and the calls of the extension's
# functions that returned (pg_stat_user_functions).
sqlsmith_report() {
	local ours="query ~ '(idempotency\\.|fuzz_data\\.(claim|claim_many|finish_many|lookup|sweep)\\()'"
	{
		echo "queries: $SMITH_QUERIES"
		fuzz_psql fuzzlog -At -F ' ' -c "SELECT 'errors:', count(*), 'of them in queries that use the extension:', count(*) FILTER (WHERE $ours) FROM error"
		echo "errors by SQLSTATE (all, in queries that use the extension, a message):"
		fuzz_psql fuzzlog -At -F $'\t' -c "SELECT sqlstate, count(*), count(*) FILTER (WHERE $ours),
				left(split_part(min(msg), E'\\n', 1), 100)
			FROM error GROUP BY 1 ORDER BY 2 DESC"
		echo "internal errors (XX class) in queries that use the extension:"
		fuzz_psql fuzzlog -At -c "SELECT split_part(msg, E'\\n', 1) || ' -- '
				|| left(regexp_replace(query, '\\s+', ' ', 'g'), 400)
			FROM error WHERE sqlstate LIKE 'XX%' AND $ours LIMIT 20"
		echo "calls of the extension's functions that returned (pg_stat_user_functions):"
		fuzz_psql fuzz -At -F $'\t' -c "SELECT schemaname || '.' || funcname, sum(calls)
			FROM pg_catalog.pg_stat_user_functions
			WHERE schemaname IN ('idempotency', 'fuzz_data') GROUP BY 1 ORDER BY 1"
	} | tee "$out/sqlsmith-errors.txt"
}

setup_require_root
setup_packages sqlsmith python3-hypothesis python3-psycopg
setup_scratch fuzz "$ROOT"

mkdir -p "$out"
rm -f "$out/sqlsmith.log"
dir="$WORK/cluster"
echo "== starting a throwaway cluster in $dir (port $IDEM_FUZZ_PORT, $("$PG_CONFIG" --version))"
cluster_start "$dir" "$IDEM_FUZZ_PORT" "shared_preload_libraries = 'idempotency'" \
	"idempotency.sweep_interval = '1s'" "track_functions = 'all'"
fuzz_psql postgres -c 'CREATE DATABASE fuzz' -c 'CREATE DATABASE fuzzlog'
fuzz_psql fuzz -c 'CREATE EXTENSION idempotency' -f "$ROOT/test/fuzz/setup.sql" >/dev/null
# SQLsmith's --log-to schema: the columns it writes
fuzz_psql fuzzlog <<'EOF'
CREATE TABLE instance (id bigserial PRIMARY KEY, rev text, target text, hostname text,
	version text, seed text, t timestamptz DEFAULT now());
CREATE TABLE error (id bigint REFERENCES instance, msg text, query text, sqlstate text,
	t timestamptz DEFAULT now());
CREATE TABLE stat (id bigint REFERENCES instance, generated bigint, level float8,
	nodes float8, retries float8, impedance text, updated timestamptz);
EOF
START_TIME=$(fuzz_psql postgres -At -c 'SELECT pg_catalog.pg_postmaster_start_time()')

total=$(awk -v m="$MINUTES" 'BEGIN { printf "%d", m * 60 }')
smith=$((total / 2))
echo "== fuzzing for ${total}s: ${smith}s SQLsmith, then $((total - smith))s properties (seed $SEED)"
run_sqlsmith "$smith"
check_no_crash "sqlsmith: no crash"

echo
echo "== properties (test/fuzz/properties.py): $((total - smith))s, $WORKERS workers"
if "$PY" "$ROOT/test/fuzz/properties.py" --host "$(cluster_host "$dir")" --port "$IDEM_FUZZ_PORT" \
	--dbname fuzz --minutes "$(awk -v s="$((total - smith))" 'BEGIN { print s / 60 }')" \
	--workers "$WORKERS" --seed "$SEED" --json "$out/properties.json" 2>&1 |
	tee "$out/properties.log"; then
	test_pass properties
else
	test_fail properties "see $out/properties.log"
fi
check_no_crash "no crash"

echo
echo "== amcheck of idempotency.keys"
if "$PY" "$ROOT/test/fuzz/properties.py" --host "$(cluster_host "$dir")" --port "$IDEM_FUZZ_PORT" \
	--dbname fuzz --amcheck; then
	test_pass amcheck
else
	test_fail amcheck
fi
cp "$dir/server.log" "$out/server.log"
test_summary
