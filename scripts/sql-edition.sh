#!/usr/bin/env bash
# scripts/sql-edition.sh [OUTDIR]: build the SQL edition's two installers
# from sql-edition/ into OUTDIR (default dist/sql-edition):
#
#   idempotency-pgtle.sql  registers "idempotency" with pg_tle: every
#                          version in sql-edition/versions, the update path
#                          between each two neighbours, and the newest as
#                          the default; then CREATE EXTENSION idempotency
#                          (or ALTER EXTENSION idempotency UPDATE) works.
#                          Re-running it registers only the versions and
#                          update paths that are not registered yet (a
#                          released version's script never changes).
#   idempotency-plain.sql  creates schema idempotency and everything in it
#                          directly, in one transaction; running it again
#                          upgrades in place and keeps every key.
#
# Both carry the same text: the newest version's script is the parts in
# sql-edition/src/ (NN_part.sql), joined in the order of their names, each
# without the header comment that opens it (what the part owns is for its
# readers; the generated script keeps its section banners).  The SQL
# edition's code is its SQL, so each release registers a new version,
# named by the release's library version (1.6.4), rather than changing a
# registered one; only the first, 1.6, is the control file's
# default_version.  `make sql-edition` runs this script.
#
# scripts/sql-edition.sh --freeze VERSION: write the newest version's
# script, VERSION in idem_version(), to sql-edition/idempotency--VERSION.sql,
# as a release must before the next version begins (VERSION must be the
# newest in sql-edition/versions, and the parts as that release left them).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
freeze=
if [[ ${1-} == --freeze ]]; then
	[[ $# == 2 ]] || { echo "usage: scripts/sql-edition.sh --freeze VERSION" >&2; exit 2; }
	freeze=$2
else
	out=${1:-$root/dist/sql-edition}
fi
src=$root/sql-edition

default=$(sed -n "s/^default_version *= *'\(.*\)'.*/\1/p" "$root/idempotency.control")
[[ -n $default ]] || { echo "sql-edition: no default_version in idempotency.control" >&2; exit 1; }
mapfile -t versions < <(grep -v '^\s*\(#\|$\)' "$src/versions" | tr -d ' \t')
((${#versions[@]})) || { echo "sql-edition: no versions in $src/versions" >&2; exit 1; }
newest=${versions[-1]}

# The newest version's text with @IDEM_VERSION@ still in it: the parts,
# each without its header (the comment block that opens it, from a line
# "/*---..." to the lines " *---..." and " */", and the blank line after
# it), joined by one blank line.
parts_text() {
	local parts
	mapfile -t parts < <(printf '%s\n' "$src"/src/[0-9][0-9]_*.sql | LC_ALL=C sort)
	[[ -f ${parts[0]} ]] || { echo "sql-edition: no parts in sql-edition/src/" >&2; return 1; }
	awk '
		function bad() {
			print "sql-edition: the header of " part " does not end with \" *---...\" and \" */\"" > "/dev/stderr"
			failed = 1
			exit 1
		}
		FNR == 1 {
			if (head) bad()
			if (NR > 1) print ""
			part = FILENAME
			head = /^\/\*-+$/
			blank = 0
		}
		head {
			if ($0 == " */") {
				if (prev !~ /^ \*-+$/) bad()
				head = 0
				blank = 1
			}
			prev = $0
			next
		}
		blank { blank = 0; if ($0 == "") next }
		{ print }
		END { if (failed || head) { if (!failed) bad(); exit 1 } }' "${parts[@]}"
}

if [[ -n $freeze ]]; then
	[[ $freeze == "$newest" ]] || {
		echo "sql-edition: only the newest version ($newest) is built from the parts; $freeze is not it" >&2
		exit 1
	}
	frozen=$src/idempotency--$freeze.sql
	[[ ! -e $frozen ]] || { echo "sql-edition: $frozen exists; a frozen script never changes" >&2; exit 1; }
	parts_text | sed "s/@IDEM_VERSION@/$freeze/g" >"$frozen.tmp" || { rm -f "$frozen.tmp"; exit 1; }
	mv "$frozen.tmp" "$frozen"
	echo "wrote $frozen; add the next release's version to sql-edition/versions"
	exit 0
fi

comment=$(sed -n "s/^comment *= *'\(.*\)'.*/\1/p" "$root/idempotency.control")

# The library version of this release (src/idempotency.h): idem_version()
# of the newest script reports it, as the C edition's library does.
library=$(sed -n 's/^#define IDEM_VERSION[[:space:]]*"\(.*\)".*/\1/p' "$root/src/idempotency.h")
[[ $library == "$default".* ]] || {
	echo "sql-edition: IDEM_VERSION ($library) is not a release of $default" >&2
	exit 1
}
# The newest script reports $library in idem_version(): a release whose
# library version differs from the newest registered one's freezes that
# script (sql-edition/idempotency--VERSION.sql, written by --freeze) and
# adds its own version.
[[ $newest == "$library" || ($newest == "$default" && ${#versions[@]} == 1) ]] || {
	echo "sql-edition: the newest version in sql-edition/versions ($newest) is not this release ($library):" \
		"freeze its script (scripts/sql-edition.sh --freeze $newest, from the parts as $newest left them)" \
		"and add $library to sql-edition/versions" >&2
	exit 1
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# The newest version's text, built once.
parts_text | sed "s/@IDEM_VERSION@/$library/g" >"$tmp/newest.sql"

# The full script of a version.
script_of() {
	if [[ $1 == "$newest" ]]; then
		cat "$tmp/newest.sql"
	elif [[ -f $src/idempotency--$1.sql ]]; then
		cat "$src/idempotency--$1.sql"
	else
		echo "sql-edition: no script for version $1 (sql-edition/idempotency--$1.sql)" >&2
		return 1
	fi
}

# The update script from $1 to $2.
update_of() {
	if [[ -f $src/idempotency--$1--$2.sql ]]; then
		cat "$src/idempotency--$1--$2.sql"
	else
		script_of "$2"
	fi
}

# SQL that is true when pg_tle has version $1 of idempotency already.
registered() {
	printf "EXISTS (SELECT FROM pgtle.available_extension_versions() a WHERE a.name = 'idempotency' AND a.version = '%s')" "$1"
}

# A dollar quote that the quoted text does not contain.
quote=_idempotency_sql_edition_
for v in "${versions[@]}"; do
	if grep -qF "\$$quote\$" < <(script_of "$v"); then
		echo "sql-edition: the script of $v contains \$$quote\$" >&2
		exit 1
	fi
done

mkdir -p "$out"
{
	cat <<HDR
-- idempotency-pgtle.sql: the SQL edition of idempotency $newest for pg_tle.
-- Generated by scripts/sql-edition.sh from sql-edition/; do not edit.
--
-- Run as a member of pgtle_admin in each database that will use it, where
-- pg_tle is enabled (shared_preload_libraries) and CREATE EXTENSION pg_tle
-- was run; then CREATE EXTENSION idempotency.  Never in a database where
-- the C edition is installed.
BEGIN;
DO \$do\$
BEGIN
	IF EXISTS (SELECT FROM pg_catalog.pg_available_extensions a
			   WHERE a.name OPERATOR(pg_catalog.=) 'idempotency'
				 AND NOT EXISTS (SELECT FROM pgtle.available_extensions() t
								 WHERE t.name OPERATOR(pg_catalog.=) 'idempotency')) THEN
		RAISE EXCEPTION 'the C edition of idempotency is installed on this server'
			USING HINT = 'Use CREATE EXTENSION idempotency with the C edition; the SQL edition is for servers without it.';
	END IF;
END;
\$do\$;
HDR
	first=1
	for v in "${versions[@]}"; do
		if ((first)); then
			printf "SELECT pgtle.install_extension('idempotency', '%s', '%s',\n\$%s\$\n" "$v" "${comment//\'/\'\'}" "$quote"
			script_of "$v"
			printf "\$%s\$, NULL, 'idempotency')\n WHERE NOT %s;\n" "$quote" "$(registered "$v")"
			first=0
		else
			printf "SELECT pgtle.install_extension_version_sql('idempotency', '%s',\n\$%s\$\n" "$v" "$quote"
			script_of "$v"
			printf "\$%s\$)\n WHERE NOT %s;\n" "$quote" "$(registered "$v")"
		fi
	done
	for ((i = 1; i < ${#versions[@]}; i++)); do
		printf "SELECT pgtle.install_update_path('idempotency', '%s', '%s',\n\$%s\$\n" \
			"${versions[i - 1]}" "${versions[i]}" "$quote"
		update_of "${versions[i - 1]}" "${versions[i]}"
		printf "\$%s\$)\n WHERE NOT EXISTS (SELECT FROM pgtle.extension_update_paths('idempotency') p WHERE p.source = '%s' AND p.target = '%s' AND p.path IS NOT NULL);\n" \
			"$quote" "${versions[i - 1]}" "${versions[i]}"
	done
	printf "SELECT pgtle.set_default_version('idempotency', '%s');\n" "$newest"
	echo "COMMIT;"
} >"$tmp/idempotency-pgtle.sql"

{
	cat <<HDR
-- idempotency-plain.sql: the SQL edition of idempotency $newest, installed
-- directly (no extension).  Generated by scripts/sql-edition.sh from
-- sql-edition/; do not edit.
--
-- Run it in each database that will use it, as the role that is to own the
-- keys (it needs CREATE on the database).  Running it again upgrades in
-- place and keeps every key.  Never in a database where idempotency is
-- installed as an extension (C edition or pg_tle).
BEGIN;
DO \$do\$
BEGIN
	IF EXISTS (SELECT FROM pg_catalog.pg_extension e
			   WHERE e.extname OPERATOR(pg_catalog.=) 'idempotency') THEN
		RAISE EXCEPTION 'extension "idempotency" is installed in this database'
			USING HINT = 'The plain installer is for databases without the extension; update the extension instead.';
	END IF;
END;
\$do\$;
CREATE SCHEMA IF NOT EXISTS idempotency;
HDR
	script_of "$newest"
	printf "COMMENT ON SCHEMA idempotency IS 'idempotency SQL edition %s';\n" "$newest"
	echo "COMMIT;"
} >"$tmp/idempotency-plain.sql"

mv "$tmp/idempotency-pgtle.sql" "$tmp/idempotency-plain.sql" "$out/"
echo "wrote $out/idempotency-pgtle.sql and $out/idempotency-plain.sql ($newest)"
