#!/usr/bin/env bash
# scripts/build-citus.sh PG_CONFIG: build Citus from the vendored source
# tarball and install it into the PostgreSQL installation that PG_CONFIG
# names, for the distributed tests (t/3*.pl).  Citus is a test dependency
# only: the project never ships it.
#
#   scripts/build-citus.sh /var/cache/idempotency-pg/17/bin/pg_config
#
# The tarball is the newest match of
# ${IDEM_CITUS_TARBALL:-<clone>/../shared/vendor/citus-*.tar.gz}.  It is
# built in a scratch directory (removed at exit) and installed once: a
# marker file, $(pg_config --sharedir)/extension/.citus-VERSION-built, says
# that the build finished, and a second run only prints "cached".  Delete
# the marker to build again.  Run as root when the build dependencies are
# missing (apt-get) or when the installation belongs to root.  About three
# minutes on 2 cores.
#
# Exit status: 0 installed (or cached); 3 Citus is not available for this
# PostgreSQL (no tarball, or a major version Citus does not support), with a
# one-line reason on stdout, and the distributed tests skip themselves;
# 1 the build or the installation failed; 2 usage.
set -euo pipefail

pg_config=${1:?usage: scripts/build-citus.sh PG_CONFIG}
[[ -x $pg_config ]] || { echo "build-citus: not an executable pg_config: $pg_config" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

version=$("$pg_config" --version | awk '{print $2}')
major=${version%%[^0-9]*}
[[ -n $major ]] || { echo "build-citus: no version number in: $("$pg_config" --version)" >&2; exit 1; }
say() { echo "== build-citus (PostgreSQL $major): $*" >&2; }

# Citus 14 supports PostgreSQL 16 to 18; the releases that still support 15
# do not compile against the PostgreSQL 15 this project tests with.
if ((major < 16)); then
	echo "Citus tests skipped: Citus needs PostgreSQL 16 or later (this is $version)"
	exit 3
fi

pkglibdir=$("$pg_config" --pkglibdir)
extdir=$("$pg_config" --sharedir)/extension

# shellcheck source=scripts/vendored.sh
source "$root/scripts/vendored.sh"
vendored_select citus Citus "${IDEM_CITUS_TARBALL:-$root/../shared/vendor/citus-*.tar.gz}" citus.so \
	"$pkglibdir" "$extdir"
tarball=$VENDORED_TARBALL
citus=$VENDORED_VERSION

vendored_apt say gcc make liblz4-dev libzstd-dev libcurl4-openssl-dev libkrb5-dev

work=$(mktemp -d "${TMPDIR:-/tmp}/build-citus.XXXXXX")
trap 'rm -rf "$work"' EXIT

say "building Citus $citus from $tarball"
tar -C "$work" -xzf "$tarball"
srcdir=$(find "$work" -mindepth 1 -maxdepth 1 -type d | head -n1)
[[ -n $srcdir && -x $srcdir/configure ]] || { echo "build-citus: no configure script in $tarball" >&2; exit 1; }
(
	cd "$srcdir"
	./configure PG_CONFIG="$pg_config" >"$work/configure.log" 2>&1 ||
		{ tail -n 30 "$work/configure.log" >&2; exit 1; }
	make -j "$(nproc)" >"$work/make.log" 2>&1 || { tail -n 30 "$work/make.log" >&2; exit 1; }
	make install >"$work/install.log" 2>&1 || { tail -n 30 "$work/install.log" >&2; exit 1; }
) || exit 1
vendored_built "$extdir" citus
echo "installed Citus $citus into $pkglibdir"
