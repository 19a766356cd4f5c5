#!/usr/bin/env bash
# scripts/dist.sh [OUTDIR]: build the PGXN release zip, idempotency-VERSION.zip
# (VERSION from META.json), in OUTDIR (default: the tree's root). `make dist`
# calls it.
#
# The zip holds the files of the working tree under one top directory,
# idempotency-VERSION/, as PGXN requires: in a git checkout the files git
# tracks (as they are on disk, so a release is made from a clean checkout of
# its tag), elsewhere (an unpacked release, a copy without .git) every file
# but build and test output. META.json is checked first (scripts/check-meta.py
# --tree): a release whose files disagree about its version is not made.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(cd "${1:-$root}" && pwd)

"$root/scripts/check-meta.py" --tree "$root" "$root/META.json" >/dev/null || {
	"$root/scripts/check-meta.py" --tree "$root" "$root/META.json" >&2
	echo "dist: META.json and the tree disagree; no zip made" >&2
	exit 1
}
version=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["version"])' \
	"$root/META.json")
name=idempotency-$version
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT

# The distribution's files, NUL-separated, relative to the root.
dist_files() {
	# only a checkout of this project: a tree copied into another project's
	# work tree is not one
	if [[ $(git -C "$root" rev-parse --show-toplevel 2>/dev/null) == "$root" ]]; then
		# tracked files still on disk (a file deleted but not yet committed is left out)
		git -C "$root" ls-files -z | while IFS= read -r -d '' f; do
			[[ -e $root/$f ]] && printf '%s\0' "$f"
		done
	else
		(cd "$root" && find . -type f \
			-not -path './.git/*' -not -path '*/node_modules/*' \
			-not -path './results/*' -not -path './output_iso/*' \
			-not -path './tmp_check/*' -not -path './log/*' -not -path './bench/out/*' \
			-not -path '*/__pycache__/*' -not -name '*.o' -not -name '*.so' \
			-not -name '*.bc' -not -name 'regression.diffs' -not -name 'regression.out' \
			-not -name 'idempotency-*.zip' -print0 | sed -z 's|^\./||')
	fi
}

mkdir "$stage/$name"
dist_files | tar -C "$root" --null -T - -cf - | tar -C "$stage/$name" -xf -
rm -f "$out/$name.zip"
# -X: no extra file attributes (uid/gid), so the zip depends on the files only
(cd "$stage" && zip -q -r -X "$out/$name.zip" "$name")
echo "$out/$name.zip"
