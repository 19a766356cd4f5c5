#!/usr/bin/env bash
# test/pipeline/build_postgres.sh: where scripts/build-postgres.sh takes
# PostgreSQL from, checked without building anything (IDEM_PG_SOURCE_ONLY
# and fake cached builds).  Prints TAP; exits non-zero on a failure.
#
# What it shows: an installed server package wins; the vendored tarball is
# used when present, whatever the archive serves or its index says; a
# tarball that does not match the pinned checksum is refused; without a
# vendored copy the archive's pool is asked for the pinned file name (a
# local HTTP server stands in for the archive); a source that cannot be had
# fails with one line that says why; a cached build is reused only for the
# pinned version.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
script=$root/scripts/build-postgres.sh
vendor=${IDEM_PG_VENDOR:-$(cd "$root/.." && pwd)/shared/vendor}
tmp=$(mktemp -d)
server_pid=""
trap '[[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null; rm -rf "$tmp"' EXIT

# shellcheck source=test/pipeline/tap.bash
source "$root/test/pipeline/tap.bash"
# Run the script with a scratch cache and an archive that answers nothing;
# set OUT, ERR and RC.
run_script() {
	local rc=0
	OUT=$(env IDEM_PG_CACHE="$tmp/cache" IDEM_PG_ARCHIVE="${ARCHIVE:-http://127.0.0.1:9}" \
		"$@" 2>"$tmp/err") || rc=$?
	ERR=$(cat "$tmp/err")
	RC=$rc
}

read -r _ version file sha < <(awk '$1 == 17 { print; exit }' "$root/scripts/postgres-sources")
echo "# pinned: PostgreSQL $version, $file, sha256 $sha"

# 1. The vendored tarball, verified, whatever the archive or its index says.
if [[ -f $vendor/$file ]]; then
	run_script IDEM_PG_SOURCE_ONLY=1 IDEM_PG_SUITES="no-such-suite" "$script" 17
	[[ $RC == 0 && $OUT == "$vendor/$file" ]]
	ok $? "the vendored $file is used (archive unreachable, index ignored)" "$OUT $ERR"
	[[ $ERR == *"PostgreSQL $version $file sha256:$sha"*vendored* ]]
	ok $? "it says which version, file and checksum it took, and from where" "$ERR"
else
	ok 1 "no vendored $file in $vendor: the run cannot build PostgreSQL 17 without the archive"
fi

# 2. A vendored file that does not match the pinned checksum is refused.
mkdir -p "$tmp/badvendor"
echo "not a tarball" >"$tmp/badvendor/$file"
run_script IDEM_PG_SOURCE_ONLY=1 IDEM_PG_VENDOR="$tmp/badvendor" "$script" 17
ok $((RC != 1)) "a tampered vendored tarball fails the script (exit $RC)" "$ERR"
[[ $(wc -l <<<"$ERR") == 1 && $ERR == "build-postgres: "*"does not match the SHA-256 pinned"*refused ]]
ok $? "with one line saying it was refused" "$ERR"

# 3. No vendored copy and no archive: one line, exit 1.
run_script IDEM_PG_SOURCE_ONLY=1 IDEM_PG_VENDOR="$tmp/none" "$script" 17
ok $((RC != 1)) "no vendored copy and no archive: exit 1 (got $RC)" "$ERR"
[[ $(grep -c '^build-postgres: ' <<<"$ERR") == 1 && $ERR == *"the archive did not serve it"* ]]
ok $? "with one line saying why" "$ERR"

# 4. A major without a pin is a failure, never a guess.
run_script IDEM_PG_SOURCE_ONLY=1 "$script" 99
ok $((RC != 1)) "an unpinned major fails (exit $RC)" "$ERR"
[[ $ERR == "build-postgres: PostgreSQL 99 is not pinned"* ]]
ok $? "saying it is not pinned" "$ERR"

# 5. The archive's pool, by the pinned file name, when nothing is vendored.
if [[ -f $vendor/$file ]]; then
	mkdir -p "$tmp/archive/pool/main/p/postgresql-17"
	ln -s "$vendor/$file" "$tmp/archive/pool/main/p/postgresql-17/$file"
	(cd "$tmp/archive" && exec /usr/bin/python3 -m http.server --bind 127.0.0.1 0 >"$tmp/http.log" 2>&1) &
	server_pid=$!
	port=""
	for _ in $(seq 1 200); do
		port=$(sed -n 's/.*port \([0-9]*\).*/\1/p' "$tmp/http.log" | head -n1)
		[[ -n $port ]] && curl -fsS -o /dev/null "http://127.0.0.1:$port/" 2>/dev/null && break
		port=""
		sleep 0.05
	done
	if [[ -n $port ]]; then
		ARCHIVE="http://127.0.0.1:$port" run_script IDEM_PG_SOURCE_ONLY=1 IDEM_PG_VENDOR="$tmp/none" "$script" 17
		ok $((RC != 0)) "without a vendored copy the archive's pool serves the pinned file (exit $RC)" "$ERR"
		[[ $ERR == *"archive pool"* && $OUT == "$tmp/cache/src/"* ]]
		ok $? "and it says so" "$ERR"
		# The same archive serving other bytes under that name is refused.
		rm "$tmp/archive/pool/main/p/postgresql-17/$file"
		echo "other bytes" >"$tmp/archive/pool/main/p/postgresql-17/$file"
		ARCHIVE="http://127.0.0.1:$port" run_script IDEM_PG_SOURCE_ONLY=1 IDEM_PG_VENDOR="$tmp/none" "$script" 17
		ok $((RC != 1)) "a file from the archive with another checksum is refused (exit $RC)" "$ERR"
	else
		ok 1 "a local HTTP server for the archive did not start" "$(cat "$tmp/http.log")"
	fi
	kill "$server_pid" 2>/dev/null
	wait "$server_pid" 2>/dev/null
	server_pid=""
fi

# 6. A cached build is reused for the pinned version only.
mkdir -p "$tmp/cache/17/bin"
printf '#!/bin/sh\necho "PostgreSQL (fake) %s"\n' "$version" >"$tmp/cache/17/bin/pg_config"
chmod +x "$tmp/cache/17/bin/pg_config"
echo "$version $file sha256:$sha" >"$tmp/cache/17/.built"
run_script "$script" 17
[[ $RC == 0 && $OUT == "$tmp/cache/17" ]]
ok $? "a cached build of the pinned version is reused" "$OUT $ERR"
[[ $ERR == *"cached build"* ]]
ok $? "and named as cached" "$ERR"
echo "17.0 other.tar.bz2 sha256:00" >"$tmp/cache/17/.built"
run_script IDEM_PG_SOURCE_ONLY=1 "$script" 17
[[ $ERR != *"cached build"* ]]
ok $? "a cached build of another version is not" "$ERR"

# 7. An installed server package comes first.
if [[ -x /usr/lib/postgresql/15/bin/pg_config && -x /usr/lib/postgresql/15/bin/pg_ctl ]]; then
	run_script "$script" 15
	[[ $RC == 0 && $OUT == /usr/lib/postgresql/15 ]]
	ok $? "the installed PostgreSQL 15 package is used as it is" "$OUT $ERR"
fi

echo "1..$n"
((failed == 0))
