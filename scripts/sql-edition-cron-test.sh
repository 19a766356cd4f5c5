#!/usr/bin/env bash
# scripts/sql-edition-cron-test.sh [PG_CONFIG]: the SQL edition's sweep
# scheduled with pg_cron, as docs/editions.md documents it.
#
# Starts a throwaway cluster of a PostgreSQL that has pg_cron (default:
# Debian's PostgreSQL 15 with postgresql-15-cron), preloads pg_cron there
# (background workers, so that no connection settings are needed), runs
# the plain installer into the database pg_cron serves, makes a finished
# key whose retention has passed (and one remembered after it) and a
# pending key whose lease has ended,
# schedules
#
#   SELECT cron.schedule('idempotency-sweep', '* * * * *',
#                        'SELECT idempotency.idem_sweep()');
#
# and checks that the job is registered, waits (at most CRON_TIMEOUT
# seconds, default 150: pg_cron before 1.5 runs jobs on minute boundaries
# only) until cron.job_run_details records a successful run of it, and
# then that the expired key is gone, the remembered one compacted (it
# answers expired) and the stale one is reset (its next claim is attempt 2).
# A session that LISTENs on idempotency_abandoned from before the schedule
# (as a completer does) receives the scope of the reset key, once, and
# nothing for the scope of a key the run deleted.  The C edition may be installed in that PostgreSQL:
# the plain installer needs no extension files, and the database never
# creates the extension.
#
# The cluster listens on IDEM_CRON_PORT (default 55546) and lives in a
# temporary directory, removed at exit (kept when KEEP=1).
#
# Exit status: 0 passed; 1 failed; 2 usage or setup failure; 3 pg_cron is
# not available in that PostgreSQL.
set -euo pipefail

