# shellcheck shell=bash
# scripts/setup.sh: the install step shared by `./run demo` and `./run test`.
# Source it from bash (after scripts/cluster.sh); it defines functions only.
#
# Functions:
#   setup_require_root                  exit with a message unless we are root
#   setup_packages [extra-package...]   apt-get install what is missing (no
#                                       apt at all when dpkg says everything
#                                       is installed)
#   setup_copy_tree <src> <dest>        copy the working tree without .git,
#                                       build products and test output
#   setup_build_install <dir>           make clean, make and make install in <dir>
#   setup_make_var <dir> <VAR>          print a variable of <dir>/Makefile
#                                       (e.g. REGRESS, ISOLATION)
#   setup_run_option <word...>          the options scripts/soak.sh and
#                                       scripts/fuzz.sh share: --keep,
#                                       --no-build, --out DIR
#   setup_scratch <name> <root>         their start: the scratch directory
#                                       WORK (removed at exit), and the build
#
# Settings (environment): PG_CONFIG (default
# /usr/lib/postgresql/15/bin/pg_config).  SETUP_MAKE_FLAGS (an array, empty
# by default) holds extra make variables for every make call above, so that
# a test build and the lists of its tests agree (./run test sets it).

: "${PG_CONFIG:=/usr/lib/postgresql/15/bin/pg_config}"
SETUP_MAKE_FLAGS=()

# Debian packages that building and testing the extension needs.
SETUP_PACKAGES=(
	postgresql-15 postgresql-server-dev-15 postgresql-15-pgtap
	libtap-parser-sourcehandler-pgtap-perl libipc-run-perl build-essential perl
	libssl-dev
)

# Stop with a clear message unless we run as root (apt, make install, runuser).
setup_require_root() {
	if [[ $(id -u) -ne 0 ]]; then
		echo "run: must run as root (it installs packages and the extension," \
			"and starts PostgreSQL as the postgres user)" >&2
		exit 1
	fi
}

# Print the packages among the arguments that dpkg does not list as installed.
setup_missing_packages() {
	local pkg
	for pkg in "$@"; do
		if [[ $(dpkg-query -W -f='${db:Status-Status}' "$pkg" 2>/dev/null) != installed ]]; then
			echo "$pkg"
		fi
	done
}

# Install the missing packages non-interactively; skip apt when none is missing.
setup_packages() {
	local missing
	mapfile -t missing < <(setup_missing_packages "${SETUP_PACKAGES[@]}" "$@")
	if ((${#missing[@]} == 0)); then
		echo "== packages: all installed"
		return 0
	fi
	echo "== packages: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update
	apt-get install -y "${missing[@]}"
}

# Copy the working tree <src> into <dest>, leaving out .git and build/test output.
setup_copy_tree() {
	local src=$1 dest=$2
	mkdir -p "$dest"
	tar -C "$src" -cf - \
		--exclude=./.git --exclude=node_modules --exclude='*.o' --exclude='*.so' \
		--exclude='*.bc' --exclude=./results --exclude=./output_iso \
		--exclude=./tmp_check --exclude=./log --exclude=./regression.diffs \
		--exclude=./regression.out --exclude=./bench/out --exclude=./.build . |
		tar -C "$dest" -xf -
}

# Build the extension in <dir> from clean and install it.  PGXS does not
# rebuild an object when only the flags change, so objects left by a build
# with other flags (a test build's pause points, say) would be linked in.
setup_build_install() {
	local dir=$1
	echo "== build: make PG_CONFIG=$PG_CONFIG ${SETUP_MAKE_FLAGS[*]}"
	make -s -C "$dir" --no-print-directory PG_CONFIG="$PG_CONFIG" clean || return 1
	make -s -C "$dir" --no-print-directory -j "$(nproc)" PG_CONFIG="$PG_CONFIG" \
		"${SETUP_MAKE_FLAGS[@]}" || return 1
	echo "== install: make install"
	make -s -C "$dir" --no-print-directory PG_CONFIG="$PG_CONFIG" \
		"${SETUP_MAKE_FLAGS[@]}" install || return 1
}

# Print the value of variable <VAR> as <dir>/Makefile computes it.
setup_make_var() {
	local dir=$1 var=$2
	# shellcheck disable=SC2016 # $(VAR) is make syntax, not the shell's
	make -s --no-print-directory -C "$dir" -f Makefile \
		-f <(printf '_print_var:\n\t@echo $(%s)\n' "$var") \
		PG_CONFIG="$PG_CONFIG" "${SETUP_MAKE_FLAGS[@]}" _print_var
}

# Parse one option that scripts/soak.sh and scripts/fuzz.sh share, from the
# words given: --keep (KEEP=1), --no-build (BUILD=0) or --out DIR (out=DIR).
# Sets SETUP_SHIFT to the number of words it took; returns 1 for any other
# word, or --out without a directory.
setup_run_option() {
	case $1 in
	--keep) KEEP=1 SETUP_SHIFT=1 ;;
	--no-build) BUILD=0 SETUP_SHIFT=1 ;;
	--out)
		[[ -n ${2:-} ]] || return 1
		# shellcheck disable=SC2034 # read by the script that sourced this
		out=$2 SETUP_SHIFT=2
		;;
	*) return 1 ;;
	esac
}

# The start of scripts/<name>.sh: PG_BIN from PG_CONFIG, amcheck (its
# checks need it), the scratch directory WORK, whose clusters are stopped
# (by data directory) and which is removed at exit (kept with KEEP=1), and
# unless BUILD=0 the extension built from a copy of <root> with
# SETUP_MAKE_FLAGS and installed into PG_CONFIG's PostgreSQL.
setup_scratch() {
	local name=$1 root=$2
	# shellcheck disable=SC2034 # read by scripts/cluster.sh
	PG_BIN=$("$PG_CONFIG" --bindir)
	if [[ ! -f $("$PG_CONFIG" --sharedir)/extension/amcheck.control ]]; then
		echo "$name: amcheck is not installed in $("$PG_CONFIG" --sharedir)/extension" >&2
		exit 1
	fi
	WORK=$(mktemp -d "/tmp/idempotency-$name.XXXXXX")
	chmod 755 "$WORK"
	trap setup_scratch_cleanup EXIT
	trap 'exit 130' INT TERM
	if ((BUILD)); then
		setup_copy_tree "$root" "$WORK/src"
		setup_build_install "$WORK/src"
	fi
}

# At exit of a script that called setup_scratch: stop its clusters, then
# remove WORK unless KEEP is 1.
# shellcheck disable=SC2317 # called by the EXIT trap
setup_scratch_cleanup() {
	cluster_stop_all >/dev/null 2>&1 || true
	if [[ -n $WORK && $KEEP -eq 0 ]]; then
		rm -rf "$WORK"
	elif [[ -n $WORK ]]; then
		echo "== kept: $WORK"
	fi
}
