#!/usr/bin/env bash
# scripts/build-postgres.sh MAJOR: a PostgreSQL MAJOR (17, 18, ...) to test
# the extension against, for the majors Debian 12 does not package.  Prints
# the install prefix on stdout; says where the sources came from on stderr.
#
#   scripts/build-postgres.sh 18          # prints the install prefix
#   scripts/build-postgres.sh --cassert 17
#
# --cassert builds the assertion-enabled flavour that scripts/memcheck runs
# the suites against: --enable-cassert --enable-debug, CFLAGS "-O1 -g
# -fno-omit-frame-pointer -DUSE_VALGRIND" (memory contexts then tell valgrind
# which palloc chunks are allocated, so a read of freed or uninitialised
# palloc memory is reported; without valgrind it costs nothing).  It never
# uses an installed package (Debian's are built without assertions), goes
# into its own cache directory, MAJOR-cassert, and keeps the source's
# src/tools/valgrind.supp in its share directory (pg_config --sharedir).
#
# Where PostgreSQL comes from, first match wins:
#   1. an installed server package (PGDG or Debian): postgresql-MAJOR with
#      postgresql-server-dev-MAJOR, i.e. /usr/lib/postgresql/MAJOR/bin/pg_config
#      and pg_ctl; a user's machine usually has these;
#   2. a build from the upstream tarball pinned in scripts/postgres-sources
#      (file name and SHA-256), taken from
#      ${IDEM_PG_VENDOR:-<clone>/../shared/vendor} when it is there, else from
#      the pool of the Debian archive this machine's apt sources name, by
#      that pinned file name.  The tarball is checked with sha256sum -c
#      against the pinned checksum and refused on a mismatch.  No package
#      index is read: the run never depends on what the archive calls newest.
# A finished build is kept under ${IDEM_PG_CACHE:-/var/cache/idempotency-pg}/MAJOR
# with a .built marker naming the version and checksum it was built from;
# a pin that changes rebuilds it.  Run as root (apt-get for bison, flex and
# the libraries).  About 8 minutes on 2 cores.
#
# IDEM_PG_SOURCE_ONLY=1 stops after the tarball is found and verified (no
# build; the cache is not touched): the pipeline tests use it.
#
# Exit status: 0 found or built; 1 no source could be had or the build
# failed, with a one-line reason on stderr ("build-postgres: ..."); 2 usage.
set -euo pipefail

cassert=0
if [[ ${1:-} == --cassert ]]; then
	cassert=1
	shift
