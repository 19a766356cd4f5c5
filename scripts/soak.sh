#!/usr/bin/env bash
# scripts/soak.sh: ./run soak, a long mixed load with a verdict.
#   scripts/soak.sh [--minutes N] [--clients N] [--rate OPS] [--keep]
#                   [--no-build] [--out DIR]
#
# As root: installs what is missing (apt: the build's packages, gnuplot-nox,
# python3-psycopg), builds the extension from a copy of this tree and installs
# it into the PostgreSQL of PG_CONFIG, starts a throwaway cluster as the
# postgres user on a private port and socket directory, and runs bench/soak.py
# against it with Debian's Python (the settings come from `soak.py --conf`:
# the library preloaded, a short retention so that keys expire all the time,
# the worker sweeping every few seconds).  --minutes: how long the load runs
# (60); --clients: its connections (8); --rate: the operations per second
# they offer together (600; 0: as many as they can).  Its samples, plot and
# the server's log go to bench/out/soak/.  Exit status: bench/soak.py's (0
# only when every check passed).  The cluster is stopped (by its data
# directory) and the scratch directory removed at exit; --keep keeps that
# directory (the cluster stopped).  --no-build runs against the extension
# already installed in PG_CONFIG's PostgreSQL (./run test's short soak);
# --out puts the samples, plot and log in DIR instead.
#
# Settings (environment): PG_CONFIG (default Debian's 15), IDEM_SOAK_PORT
# (default 55470), IDEM_SOAK_MAKE_FLAGS (extra make variables of the build,
# e.g. IDEM_TEST_PAUSES=1 to install the same library as ./run test does).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
readonly ROOT
PY=/usr/bin/python3
: "${IDEM_SOAK_PORT:=55470}"

# shellcheck source=scripts/cluster.sh
source "$ROOT/scripts/cluster.sh"
# shellcheck source=scripts/setup.sh
source "$ROOT/scripts/setup.sh"

MINUTES=60 CLIENTS=8 RATE=600 KEEP=0 BUILD=1 WORK=""
out="$ROOT/bench/out/soak"

usage() {
	echo "usage: ./run soak [--minutes N] [--clients N] [--rate OPS] [--keep] [--no-build] [--out DIR]" >&2
	exit 2
}

while (($#)); do
	case $1 in
	--minutes | --clients | --rate)
		[[ ${2:-} =~ ^[0-9]+(\.[0-9]+)?$ ]] || usage
		case $1 in
		--minutes) MINUTES=$2 ;;
		--clients) CLIENTS=$2 ;;
		--rate) RATE=$2 ;;
		esac
		shift 2
		;;
	*)
		setup_run_option "$@" || usage
		shift "$SETUP_SHIFT"
		;;
	esac
done

setup_require_root
setup_packages gnuplot-nox python3-psycopg
read -ra SETUP_MAKE_FLAGS <<<"${IDEM_SOAK_MAKE_FLAGS:-}"
setup_scratch soak "$ROOT"

mkdir -p "$out"
dir="$WORK/cluster"
mapfile -t conf < <("$PY" "$ROOT/bench/soak.py" --conf --minutes "$MINUTES")
echo "== starting a throwaway cluster in $dir (port $IDEM_SOAK_PORT, $("$PG_CONFIG" --version))"
cluster_start "$dir" "$IDEM_SOAK_PORT" "${conf[@]}"
cluster_env "$dir"
rc=0
"$PY" "$ROOT/bench/soak.py" --minutes "$MINUTES" --clients "$CLIENTS" --rate "$RATE" --out "$out" \
	--server-log "$dir/server.log" || rc=$?
cp "$dir/server.log" "$out/server.log"
exit "$rc"
