#!/usr/bin/env bash
# scripts/sql-edition-dump-test.sh C_PG_CONFIG SQL_PG_CONFIG: a dump of
# one edition restores into the other, and the keys work there as they did.
#
#   C_PG_CONFIG    a PostgreSQL with the C edition installed
#   SQL_PG_CONFIG  a PostgreSQL without it (pg_tle is built into it by
#                  scripts/build-pgtle.sh when needed)
#
# Starts one throwaway cluster of each (ports IDEM_SQLED_PORT and the next,
# default 55543 and 55544), fills a C edition database with a finished key,
# a pending key with a checkpoint and its request kept, a scope binding and
# a token sequence position, and checks, printing one "ok"/"not ok" line per check:
#   1. C -> SQL edition under pg_tle: the whole dump (its CREATE EXTENSION
#      creates the SQL edition);
#   2. C -> SQL edition, plain installer: a data-only dump of the schema;
#   3. SQL edition (pg_tle) -> C: a data-only dump of the schema;
#   4. SQL edition (plain) -> C: a data-only dump of the schema.
# In each target the stored rows are byte for byte those of the source, the
# finished key replays, a different request is a mismatch (the
# fingerprints are the same), the pending key's request is kept, its old
# token still finishes it, and a new claim's token is above every restored one.
#
# Exit status: 0 all passed; 1 a check failed; 2 usage or setup failure.
set -euo pipefail

