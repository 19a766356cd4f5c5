#!/usr/bin/env bash
# test/pipeline/system_files.sh: ./run test leaves the extension's files in
# PostgreSQL's own directories as it found them (scripts/packages.sh:
# package_system_save and package_system_restore), checked against a fake
# pg_config whose directories live in a scratch folder.  Prints TAP; exits
# non-zero on a failure.
#
# What it shows: files a user installed (a kept demo, their make install)
# come back byte for byte after the run replaced and removed them; files the
# run added where there were none are removed; the library, its bitcode,
# the control file and every script count, and nothing else is touched.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# shellcheck source=scripts/cluster.sh
source "$root/scripts/cluster.sh"
# shellcheck source=scripts/setup.sh
source "$root/scripts/setup.sh"
# shellcheck source=scripts/suites.sh
source "$root/scripts/suites.sh"
# shellcheck source=scripts/packages.sh
source "$root/scripts/packages.sh"

# shellcheck source=test/pipeline/tap.bash
source "$root/test/pipeline/tap.bash"

# A PostgreSQL "99" whose pg_config points into $tmp/<name>.
fake_pg() {
	local name=$1 base=$tmp/$1/99
	mkdir -p "$base/bin" "$base/lib/bitcode" "$base/share/extension"
	cat >"$base/bin/pg_config" <<EOF
#!/bin/sh
case \$1 in
--pkglibdir) echo $base/lib ;;
--sharedir) echo $base/share ;;
esac
EOF
	chmod 755 "$base/bin/pg_config"
	echo "$base"
}

# A user's install: library, bitcode, control, scripts, and a neighbour's files.
base=$(fake_pg user)
echo "user library" >"$base/lib/idempotency.so"
mkdir -p "$base/lib/bitcode/idempotency/src"
echo "bc" >"$base/lib/bitcode/idempotency/src/claim.bc"
echo "index" >"$base/lib/bitcode/idempotency.index.bc"
echo "default_version = '1.5'" >"$base/share/extension/idempotency.control"
echo "-- 1.0" >"$base/share/extension/idempotency--1.0.sql"
echo "-- 1.4 to 1.5" >"$base/share/extension/idempotency--1.4--1.5.sql"
echo "other" >"$base/lib/other.so"
echo "other" >"$base/share/extension/other.control"
before=$(cd "$tmp/user" && find . -type f -exec sha256sum {} + | sort)

package_system_save "$tmp/saved" "$base/bin/pg_config"
ok $? "package_system_save copies the user's files"
ok "$(($(wc -l <"$tmp/saved/99.files") == 6 ? 0 : 1))" "six of the extension's files are saved" \
	"$(cat "$tmp/saved/99.files")"

# What a test run does: make install of another version over them, then
# the package test removes everything.
echo "test library" >"$base/lib/idempotency.so"
echo "default_version = '1.6'" >"$base/share/extension/idempotency.control"
echo "-- 1.6" >"$base/share/extension/idempotency--1.6.sql"
package_remove_installed "$base/bin/pg_config" >/dev/null
out=$(package_system_restore "$tmp/saved")
ok $? "package_system_restore succeeds" "$out"
after=$(cd "$tmp/user" && find . -type f -exec sha256sum {} + | sort)
[[ $before == "$after" ]]
ok $? "every file is back as it was, and no other" "$(diff <(echo "$before") <(echo "$after"))"
grep -q "put back the extension's 6 files" <<<"$out"
ok $? "the restore says what it put back" "$out"
[[ ! -e $tmp/saved ]]
ok $? "the saved copy is removed"

# Nothing installed before: what the run installed is removed, the rest stays.
base=$(fake_pg empty)
echo "other" >"$base/lib/other.so"
package_system_save "$tmp/saved" "$base/bin/pg_config"
echo "test library" >"$base/lib/idempotency.so"
echo "default_version = '1.6'" >"$base/share/extension/idempotency.control"
echo "-- 1.6" >"$base/share/extension/idempotency--1.6.sql"
out=$(package_system_restore "$tmp/saved")
left=$(cd "$tmp/empty" && find . -type f | sort)
[[ $left == "./99/bin/pg_config"$'\n'"./99/lib/other.so" ]]
ok $? "files the run installed over nothing are removed, others stay" "$left"
grep -q "none were installed before the test" <<<"$out"
ok $? "the restore says so" "$out"

echo "1..$n"
((failed == 0))