pg_config=${1:-/usr/lib/postgresql/15/bin/pg_config}
[[ -x $pg_config ]] || { echo "sql-edition-cron-test: no pg_config at $pg_config" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
port=${IDEM_CRON_PORT:-55546}
timeout=${CRON_TIMEOUT:-150}
bindir=$("$pg_config" --bindir)
if [[ ! -e $("$pg_config" --sharedir)/extension/pg_cron.control ]]; then
	echo "pg_cron test skipped: pg_cron is not installed in $bindir/.. (Debian: apt-get install postgresql-15-cron)"
	exit 3
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/sql-edition-cron.XXXXXX")
chmod 755 "$work"
export PG_BIN=$bindir
# shellcheck source=scripts/cluster.sh
source "$root/scripts/cluster.sh"
cleanup() {
	cluster_stop "$work/cluster" >/dev/null 2>&1 || true
	if [[ ${KEEP:-0} == 1 ]]; then echo "kept $work"; else rm -rf "$work"; fi
}
trap cleanup EXIT

db=idem_cron
"$root/scripts/sql-edition.sh" "$work/dist" >/dev/null
mkdir -p "$work/cluster"
chown -R "${PG_OS_USER:-postgres}": "$work"
cluster_start "$work/cluster" "$port" \
	"shared_preload_libraries = 'pg_cron'" \
	"cron.database_name = '$db'" \
	"cron.use_background_workers = on" \
	"max_worker_processes = 16" >/dev/null
cluster_psql "$work/cluster" -q -c "CREATE DATABASE $db" >/dev/null
q() { cluster_psql "$work/cluster" -d "$db" -X -At -q -v ON_ERROR_STOP=1 "$@"; }
q -f "$work/dist/idempotency-plain.sql" >"$work/install.log" 2>&1 ||
	{ cat "$work/install.log" >&2; exit 2; }
q -c "CREATE EXTENSION pg_cron" >/dev/null
echo "pg_cron $(q -c "SELECT extversion FROM pg_extension WHERE extname = 'pg_cron'"), $(q -c "SELECT version()" | cut -d' ' -f1-2)"

fails=0
check() {				# check NAME EXPECTED ACTUAL
	if [[ $2 == "$3" ]]; then
		echo "ok - $1"
	else
		echo "not ok - $1: expected '$2', got '$3'"
		fails=$((fails + 1))
	fi
}

# A finished key whose retention passes in a second, one remembered for a
# day after that, a pending one whose lease ends in a second; then wait
# until every deadline has passed.
q <<'SQL' >"$work/setup.log" || { cat "$work/setup.log" >&2; exit 2; }
SELECT idempotency.idem_finish('done', c.token, 200, NULL, 'cron', 'succeeded', '1 second')
  FROM idempotency.idem_claim('done', scope => 'cron', lease => '1 second', retention => '1 second') c;
SELECT idempotency.idem_finish('rem', c.token, 201, '{"r": 1}', 'cron', 'succeeded', '1 second',
                               remember => '1 day')
  FROM idempotency.idem_claim('rem', '{"r": 1}', scope => 'cron', lease => '1 second',
                              retention => '1 second') c;
SELECT outcome FROM idempotency.idem_claim('stale', scope => 'cron', lease => '1 second',
                                          keep_request => true);
SELECT idempotency.idem_finish('old', c.token, 200, NULL, 'cron-deleted', 'succeeded', '1 second')
  FROM idempotency.idem_claim('old', scope => 'cron-deleted', lease => '1 second', retention => '1 second') c;
DO $$
BEGIN
	WHILE clock_timestamp() <= (SELECT max(CASE WHEN status = 'pending' THEN lease_until ELSE expires_at END)
								 FROM idempotency.keys WHERE scope IN ('cron', 'cron-deleted')) LOOP
		PERFORM pg_sleep(0.05);
	END LOOP;
END $$;
SQL
check "before the sweep: the three keys stored" "3" "$(q -c "SELECT count(*) FROM idempotency.keys WHERE scope = 'cron'")"

# A completer's session: it listens before the sweep is scheduled.  psql
# prints the notifications that have arrived after each command it runs,
# so the check below asks it to run one, again and again, until the one it
# waits for is printed or the time is up (its output line-buffered, so
# that each line is in the file once printed).
listen_out=$work/listen.out
coproc LISTENER {
	stdbuf -oL "$PG_BIN/psql" -X -h "$(cluster_host "$work/cluster")" -p "$port" -U postgres \
		-d "$db" -At -q >"$listen_out" 2>&1
}
echo "LISTEN idempotency_abandoned;" >&"${LISTENER[1]}"
echo "SELECT 'listening';" >&"${LISTENER[1]}"
deadline=$((SECONDS + 30))
until grep -q '^listening$' "$listen_out" 2>/dev/null || ((SECONDS >= deadline)); do
	sleep 0.1
done
check "a session listens on idempotency_abandoned" "1" "$(grep -c '^listening$' "$listen_out" || true)"

# The documented schedule.
job=$(q -c "SELECT cron.schedule('idempotency-sweep', '* * * * *', 'SELECT idempotency.idem_sweep()')")
check "the job is registered" "* * * * *|SELECT idempotency.idem_sweep()|t" \
	"$(q -c "SELECT schedule, command, active FROM cron.job WHERE jobid = $job")"

# Wait for its first run (a condition: a row in cron.job_run_details).
deadline=$((SECONDS + timeout))
status=
while ((SECONDS < deadline)); do
	status=$(q -c "SELECT status FROM cron.job_run_details WHERE jobid = $job
	                AND status IN ('succeeded', 'failed') ORDER BY runid LIMIT 1")
	[[ -n $status ]] && break
	sleep 1
done
check "the job ran within ${timeout}s" "succeeded" "$status"
[[ $status == failed ]] && q -c "SELECT return_message FROM cron.job_run_details WHERE jobid = $job" | sed 's/^/# /'

check "the expired key is gone" "0" "$(q -c "SELECT count(*) FROM idempotency.keys WHERE scope = 'cron' AND key = 'done'")"
check "the remembered key is compacted" "succeeded|201|t|t" \
	"$(q -c "SELECT status, response_code, response_body IS NULL, sweep_at = expires_at + remember FROM idempotency.keys WHERE scope = 'cron' AND key = 'rem'")"
check "it answers expired" "expired|succeeded|201" \
	"$(q -c "SELECT outcome, status, response_code FROM idempotency.idem_claim('rem', '{\"r\": 1}', scope => 'cron')")"
check "the stale key is reset" "pending|t|1" \
	"$(q -c "SELECT status, token IS NULL, attempt FROM idempotency.keys WHERE scope = 'cron' AND key = 'stale'")"
check "its next claim is attempt 2" "claimed|2" \
	"$(q -c "SELECT outcome, attempt FROM idempotency.idem_claim('stale', scope => 'cron')")"
check "the key deleted in another scope is gone" "0" \
	"$(q -c "SELECT count(*) FROM idempotency.keys WHERE scope = 'cron-deleted'")"

# The run committed before cron.job_run_details said so: its notification
# is queued for the listener, which prints it at its next command.
notified='Asynchronous notification "idempotency_abandoned" with payload "cron" received'
deadline=$((SECONDS + 30))
until grep -qF "$notified" "$listen_out" || ((SECONDS >= deadline)); do
	echo "SELECT 1;" >&"${LISTENER[1]}"
	sleep 0.2
done
echo "SELECT 'done';" >&"${LISTENER[1]}"
deadline=$((SECONDS + 30))
until grep -q '^done$' "$listen_out" || ((SECONDS >= deadline)); do
	sleep 0.1
done
check "the listener was notified once with the scope of the reset key" "1" \
	"$(grep -cF "$notified" "$listen_out" || true)"
check "and not for the scope of the deleted key" "0" \
	"$(grep -c 'idempotency_abandoned" with payload "cron-deleted"' "$listen_out" || true)"
exec {LISTENER[1]}>&-
wait "$LISTENER_PID" 2>/dev/null || true

q -c "SELECT cron.unschedule($job)" >/dev/null
if ((fails)); then
	echo "cron: $fails check(s) failed"
	exit 1
fi
echo "cron: all checks passed"
