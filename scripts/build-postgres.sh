#!/usr/bin/env bash
# scripts/build-postgres.sh MAJOR: build PostgreSQL MAJOR (17, 18, ...) from
# the Debian source package of a newer suite, into a cache outside the clone,
# for testing the extension against versions Debian 12 does not package.
#
#   scripts/build-postgres.sh 18          # prints the install prefix
#
# The archive's address comes from this machine's own apt sources (the one
# that serves bookworm's main component); the suite that carries
# postgresql-MAJOR is found in its Sources index (trixie first, then sid).
# The upstream tarball (.orig.tar.bz2) is checked against the SHA-256 that
# index gives.  A finished build is kept under
# ${IDEM_PG_CACHE:-/var/cache/idempotency-pg}/MAJOR and reused (a fresh
# clone finds it there); delete that directory to build again.  Run as root
# (apt-get for bison, flex and the libraries).  About 8 minutes on 2 cores.
set -euo pipefail

major=${1:?usage: scripts/build-postgres.sh MAJOR}
[[ $major =~ ^[0-9]+$ ]] || { echo "build-postgres: MAJOR must be a number, got '$major'" >&2; exit 2; }
cache=${IDEM_PG_CACHE:-/var/cache/idempotency-pg}
prefix=$cache/$major
suites=${IDEM_PG_SUITES:-"trixie sid"}

if [[ -x $prefix/bin/pg_config && -f $prefix/.built ]]; then
	echo "$prefix"
	exit 0
fi

say() { echo "== build-postgres $major: $*" >&2; }

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

uri=$(archive_uri | head -n1) || true
uri=${uri%/}
[[ -n $uri ]] || { echo "build-postgres: no apt source for bookworm main found in /etc/apt" >&2; exit 1; }

need=()
for p in bison flex gcc make perl libreadline-dev zlib1g-dev libssl-dev libicu-dev pkg-config \
	libipc-run-perl curl xz-utils bzip2; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
done
if ((${#need[@]})); then
	say "apt-get install ${need[*]}"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

mkdir -p "$cache/src"
work=$(mktemp -d "$cache/src/build-$major.XXXXXX")
trap 'rm -rf "$work"' EXIT

# Find the suite, the directory and the tarball with its SHA-256.
found=""
for suite in $suites; do
	say "looking for postgresql-$major in $uri $suite"
	curl -fsS "$uri/dists/$suite/main/source/Sources.xz" -o "$work/Sources.xz" || continue
	found=$(xz -dc "$work/Sources.xz" | awk -v pkg="postgresql-$major" '
		/^Package:/ { inpkg = ($2 == pkg) }
		inpkg && /^Directory:/ { dir = $2 }
		inpkg && /^Checksums-Sha256:/ { sums = 1; next }
		inpkg && sums && /^ / { if ($3 ~ /\.orig\.tar\.(bz2|gz|xz)$/) { orig = $3; sha = $1 } next }
		{ sums = 0 }
		/^$/ { if (inpkg && orig != "") { print dir, orig, sha; exit } inpkg = 0; orig = "" }
	') || true  # awk stops reading at the match: xz then dies of SIGPIPE
	[[ -n $found ]] && break
done
[[ -n $found ]] || { echo "build-postgres: postgresql-$major is in none of: $suites" >&2; exit 1; }
read -r dir orig sha <<<"$found"

say "fetching $orig from $suite"
curl -fsS "$uri/$dir/$orig" -o "$work/$orig"
echo "$sha  $work/$orig" | sha256sum -c --quiet - || { echo "build-postgres: SHA-256 mismatch for $orig" >&2; exit 1; }

tar -C "$work" -xf "$work/$orig"
srcdir=$(find "$work" -mindepth 1 -maxdepth 1 -type d -name 'postgresql-*' | head -n1)
say "configure and build into $prefix"
rm -rf "$prefix"
(
	cd "$srcdir"
	./configure --prefix="$prefix" --with-openssl --enable-tap-tests --enable-debug \
		>"$work/configure.log" 2>&1 ||
		{ tail -n 30 "$work/configure.log" >&2; exit 1; }
	make -s -j "$(nproc)" >"$work/make.log" 2>&1 || { tail -n 30 "$work/make.log" >&2; exit 1; }
	make -s install >/dev/null
	# what PGXS's installcheck needs: pg_regress, the isolation tester, the TAP modules
	make -s -C src/test/isolation install >/dev/null
	make -s -C src/test/perl install >/dev/null
	make -s -C contrib/amcheck install >/dev/null
) || exit 1
touch "$prefix/.built"
echo "$prefix"