c_config=${1:-}
s_config=${2:-}
[[ -x $c_config && -x $s_config ]] || { echo "usage: scripts/sql-edition-dump-test.sh C_PG_CONFIG SQL_PG_CONFIG" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
port=${IDEM_SQLED_PORT:-55543}
c_bin=$("$c_config" --bindir)
s_bin=$("$s_config" --bindir)
[[ -e $("$c_config" --sharedir)/extension/idempotency.control ]] ||
	{ echo "sql-edition-dump-test: the C edition is not installed in $c_bin/.." >&2; exit 2; }
[[ ! -e $("$s_config" --sharedir)/extension/idempotency.control ]] ||
	{ echo "sql-edition-dump-test: the C edition is installed in $s_bin/..; use a PostgreSQL without it" >&2; exit 2; }
"$root/scripts/build-pgtle.sh" "$s_config" >/dev/null || exit 2

work=$(mktemp -d "${TMPDIR:-/tmp}/sql-edition-dump.XXXXXX")
chmod 755 "$work"
# shellcheck source=scripts/cluster.sh
source "$root/scripts/cluster.sh"
cleanup() {
	PG_BIN=$c_bin cluster_stop "$work/c" >/dev/null 2>&1 || true
	PG_BIN=$s_bin cluster_stop "$work/s" >/dev/null 2>&1 || true
	rm -rf "$work"
}
trap cleanup EXIT
"$root/scripts/sql-edition.sh" "$work/dist" >/dev/null
mkdir -p "$work/c" "$work/s" "$work/dumps"
chown -R "${PG_OS_USER:-postgres}": "$work"
PG_BIN=$c_bin cluster_start "$work/c" "$port" "shared_preload_libraries = 'idempotency'" \
	"idempotency.sweep_interval = 0" >/dev/null
PG_BIN=$s_bin cluster_start "$work/s" $((port + 1)) "shared_preload_libraries = 'pg_tle'" >/dev/null

c_psql() { PG_BIN=$c_bin cluster_psql "$work/c" -q -v ON_ERROR_STOP=1 "$@"; }
s_psql() { PG_BIN=$s_bin cluster_psql "$work/s" -q -v ON_ERROR_STOP=1 "$@"; }
dump() {	# dump BIN DIR DB FILE [pg_dump args]
	local bin=$1 dir=$2 db=$3 file=$4
	shift 4
	as_postgres "$bin/pg_dump" -h "$(cluster_host "$dir")" -p "$(cluster_port "$dir")" \
		-U postgres -d "$db" -f "$file" "$@"
}
failed=0
n=0
check() {	# check NAME PSQL-FUNCTION DB: the keys work in DB as in the source
	local name=$1 run=$2 db=$3 out
	out=$("$run" -d "$db" -At -c "
		SELECT md5(string_agg(k::text, '|' ORDER BY k.scope, k.key)) FROM idempotency.keys k;" -c "
		SELECT outcome || '/' || status || '/' || response_code
		  FROM idempotency.idem_claim('done', '{\"n\": 1}', 'dump');" -c "
		SELECT outcome FROM idempotency.idem_claim('done', '{\"n\": 2}', 'dump');" -c "
		SELECT request FROM idempotency.keys WHERE scope = 'dump' AND key = 'open';" -c "
		SELECT idempotency.idem_finish('open', (SELECT token FROM idempotency.keys
			WHERE scope = 'dump' AND key = 'open'), 200, NULL, 'dump') IS NOT NULL;" -c "
		SELECT token > (SELECT max(token) FROM idempotency.keys WHERE scope = 'dump')
		  FROM idempotency.idem_claim('new', NULL, 'dump');" -c "
		SELECT count(*) FROM idempotency.scope_bindings;" 2>&1) || true
	n=$((n + 1))
	if [[ $out == "$expected" ]]; then
		echo "ok $n - $name"
	else
		echo "not ok $n - $name"
		diff <(echo "$expected") <(echo "$out") | sed 's/^/# /'
		failed=1
	fi
}

# The source: a C edition database.
c_psql -c "CREATE ROLE regress_dump_tenant" -c "CREATE DATABASE src"
c_psql -d src -c "CREATE EXTENSION idempotency" -c "
	SELECT idempotency.bind_scope('regress_dump_tenant', 'tenant:');
	SELECT setval('idempotency.token_seq', 1000);
	SELECT idempotency.idem_finish('done', c.token, 201, '{\"ok\": true}', 'dump')
	  FROM idempotency.idem_claim('done', '{\"n\": 1}', 'dump') c;
	SELECT idempotency.idem_checkpoint('open', c.token, 'charged', '{\"id\": 7}', 'dump')
	  FROM idempotency.idem_claim('open', '{\"n\": 3}', 'dump', lease => '1 hour',
								  keep_request => true) c;" >/dev/null
sum=$(c_psql -d src -At -c "SELECT md5(string_agg(k::text, '|' ORDER BY k.scope, k.key)) FROM idempotency.keys k")
expected="$sum
replay/succeeded/201
mismatch
{\"n\": 3}
t
t
1"
dump "$c_bin" "$work/c" src "$work/dumps/full.sql"
dump "$c_bin" "$work/c" src "$work/dumps/data.sql" --data-only --schema=idempotency

# 1. C -> SQL edition under pg_tle: the whole dump.
s_psql -c "CREATE ROLE regress_dump_tenant" -c "CREATE DATABASE tle"
s_psql -d tle -c "CREATE EXTENSION pg_tle" -f "$work/dist/idempotency-pgtle.sql" >/dev/null
s_psql -d tle -f "$work/dumps/full.sql" >/dev/null 2>"$work/restore1.log" || { cat "$work/restore1.log" >&2; exit 2; }
check "C edition -> SQL edition (pg_tle), whole dump" s_psql tle

# 2. C -> SQL edition, plain installer: the data.
s_psql -c "CREATE DATABASE plain"
s_psql -d plain -f "$work/dist/idempotency-plain.sql" >/dev/null
s_psql -d plain -f "$work/dumps/data.sql" >/dev/null 2>"$work/restore2.log" || { cat "$work/restore2.log" >&2; exit 2; }
check "C edition -> SQL edition (plain), data-only dump" s_psql plain

# SQL edition database $1 -> a new C edition database $2: the data only.
to_c() {
	local from=$1 to=$2
	# (the SQL edition's key lanes are no data: every install makes them)
	dump "$s_bin" "$work/s" "$from" "$work/dumps/$to.sql" --data-only --schema=idempotency \
		--exclude-table-data=idempotency.key_lanes
	c_psql -c "CREATE DATABASE $to"
	c_psql -d "$to" -c "CREATE EXTENSION idempotency"
	c_psql -d "$to" -f "$work/dumps/$to.sql" >/dev/null 2>"$work/restore-$to.log" ||
		{ cat "$work/restore-$to.log" >&2; exit 2; }
}

# 3. SQL edition (pg_tle) -> C: the data of a fresh copy of the source.
s_psql -c "CREATE DATABASE tle2"
s_psql -d tle2 -c "CREATE EXTENSION pg_tle" -f "$work/dist/idempotency-pgtle.sql" >/dev/null
s_psql -d tle2 -f "$work/dumps/full.sql" >/dev/null 2>&1
to_c tle2 back
check "SQL edition (pg_tle) -> C edition, data-only dump" c_psql back

# 4. SQL edition (plain) -> C: the data of a fresh plain copy of the source.
s_psql -c "CREATE DATABASE plain2"
s_psql -d plain2 -f "$work/dist/idempotency-plain.sql" >/dev/null
s_psql -d plain2 -f "$work/dumps/data.sql" >/dev/null 2>&1
to_c plain2 back2
check "SQL edition (plain) -> C edition, data-only dump" c_psql back2

echo "1..$n"
exit $failed
