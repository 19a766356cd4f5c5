#!/usr/bin/env bash
# scripts/indent.sh [--check]: the C sources in PostgreSQL's layout.
#
#   scripts/indent.sh           re-indent src/*.c and src/*.h in place
#   scripts/indent.sh --check   change nothing; print the diff pgindent would
#                               make and every comment line over 80 columns,
#                               and exit 1 if there is any
#
# pgindent and its formatter pg_bsd_indent come from the PostgreSQL 17
# source build that scripts/build-postgres.sh keeps in
# ${IDEM_PG_CACHE:-/var/cache/idempotency-pg}/17 (built from the pinned
# tarball if it is not there yet, about 8 minutes; IDEM_INDENT_PREFIX names
# another such installation).  The typedefs are
# PostgreSQL's list and the extension's own, src/typedefs.list: a new
# typedef goes there, or pgindent spaces its uses as a multiplication.
# Comments are kept within 80 columns (a tab counts 4), as PostgreSQL's
# are; message strings may run longer, so that each stays whole and
# searchable.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
check=0
case ${1:-} in
--check) check=1 ;;
"") ;;
*) echo "usage: scripts/indent.sh [--check]" >&2; exit 2 ;;
esac

prefix=${IDEM_INDENT_PREFIX:-${IDEM_PG_CACHE:-/var/cache/idempotency-pg}/17}
if [[ ! -x $prefix/bin/pg_bsd_indent ]]; then
	"$root/scripts/build-postgres.sh" 17 >/dev/null
fi
indent=$prefix/bin/pg_bsd_indent
pgindent=$prefix/share/pgindent/pgindent
for f in "$indent" "$pgindent" "$prefix/share/pgindent/typedefs.list"; do
	[[ -e $f ]] || {
		echo "indent: $f is missing: pgindent needs the PostgreSQL 17 source build of scripts/build-postgres.sh" >&2
		exit 1
	}
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat "$prefix/share/pgindent/typedefs.list" "$root/src/typedefs.list" >"$work/typedefs.list"

cd "$root"
files=(src/*.c src/*.h)
rc=0
if ((check)); then
	# pgindent --check exits 2 when it would change a file; --diff shows how.
	if ! perl "$pgindent" --typedefs="$work/typedefs.list" --indent="$indent" \
		--check --diff "${files[@]}"; then
		echo "indent: the files above are not indented; run ./run indent" >&2
		rc=1
	fi
	# A comment line: one that starts (after indentation) with "/*", "* ",
	# a lone "*" or "*/" (not a dereference like "*count = ...").
	long=$(for f in "${files[@]}"; do
		expand -t 4 "$f" | awk -v f="$f" \
			'length($0) > 80 && $0 ~ /^[ ]*(\/\*|\*( |\/|$))/ { print f ":" NR ": " length($0) " columns" }'
	done)
	if [[ -n $long ]]; then
		echo "$long"
		echo "indent: comment lines over 80 columns (a tab counts 4)" >&2
		rc=1
	fi
	((rc)) || echo "indent: src/ is indented (${#files[@]} files)"
else
	perl "$pgindent" --typedefs="$work/typedefs.list" --indent="$indent" "${files[@]}"
	echo "indent: re-indented ${#files[@]} files"
fi
exit $rc
