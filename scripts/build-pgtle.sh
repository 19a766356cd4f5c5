#!/usr/bin/env bash
# scripts/build-pgtle.sh PG_CONFIG: build pg_tle from the vendored source
# tarball and install it into the PostgreSQL installation that PG_CONFIG
# names, so that the SQL edition's pg_tle installer can be tested
# (scripts/sql-edition-test.sh pgtle).  pg_tle is a test dependency only:
# the project never ships it (managed providers bring their own).
#
#   scripts/build-pgtle.sh /opt/sqled17/bin/pg_config
#
# The tarball is the newest match of
# ${IDEM_PGTLE_TARBALL:-<clone>/../shared/vendor/pg_tle-*.tar.gz}.  It is
# built in a scratch directory (removed at exit) and installed once: a
# marker file, $(pg_config --sharedir)/extension/.pg_tle-VERSION-built, says
# that the build finished, and a second run only prints "cached".  Delete
# the marker to build again.  Run as root when the installation belongs to
# root.
#
# Exit status: 0 installed (or cached); 3 pg_tle is not available (no
# tarball), with a one-line reason on stdout, and the pg_tle tests skip
# themselves; 1 the build or the installation failed; 2 usage.
set -euo pipefail

pg_config=${1:?usage: scripts/build-pgtle.sh PG_CONFIG}
[[ -x $pg_config ]] || { echo "build-pgtle: not an executable pg_config: $pg_config" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

version=$("$pg_config" --version | awk '{print $2}')
major=${version%%[^0-9]*}
[[ -n $major ]] || { echo "build-pgtle: no version number in: $("$pg_config" --version)" >&2; exit 1; }
say() { echo "== build-pgtle (PostgreSQL $major): $*" >&2; }

pkglibdir=$("$pg_config" --pkglibdir)
extdir=$("$pg_config" --sharedir)/extension

# shellcheck source=scripts/vendored.sh
source "$root/scripts/vendored.sh"
vendored_select pg_tle pg_tle "${IDEM_PGTLE_TARBALL:-$root/../shared/vendor/pg_tle-*.tar.gz}" pg_tle.so \
	"$pkglibdir" "$extdir"
tarball=$VENDORED_TARBALL
tle=$VENDORED_VERSION

vendored_apt say gcc make flex bison

work=$(mktemp -d "${TMPDIR:-/tmp}/build-pgtle.XXXXXX")
trap 'rm -rf "$work"' EXIT

say "building pg_tle $tle from $tarball"
tar -C "$work" -xzf "$tarball"
srcdir=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n1)
[[ -n $srcdir && -f $srcdir/Makefile ]] || { echo "build-pgtle: no Makefile in $tarball" >&2; exit 1; }
(
	cd "$srcdir"
	make -j "$(nproc)" PG_CONFIG="$pg_config" >"$work/make.log" 2>&1 ||
		{ tail -n 30 "$work/make.log" >&2; exit 1; }
	make install PG_CONFIG="$pg_config" >"$work/install.log" 2>&1 ||
		{ tail -n 30 "$work/install.log" >&2; exit 1; }
) || exit 1
vendored_built "$extdir" pg_tle
echo "installed pg_tle $tle into $pkglibdir"
