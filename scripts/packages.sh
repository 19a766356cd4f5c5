# shellcheck shell=bash
# scripts/packages.sh: the two packages of the extension, each built,
# checked, installed and tested the way a user gets it: the Debian package
# (apt install postgresql-15-idempotency) and the PGXN release zip (pgxn
# install idempotency). Source it from bash after scripts/cluster.sh,
# scripts/setup.sh and scripts/suites.sh; it defines functions only.
#
# debian/ builds one binary package postgresql-NN-idempotency for every
# PostgreSQL major version that pg_buildext finds (postgresql-server-dev-NN
# installed and allowed by debian/pgversions): here Debian 12's 15 only; the
# source builds under /var/cache/idempotency-pg are not packages and play no
# part. Each step is one test: deb/version, deb/build, deb/lintian,
# deb/install, deb/installcheck/NN (one per packaged version), deb/purge.
#
# Functions:
#   package_deb_test <src> <work>       every step below, in order, on a copy
#                                       <src> of the tree (with debian/), in
#                                       the scratch directory <work>
#   package_deb_build <src> <work>      orig tarball + dpkg-buildpackage -us -uc
#   package_deb_lintian <work>          lintian on the .changes
#   package_deb_install <work>          dpkg -i the .debs, over no make install
#   package_deb_installcheck <src> <work> <NN> <port>
#                                       pg_regress against the installed files
#   package_deb_purge <work>            dpkg --purge, and no file left behind
#   package_system_save <dir> [pg_config...]
#                                       copy the extension's files (and note the
#                                       package) of every packaged PostgreSQL
#   package_system_restore <dir>        put them back as they were
#   package_pgxn_test <src> <work> <port>
#                                       make dist in <src>, META.json checked,
#                                       pgxn install from the zip, installcheck
#                                       against the installed files: pgxn/dist,
#                                       pgxn/meta, pgxn/install,
#                                       pgxn/installcheck
#
# Settings (environment): IDEM_DEB_PORT (default 55413; version n of the
# packaged ones gets IDEM_DEB_PORT + n - 1). PACKAGES_DEB_NEEDS and
# PACKAGES_PGXN_NEEDS list the Debian packages these steps need (for
# setup_packages).

: "${IDEM_DEB_PORT:=55413}"

# Debian packages that building, checking and installing the .deb needs
# (debian/control's Build-Depends, dpkg-buildpackage's and lintian).
# shellcheck disable=SC2034 # ./run passes it to setup_packages
PACKAGES_DEB_NEEDS=(
	build-essential debhelper dpkg-dev lintian libssl-dev postgresql-server-dev-all
)

# What package_deb_build leaves for the later steps: the .changes file, the
# .deb files, and the PostgreSQL major versions they are built for.
PACKAGE_CHANGES=""
PACKAGE_DEBS=()
PACKAGE_VERSIONS=()

# Print the binary package name for PostgreSQL major version <NN>.
package_deb_name() {
	echo "postgresql-$1-idempotency"
}

# Check that the packaged upstream version (debian/changelog) is the
# release's version, whose major.minor is the extension's default_version,
# so that the package never installs an SQL version other than the one its
# version number says: check-meta.py --tree checks every file that names
# the version against META.json.
package_deb_version() {
	local src=$1
	"$src/scripts/check-meta.py" --tree "$src" "$src/META.json"
}

