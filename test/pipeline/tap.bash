# shellcheck shell=bash
# test/pipeline/tap.bash: the TAP helper of the pipeline's tests (sourced).
n=0 failed=0
# ok <status> <description> [details]: one TAP line; details of a failure
# follow as comments.
ok() {
	n=$((n + 1))
	if [[ $1 == 0 ]]; then
		echo "ok $n - $2"
	else
		echo "not ok $n - $2"
		failed=$((failed + 1))
		[[ -n ${3:-} ]] && sed 's/^/#   /' <<<"$3"
	fi
}
