# shellcheck shell=bash
# scripts/cluster.sh: throwaway PostgreSQL clusters for demos, tests, benchmarks
# and examples. Source it from bash; it defines functions only and changes no
# shell options.
#
# A cluster lives in one base directory <dir> (make it with `mktemp -d`):
#   <dir>/data        the data directory (initdb, owned by the postgres user)
#   <dir>/socket      the unix socket directory (the only way in: no TCP)
#   <dir>/server.log  the server log
#   <dir>/port        the port the cluster was started on
# PostgreSQL refuses to run as root, so when we are root every server
# command runs as the `postgres` OS user; when we already are that user, it
# runs directly. A cluster is stopped by its data directory, never by process
# name, so other clusters on the machine are never touched.
#
# Functions:
#   as_postgres <cmd> [args...]         run a command as the postgres OS user
#   cluster_init <dir>                  initdb into <dir>/data (trust auth,
#                                       UTF8, C locale, superuser postgres)
#   cluster_start <dir> <port> [conf-line...]
#                                       init if needed, append the lines to
#                                       postgresql.conf (e.g.
#                                       "shared_preload_libraries = 'idempotency'"),
#                                       start and wait until it accepts
#                                       connections; on failure print the log
#   cluster_stop <dir>                  stop it (fast) if it is running
#   cluster_stop_all                    stop every cluster this shell started
#                                       (meant for `trap ... EXIT`)
#   cluster_port <dir>                  print the cluster's port
#   cluster_host <dir>                  print the cluster's socket directory
#   cluster_psql <dir> [psql args...]   psql -X as postgres to that cluster
#                                       (database postgres unless -d is given)
#   cluster_createdb <dir> <db> [ext...]
#                                       create a database and the extensions
#                                       in it (pass `idempotency` for ours)
#   cluster_env <dir> [db]              export PGHOST PGPORT PGUSER PGDATABASE
#                                       for that cluster
#   pgbouncer_start <dir> <port> <pool-size>
#                                       a PgBouncer in transaction pooling mode
#                                       in front of the cluster in <dir>, on
#                                       <port> in the cluster's socket directory,
#                                       with at most <pool-size> server
#                                       connections per database and user
#   pgbouncer_stop <dir>                stop it (by its pid file)
#
# Settings (environment): PG_BIN (default /usr/lib/postgresql/15/bin),
# PG_OS_USER (default postgres), PGCTLTIMEOUT (seconds pg_ctl waits for a
# start or a stop, default 60; a server under valgrind needs more).

: "${PG_BIN:=/usr/lib/postgresql/15/bin}"
: "${PG_OS_USER:=postgres}"

# Base directories of the clusters this shell started (for cluster_stop_all).
CLUSTER_STARTED=()

# Run a command as the postgres OS user (directly if we already are that user).
as_postgres() {
	if [[ $(id -un) == "$PG_OS_USER" ]]; then
		"$@"
	elif [[ $(id -u) -eq 0 ]]; then
		runuser -u "$PG_OS_USER" -- "$@"
	else
		echo "cluster.sh: run as root or as $PG_OS_USER to start PostgreSQL" >&2
		return 1
	fi
}

# Create the data and socket directories and initdb the cluster in <dir>.
cluster_init() {
	local dir=$1
	mkdir -p "$dir/socket"
	if [[ $(id -u) -eq 0 ]]; then
		chown -R "$PG_OS_USER": "$dir"
	fi
	chmod 700 "$dir"
	(cd / && as_postgres "$PG_BIN/initdb" -D "$dir/data" -U postgres \
		--auth=trust -E UTF8 --locale=C --no-sync >"$dir/initdb.log" 2>&1) || {
		cat "$dir/initdb.log" >&2
		echo "cluster.sh: initdb failed in $dir/data" >&2
		return 1
	}
}

# Start the cluster in <dir> on <port> (unix socket only), with extra conf lines.
cluster_start() {
	local dir=$1 port=$2 line
	shift 2
	[[ -f $dir/data/PG_VERSION ]] || cluster_init "$dir" || return 1
	{
		echo "# added by scripts/cluster.sh"
		echo "port = $port"
		echo "listen_addresses = ''"
		echo "unix_socket_directories = '$dir/socket'"
		echo "fsync = off"
		for line in "$@"; do
			echo "$line"
		done
	} | as_postgres tee -a "$dir/data/postgresql.conf" >/dev/null
	echo "$port" >"$dir/port"
	CLUSTER_STARTED+=("$dir")
	if ! (cd / && as_postgres "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/server.log" \
		-w -t "${PGCTLTIMEOUT:-60}" -s start); then
		echo "cluster.sh: could not start the cluster in $dir; its log:" >&2
		cat "$dir/server.log" >&2 || true
		return 1
	fi
}