# Build the source and binary packages from <src> in <work>/build: an orig
# tarball made from the tree (without debian/, as a release tarball has
# none), then dpkg-buildpackage -us -uc on an unpacked copy. Set
# PACKAGE_CHANGES, PACKAGE_DEBS and PACKAGE_VERSIONS; fail unless there is a
# .deb for every version pg_buildext finds.
package_deb_build() {
	local src=$1 work=$2 version upstream dir v deb rc=0
	local build="$work/build"
	PACKAGE_CHANGES="" PACKAGE_DEBS=() PACKAGE_VERSIONS=()
	version=$(dpkg-parsechangelog -l "$src/debian/changelog" -S Version) || return 1
	upstream=${version%-*}
	dir="$build/idempotency-$upstream"
	rm -rf "$build"
	mkdir -p "$dir" || return 1
	setup_copy_tree "$src" "$dir" || return 1
	# Build output that git ignores and setup_copy_tree copies: Python's
	# byte-code caches, and the PGXN zip that make dist leaves in the tree.
	find "$dir" -name __pycache__ -prune -exec rm -rf {} + || return 1
	rm -f "$dir"/idempotency-*.zip
	rm -rf "$dir/debian"
	echo "== orig tarball: idempotency_$upstream.orig.tar.gz"
	tar -C "$build" --sort=name --owner=0 --group=0 --numeric-owner \
		-czf "$build/idempotency_$upstream.orig.tar.gz" "idempotency-$upstream" || return 1
	cp -a "$src/debian" "$dir/debian" || return 1
	mapfile -t PACKAGE_VERSIONS < <(cd "$dir" && pg_buildext supported-versions)
	echo "== PostgreSQL versions pg_buildext finds: ${PACKAGE_VERSIONS[*]:-none}"
	((${#PACKAGE_VERSIONS[@]})) || return 1
	echo "== dpkg-buildpackage -us -uc (log: $build/build.log)"
	(cd "$dir" && dpkg-buildpackage -us -uc --jobs-try=auto) >"$build/build.log" 2>&1 || rc=$?
	if ((rc != 0)); then
		tail -n 80 "$build/build.log"
		echo "-- dpkg-buildpackage exited with status $rc"
		return 1
	fi
	grep -E '^(dpkg-deb: building package|dpkg-source: info: building)' "$build/build.log"
	PACKAGE_CHANGES="$build/idempotency_${version}_$(dpkg --print-architecture).changes"
	[[ -f $PACKAGE_CHANGES ]] || { echo "-- no $PACKAGE_CHANGES"; return 1; }
	for v in "${PACKAGE_VERSIONS[@]}"; do
		deb="$build/$(package_deb_name "$v")_${version}_$(dpkg --print-architecture).deb"
		if [[ ! -f $deb ]]; then
			echo "-- PostgreSQL $v: no ${deb##*/}"
			return 1
		fi
		PACKAGE_DEBS+=("$deb")
	done
}

# Run lintian on the .changes (source, binary and buildinfo) and print what
# it says, the overridden tags included (O:); fail on any error (E:) or
# warning (W:) that no override hides. The verdict comes from the tags, not
# the exit status, because lintian 2.116 exits 2 for an overridden warning
# when --show-overrides shows it; status 1 is lintian itself failing.
package_deb_lintian() {
	local work=$1 rc=0
	[[ -n $PACKAGE_CHANGES ]] || { echo "-- nothing built"; return 1; }
	echo "== lintian ${PACKAGE_CHANGES##*/}"
	# lintian needs no privileges, so it runs as the postgres user
	as_postgres env HOME=/tmp lintian --info --display-info --show-overrides \
		--fail-on error,warning "$PACKAGE_CHANGES" >"$work/lintian.log" 2>&1 || rc=$?
	cat "$work/lintian.log"
	if ((rc != 0 && rc != 2)); then
		echo "-- lintian exited with status $rc"
		return 1
	fi
	if grep -Eq '^[EW]: ' "$work/lintian.log"; then
		echo "-- lintian reports errors or warnings that no override hides"
		return 1
	fi
}

# Remove the extension's files from the PostgreSQL of pg_config <pgc>: the
# library, its JIT bitcode, the control file and the scripts.  A package
# test installs over nothing, so that it tests the package's files only.
package_remove_installed() {
	local pgc=$1
	rm -fv "$("$pgc" --pkglibdir)"/idempotency.so \
		"$("$pgc" --pkglibdir)"/bitcode/idempotency.index.bc
	rm -rfv "$("$pgc" --pkglibdir)"/bitcode/idempotency
	rm -fv "$("$pgc" --sharedir)"/extension/idempotency.control \
		"$("$pgc" --sharedir)"/extension/idempotency--*.sql
}

# The extension's files in the PostgreSQL of pg_config <pgc>, one per line:
# what a make install or the package puts there.
package_system_files() {
	local pgc=$1 lib share
	lib=$("$pgc" --pkglibdir)
	share=$("$pgc" --sharedir)/extension
	find "$lib" -maxdepth 1 -name idempotency.so
	[[ -d $lib/bitcode ]] && find "$lib/bitcode" \( -name idempotency.index.bc \
		-o -path "$lib/bitcode/idempotency/*" \) \( -type f -o -type l \)
	find "$share" -maxdepth 1 \( -name idempotency.control -o -name 'idempotency--*.sql' \)
}

# Keep a copy, in <dir>, of the extension's files in every packaged
# PostgreSQL (/usr/lib/postgresql/NN, or the <pg_config>s given) and whether
# its Debian package is installed: a test run installs, packages and purges
# over them, and package_system_restore puts back what a user had (a kept
# demo, their own make install, the package).
package_system_save() {
	local dir=$1 pgc v pkg
	shift
	(($#)) || set -- /usr/lib/postgresql/*/bin/pg_config
	mkdir -p "$dir"
	for pgc in "$@"; do
		[[ -x $pgc ]] || continue
		v=$(basename "$(dirname "$(dirname "$pgc")")")
		echo "$pgc" >"$dir/$v.pg_config"
		pkg=$(package_deb_name "$v")
		if dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed; then
			dpkg-query -W -f='${Version}' "$pkg" >"$dir/$v.package"
		fi
		package_system_files "$pgc" >"$dir/$v.files"
		tar -cPf "$dir/$v.tar" -T "$dir/$v.files"
	done
}

# Put back what package_system_save <dir> found: the same files, or the
# package (reinstalled from this run's build, the only .deb at hand, when
# the test purged it).  Says what it did, per version.
package_system_restore() {
	local dir=$1 saved v pgc pkg n deb
	for saved in "$dir"/*.files; do
		[[ -f $saved ]] || continue
		v=$(basename "$saved" .files)
		pgc=$(cat "$dir/$v.pg_config")
		pkg=$(package_deb_name "$v")
		n=$(wc -l <"$saved")
		if [[ -f $dir/$v.package ]]; then
			if dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed; then
				echo "== PostgreSQL $v: $pkg is installed, as before the test"
				continue
			fi
			deb=""
			for deb in "${PACKAGE_DEBS[@]}"; do
				[[ $deb == */${pkg}_* ]] && break
				deb=""
			done
			package_remove_installed "$pgc" >/dev/null
			if [[ -n $deb ]] && dpkg -i "$deb" >/dev/null; then
				echo "== PostgreSQL $v: $pkg $(cat "$dir/$v.package") was installed before the test;" \
					"reinstalled this run's build of it (${deb##*/})"
			else
				echo "== PostgreSQL $v: $pkg $(cat "$dir/$v.package") was installed before the test" \
					"and could not be reinstalled: apt-get install $pkg"
			fi
			continue
		fi
		if dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed; then
			dpkg --purge "$pkg" >/dev/null
		fi
		package_remove_installed "$pgc" >/dev/null
		if ((n)); then
			tar -xPf "$dir/$v.tar"
			echo "== PostgreSQL $v: put back the extension's $n files that were installed before the test"
		else
			echo "== PostgreSQL $v: removed the extension's files (none were installed before the test)"
		fi
	done
	rm -rf "$dir"
}

# Remove the extension's files that a make install left in the packaged
# PostgreSQL's directories (dpkg refuses nothing there, so a package test
# over them would test them), then install the .debs and check that dpkg
# owns the library and the control file of every packaged version.
package_deb_install() {
	local work=$1 v pgc lib control owner f
	((${#PACKAGE_DEBS[@]})) || { echo "-- nothing built"; return 1; }
	for v in "${PACKAGE_VERSIONS[@]}"; do
		pgc="/usr/lib/postgresql/$v/bin/pg_config"
		if dpkg-query -W -f='${db:Status-Status}' "$(package_deb_name "$v")" 2>/dev/null |
			grep -qx installed; then
			dpkg --purge "$(package_deb_name "$v")" || return 1
		fi
		echo "== PostgreSQL $v: removing files of an earlier make install"
		package_remove_installed "$pgc"
	done
	echo "== dpkg -i ${PACKAGE_DEBS[*]##*/}"
	dpkg -i "${PACKAGE_DEBS[@]}" || return 1
	for v in "${PACKAGE_VERSIONS[@]}"; do
		pgc="/usr/lib/postgresql/$v/bin/pg_config"
		lib="$("$pgc" --pkglibdir)/idempotency.so"
		control="$("$pgc" --sharedir)/extension/idempotency.control"
		for f in "$lib" "$control"; do
			owner=$(dpkg -S "$f" 2>/dev/null | cut -d: -f1) || true
			echo "== dpkg -S $f: ${owner:-no package}"
			[[ $owner == "$(package_deb_name "$v")" ]] || return 1
		done
	done
}

# Run the Makefile's REGRESS list with make installcheck, as postgres, from a
# fresh copy of <src>, against a throwaway cluster of PostgreSQL <NN> that
# preloads the library exactly as ./run test's does. installcheck builds
# nothing; NO_INSTALL=1 keeps any install out of it as well, and the step
# fails if an object or library appears in the copy or if a packaged file no
# longer matches the package (dpkg --verify): the server ran the .deb's files.
package_deb_installcheck() {
	local src=$1 work=$2 v=$3 port=$4 rc=0 n built
	local check="$work/check-$v" cluster="$work/cluster-$v"
	local PG_BIN="/usr/lib/postgresql/$v/bin"
	# shellcheck disable=SC2034 # read by setup_make_var and suite_installcheck
	local PG_CONFIG="$PG_BIN/pg_config"
	rm -rf "$check" "$cluster"
	setup_copy_tree "$src" "$check" || return 1
	rm -rf "$check/debian"
	chown -R "$PG_OS_USER": "$check" || return 1
	local -a regress
	mapfile -t regress < <(setup_make_var "$check" REGRESS | tr ' ' '\n' | sed '/^$/d')
	n=${#regress[@]}
	((n)) || { echo "-- the Makefile lists no pg_regress test"; return 1; }
	echo "== PostgreSQL $v: $n pg_regress tests against the installed package (port $port)"
	# The background sweeper is off: these tests decide who sweeps and when.
	cluster_start "$cluster" "$port" "${SUITE_CONF[@]}" || return 1
	suite_installcheck "$check" "$cluster" "$check/.regress.log" ISOLATION= NO_INSTALL=1 || rc=$?
	cluster_stop "$cluster"
	if [[ -s $check/regression.diffs ]]; then
		echo "== regression.diffs"
		cat "$check/regression.diffs"
	fi
	if ((rc != 0)); then
		echo "-- make installcheck exited with status $rc"
		return 1
	fi
	# " All 23 tests passed." up to PostgreSQL 15, "# All 23 tests passed." from 16
	if ! grep -Eq "^[# ]*All $n tests passed" "$check/.regress.log"; then
		echo "-- pg_regress did not report all $n tests passed"
		return 1
	fi
	built=$(find "$check" \( -name '*.o' -o -name '*.so' -o -name '*.bc' \) -print)
	if [[ -n $built ]]; then
		echo "-- the test step built files from source:"
		echo "$built"
		return 1
	fi
	echo "== dpkg --verify $(package_deb_name "$v")"
	dpkg --verify "$(package_deb_name "$v")" || return 1
}

# Purge the packages and check that dpkg forgets them and that none of the
# files they installed is left.
package_deb_purge() {
	local work=$1 v pkg f left=0
	local -a files
	((${#PACKAGE_VERSIONS[@]})) || { echo "-- nothing built"; return 1; }
	for v in "${PACKAGE_VERSIONS[@]}"; do
		pkg=$(package_deb_name "$v")
		mapfile -t files < <(dpkg -L "$pkg" 2>/dev/null)
		((${#files[@]})) || { echo "-- $pkg is not installed"; return 1; }
		echo "== dpkg --purge $pkg"
		dpkg --purge "$pkg" || return 1
		if dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null | grep -qx installed; then
			echo "-- dpkg still lists $pkg as installed"
			return 1
		fi
		for f in "${files[@]}"; do
			if [[ -f $f || -L $f ]]; then
				echo "-- left behind: $f"
				left=1
			fi
		done
	done
	((left == 0))
}

# Record one step as one test: package_deb_step <name> <function> [args...].
# The step's time goes into the output; a step that fails is recorded failed.
package_deb_step() {
	local name=$1 started=$SECONDS rc=0
	shift
	echo
	echo "== $name"
	"$@" || rc=$?
	echo "-- $name took $((SECONDS - started))s"
	if ((rc == 0)); then
		test_pass "$name"
	else
		test_fail "$name"
		return 1
	fi
}

# The whole package test on the tree copy <src> in the scratch directory
# <work>: version, build, lintian, install, installcheck per packaged
# version, purge. A step whose input is missing (nothing built, nothing
# installed) is recorded failed rather than left out.
package_deb_test() {
	local src=$1 work=$2 v i=0 installed=0
	mkdir -p "$work"
	chmod 755 "$work"
	package_deb_step deb/version package_deb_version "$src" || true
	if ! package_deb_step deb/build package_deb_build "$src" "$work"; then
		test_fail deb/lintian "build failed"
		test_fail deb/install "build failed"
		if ((${#PACKAGE_VERSIONS[@]})); then
			for v in "${PACKAGE_VERSIONS[@]}"; do
				test_fail "deb/installcheck/$v" "build failed"
			done
		else
			test_fail deb/installcheck "build failed"
		fi
		test_fail deb/purge "build failed"
		return 0
	fi
	package_deb_step deb/lintian package_deb_lintian "$work" || true
	package_deb_step deb/install package_deb_install "$work" && installed=1
	for v in "${PACKAGE_VERSIONS[@]}"; do
		if ((installed)); then
			package_deb_step "deb/installcheck/$v" package_deb_installcheck "$src" "$work" \
				"$v" $((IDEM_DEB_PORT + i)) || true
		else
			test_fail "deb/installcheck/$v" "not installed"
		fi
		i=$((i + 1))
	done
	package_deb_step deb/purge package_deb_purge "$work" || true
}

# Packages the PGXN test needs: zip for make dist, pgxnclient (the `pgxn`
# command PGXN users install with), unzip.
# shellcheck disable=SC2034 # ./run passes it to setup_packages
PACKAGES_PGXN_NEEDS=(zip unzip pgxnclient)

# Build the PGXN release zip from <src> (make dist), check its META.json, then
# do what a PGXN user does with it: `pgxn install` from the zip (build and
# install against $PG_CONFIG), and run the zip's regression and isolation
# suites (make installcheck in a fresh unpacked copy, owned by postgres)
# against a throwaway cluster that loads the installed files. Records
# pgxn/dist, pgxn/meta, pgxn/install and pgxn/installcheck.
# Usage: package_pgxn_test <src> <workdir> <port>
package_pgxn_test() {
	local src=$1 work=$2 port=$3 zip unpacked cluster="$2/cluster_pgxn"
	mkdir -p "$work"
	echo "== PGXN: make dist"
	if ! zip=$(make -s -C "$src" --no-print-directory PG_CONFIG="$PG_CONFIG" dist | tail -n 1) ||
		[[ ! -f $zip ]]; then
		test_fail pgxn/dist "make dist made no zip"
		test_fail pgxn/meta "no zip"
		test_fail pgxn/install "no zip"
		test_fail pgxn/installcheck "no zip"
		return 0
	fi
	mv "$zip" "$work/"
	zip=$work/${zip##*/}
	test_pass pgxn/dist
	unzip -l "$zip" | tail -n 1

	# The META.json in the zip, checked against the files in the zip.
	unpacked=$work/pgxn-unpacked
	rm -rf "$unpacked" && mkdir -p "$unpacked"
	unzip -q "$zip" -d "$unpacked"
	unpacked=$(echo "$unpacked"/idempotency-*/)
	unpacked=${unpacked%/}
	if "$src/scripts/check-meta.py" --tree "$unpacked" "$unpacked/META.json"; then
		test_pass pgxn/meta
	else
		test_fail pgxn/meta "META.json in the zip"
	fi

	echo "== PGXN: pgxn install $zip (over no earlier install)"
	package_remove_installed "$PG_CONFIG"
	if suite_run "$work/pgxn-install.log" "$FILE_TIMEOUT" \
		pgxn install --nosudo --pg_config "$PG_CONFIG" "$zip" &&
		[[ -f $("$PG_CONFIG" --pkglibdir)/idempotency.so ]]; then
		test_pass pgxn/install
	else
		test_fail pgxn/install "pgxn install failed"
		test_fail pgxn/installcheck "not installed"
		return 0
	fi

	# installcheck against the installed files: a plain `make installcheck`
	# in the unpacked zip (no pause points: those specs are left out), the
	# TAP tests left out since they start servers of their own from a build.
	chown -R "$PG_OS_USER": "$unpacked"
	echo "== PGXN: installcheck (port $port)"
	if ! cluster_start "$cluster" "$port" "${SUITE_CONF[@]}"; then
		test_fail pgxn/installcheck "cluster did not start"
		return 0
	fi
	if suite_run "$work/pgxn-installcheck.log" "$SUITE_TIMEOUT" --as-postgres \
		env $(suite_env) make -C "$unpacked" --no-print-directory PG_CONFIG="$PG_CONFIG" \
		PGHOST="$(cluster_host "$cluster")" PGPORT="$port" PGUSER=postgres \
		TAP_TESTS= NO_INSTALLCHECK= installcheck; then
		test_pass pgxn/installcheck
	else
		test_fail pgxn/installcheck "see $unpacked/regression.diffs or output_iso/"
		cat "$unpacked"/regression.diffs "$unpacked"/output_iso/regression.diffs 2>/dev/null | head -n 100 || true
	fi
	cluster_stop "$cluster"
}