fi
major=${1:?usage: scripts/build-postgres.sh [--cassert] MAJOR}
[[ $major =~ ^[0-9]+$ ]] || { echo "build-postgres: MAJOR must be a number, got '$major'" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${IDEM_PG_CACHE:-/var/cache/idempotency-pg}
vendor=${IDEM_PG_VENDOR:-$(cd "$root/.." && pwd)/shared/vendor}
pins=${IDEM_PG_PINS:-$root/scripts/postgres-sources}
prefix=$cache/$major
configure_extra=()
if ((cassert)); then
	prefix=$cache/$major-cassert
	configure_extra=(--enable-cassert CFLAGS="-O1 -g -fno-omit-frame-pointer -DUSE_VALGRIND")
fi

say() { echo "== build-postgres $major: $*" >&2; }
die() { echo "build-postgres: $*" >&2; exit 1; }

# 1. An installed server package.
pkg=/usr/lib/postgresql/$major
if [[ -z ${IDEM_PG_SOURCE_ONLY:-} && $cassert -eq 0 && -x $pkg/bin/pg_config && -x $pkg/bin/pg_ctl ]]; then
	say "PostgreSQL $("$pkg/bin/pg_config" --version | awk '{print $2}') from the installed package ($pkg)"
	echo "$pkg"
	exit 0
fi

# 2. The pinned tarball.
read -r _ version file sha < <(awk -v m="$major" '$1 == m { print; exit }' "$pins") ||
	die "PostgreSQL $major is not pinned in ${pins#"$root"/} (no line for it)"
stamp="$version $file sha256:$sha"
if ((cassert)); then
	stamp="$stamp cassert"
fi

if [[ -z ${IDEM_PG_SOURCE_ONLY:-} && -x $prefix/bin/pg_config && -f $prefix/.built &&
	$(cat "$prefix/.built") == "$stamp" ]]; then
	say "PostgreSQL $stamp (cached build in $prefix)"
	echo "$prefix"
	exit 0
fi

# The URI of the Debian archive this machine uses for bookworm's main
# component, from deb822 .sources files or one-line sources.list entries.
archive_uri() {
	local f
	for f in /etc/apt/sources.list.d/*.sources; do
		[[ -f $f ]] || continue
		awk '
			/^[[:space:]]*$/ { if (uri != "" && suite && main) { print uri; exit } uri = ""; suite = 0; main = 0; next }
			/^URIs:/ { uri = $2 }
			/^Suites:/ { for (i = 2; i <= NF; i++) if ($i == "bookworm") suite = 1 }
			/^Components:/ { for (i = 2; i <= NF; i++) if ($i == "main") main = 1 }
			END { if (uri != "" && suite && main) print uri }
		' "$f" | head -n1
	done | head -n1
	for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
		[[ -f $f ]] || continue
		awk '$1 == "deb" && $3 == "bookworm" { for (i = 4; i <= NF; i++) if ($i == "main") { print $2; exit } }' "$f"
	done | head -n1
}

mkdir -p "$cache/src"
work=$(mktemp -d "$cache/src/build-$major.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Verify <tarball> against the pinned checksum; the caller refuses a mismatch.
verify() {
	(cd "$(dirname "$1")" && echo "$sha  $(basename "$1")" | sha256sum -c --quiet - >/dev/null 2>&1)
}

tarball=""
if [[ -f $vendor/$file ]]; then
	verify "$vendor/$file" ||
		die "$vendor/$file does not match the SHA-256 pinned in scripts/postgres-sources ($sha): refused"
	tarball=$vendor/$file
	origin="vendored $tarball"
else
	uri=$(archive_uri | head -n1) || true
	uri=${IDEM_PG_ARCHIVE:-${uri%/}}
	[[ -n $uri ]] || die "no $file in $vendor and no apt source for bookworm main to fetch it from"
	say "fetching $file from the archive's pool (not in $vendor)"
	curl -fsS --retry 2 "$uri/pool/main/p/postgresql-$major/$file" -o "$work/$file" 2>"$work/curl.log" ||
		die "no $file in $vendor, and the archive did not serve it: $(tail -n1 "$work/curl.log")"
	verify "$work/$file" ||
		die "$file from the archive does not match the SHA-256 pinned in scripts/postgres-sources ($sha): refused"
	tarball=$work/$file
	origin="archive pool $uri"
fi
say "PostgreSQL $stamp, from $origin (checksum verified)"
if [[ -n ${IDEM_PG_SOURCE_ONLY:-} ]]; then
	echo "$tarball"
	exit 0
fi

# shellcheck source=scripts/vendored.sh
source "$root/scripts/vendored.sh"
vendored_apt say bison flex gcc make perl libreadline-dev zlib1g-dev libssl-dev libicu-dev pkg-config \
	libipc-run-perl curl bzip2

tar -C "$work" -xf "$tarball"
srcdir=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'postgresql-*' | head -n1)
[[ -n $srcdir ]] || die "$file holds no postgresql-* directory"
say "configure and build into $prefix"
rm -rf "$prefix"
(
	cd "$srcdir"
	./configure --prefix="$prefix" --with-openssl --enable-tap-tests --enable-debug \
		"${configure_extra[@]}" >"$work/configure.log" 2>&1 ||
		{ tail -n 30 "$work/configure.log" >&2; exit 1; }
	make -s -j "$(nproc)" >"$work/make.log" 2>&1 || { tail -n 30 "$work/make.log" >&2; exit 1; }
	make -s install >/dev/null
	# what PGXS's installcheck needs: pg_regress, the isolation tester, the TAP modules
	make -s -C src/test/isolation install >/dev/null
	make -s -C src/test/perl install >/dev/null
	make -s -C contrib/amcheck install >/dev/null
	make -s -C contrib/pageinspect install >/dev/null
	# valgrind's suppressions for PostgreSQL's deliberate tricks (scripts/memcheck valgrind)
	if ((cassert)); then
		cp src/tools/valgrind.supp "$("$prefix/bin/pg_config" --sharedir)/valgrind.supp"
	fi
	# pgindent's formatter, for ./run indent
	if [[ -d src/tools/pg_bsd_indent ]]; then
		make -s -C src/tools/pg_bsd_indent >/dev/null && cp src/tools/pg_bsd_indent/pg_bsd_indent "$prefix/bin/"
		mkdir -p "$prefix/share/pgindent" && cp src/tools/pgindent/pgindent src/tools/pgindent/typedefs.list "$prefix/share/pgindent/"
	fi
) || die "the build of PostgreSQL $version failed (the lines above say why)"
echo "$stamp" >"$prefix/.built"
say "built PostgreSQL $stamp into $prefix"
echo "$prefix"