# Stop the cluster in <dir> (fast shutdown) if its postmaster is running.
cluster_stop() {
	local dir=$1
	[[ -f $dir/data/postmaster.pid ]] || return 0
	(cd / && as_postgres "$PG_BIN/pg_ctl" -D "$dir/data" -m fast -w -t "${PGCTLTIMEOUT:-60}" -s stop) ||
		(cd / && as_postgres "$PG_BIN/pg_ctl" -D "$dir/data" -m immediate -w -s stop) ||
		true
}

# Stop every cluster (and PgBouncer) started by this shell (safe to call
# more than once).
cluster_stop_all() {
	local dir
	for dir in "${CLUSTER_STARTED[@]}"; do
		pgbouncer_stop "$dir"
		cluster_stop "$dir"
	done
}

# Print the port the cluster in <dir> was started on.
cluster_port() {
	cat "$1/port"
}

# Print the unix socket directory of the cluster in <dir>.
cluster_host() {
	echo "$1/socket"
}

# Run psql (no psqlrc, stop on error) as superuser postgres against <dir>.
cluster_psql() {
	local dir=$1
	shift
	"$PG_BIN/psql" -X -v ON_ERROR_STOP=1 -h "$dir/socket" -p "$(cluster_port "$dir")" \
		-U postgres -d postgres "$@"
}

# Create database <db> in the cluster in <dir>, with the given extensions.
cluster_createdb() {
	local dir=$1 db=$2 ext
	shift 2
	cluster_psql "$dir" -q -c "CREATE DATABASE \"$db\"" || return 1
	for ext in "$@"; do
		cluster_psql "$dir" -q -d "$db" -c "CREATE EXTENSION \"$ext\"" || return 1
	done
}

# Export the libpq environment (PGHOST PGPORT PGUSER PGDATABASE) for <dir>.
cluster_env() {
	local dir=$1 db=${2:-postgres}
	export PGHOST="$dir/socket"
	PGPORT="$(cluster_port "$dir")"
	export PGPORT
	export PGUSER=postgres
	export PGDATABASE="$db"
}

# Start PgBouncer in front of the cluster in <dir>: transaction pooling, so
# consecutive transactions of one client may land on different server
# connections, with at most <pool-size> of them, which is what clients meet
# behind a pooler.  It listens on <port> in the cluster's socket directory
# (no TCP), trusts every user as the cluster does, and keeps its files in
# <dir>/pgbouncer.
pgbouncer_start() {
	local dir=$1 port=$2 pool=$3 conf="$1/pgbouncer" i
	mkdir -p "$conf"
	cat >"$conf/pgbouncer.ini" <<EOF
[databases]
* = host=$dir/socket port=$(cluster_port "$dir")

[pgbouncer]
listen_addr =
listen_port = $port
unix_socket_dir = $dir/socket
auth_type = trust
auth_file = $conf/users.txt
pool_mode = transaction
default_pool_size = $pool
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 500
server_reset_query =
ignore_startup_parameters = extra_float_digits,options,search_path
pidfile = $conf/pgbouncer.pid
logfile = $conf/pgbouncer.log
EOF
	# trust still needs the user listed; the suites connect as postgres
	echo '"postgres" ""' >"$conf/users.txt"
	if [[ $(id -u) -eq 0 ]]; then
		chown -R "$PG_OS_USER": "$conf"
	fi
	# a socket file left by a PgBouncer that was killed would look ready
	pgbouncer_stop "$dir"
	rm -f "$dir/socket/.s.PGSQL.$port" "$dir/socket/.s.PGSQL.$port.lock" "$conf/pgbouncer.pid"
	if ! (cd / && as_postgres pgbouncer -d -q "$conf/pgbouncer.ini"); then
		echo "cluster.sh: PgBouncer did not start; its log:" >&2
		cat "$conf/pgbouncer.log" >&2 || true
		return 1
	fi
	# It accepts connections once its socket file exists.
	for ((i = 0; i < 100; i++)); do
		[[ -S $dir/socket/.s.PGSQL.$port && -s $conf/pgbouncer.pid ]] && return 0
		sleep 0.1
	done
	echo "cluster.sh: PgBouncer did not open $dir/socket/.s.PGSQL.$port" >&2
	return 1
}

# Stop the PgBouncer of the cluster in <dir>, if one runs (by its pid file,
# and only if that process is the PgBouncer of this directory: a stale pid
# file may name a process that reused the number).
pgbouncer_stop() {
	local pidfile="$1/pgbouncer/pgbouncer.pid" pid i
	[[ -f $pidfile ]] || return 0
	pid=$(cat "$pidfile")
	[[ $pid =~ ^[0-9]+$ ]] || return 0
	tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF "$1/pgbouncer/pgbouncer.ini" ||
		return 0
	kill "$pid" 2>/dev/null || return 0
	for ((i = 0; i < 100; i++)); do
		kill -0 "$pid" 2>/dev/null || return 0
		sleep 0.1
	done
	kill -9 "$pid" 2>/dev/null || true
}
