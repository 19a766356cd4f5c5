# shellcheck shell=bash
# scripts/vendored.sh: what the builds of vendored test dependencies share
# (scripts/build-postgres.sh, build-citus.sh, build-pgtle.sh).  Source it
# from bash; it defines functions only.
#
#   vendored_apt SAY PKG...         apt-get install the packages dpkg does not
#                                   list as installed (none: no apt at all);
#                                   SAY is the script's function that prints
#                                   a progress line
#   vendored_select NAME LABEL PATTERN LIBRARY PKGLIBDIR EXTDIR
#                                   the newest tarball matching PATTERN by
#                                   version number: sets VENDORED_TARBALL,
#                                   VENDORED_VERSION and VENDORED_MARKER
#                                   (EXTDIR/.NAME-VERSION-built); prints
#                                   "cached" and exits 0 when LIBRARY and the
#                                   marker are installed, or when there is no
#                                   tarball but an earlier build is; exits 3
#                                   with a one-line reason when there is none
#   vendored_built EXTDIR NAME      drop the markers of other versions (one
#                                   would make an older tarball look built)
#                                   and write this one's

vendored_apt() {
	local say=$1 p
	shift
	local -a need=()
	for p in "$@"; do
		dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || need+=("$p")
	done
	((${#need[@]})) || return 0
	"$say" "apt-get install ${need[*]}"
	DEBIAN_FRONTEND=noninteractive apt-get update -qq
	DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
}

vendored_select() {
	local name=$1 label=$2 pattern=$3 library=$4 pkglibdir=$5 extdir=$6 base
	VENDORED_TARBALL=$(compgen -G "$pattern" | sort -V | tail -n1) || true
	if [[ -z $VENDORED_TARBALL ]]; then
		# A build installed by an earlier run still serves without its source.
		if [[ -f $pkglibdir/$library ]] && compgen -G "$extdir/.$name-*-built" >/dev/null; then
			echo "cached"
			exit 0
		fi
		echo "$label tests skipped: no $label source tarball matches $pattern"
		exit 3
	fi
	base=$(basename "$VENDORED_TARBALL")
	base=${base#"$name"-}
	base=${base%.tar.gz}
	VENDORED_VERSION=${base%.tgz}
	VENDORED_MARKER=$extdir/.$name-$VENDORED_VERSION-built
	if [[ -f $pkglibdir/$library && -f $VENDORED_MARKER ]]; then
		echo "cached"
		exit 0
	fi
}

vendored_built() {
	local extdir=$1 name=$2
	rm -f "$extdir/.$name-"*-built
	touch "$extdir/.$name-$VENDORED_VERSION-built"
}
