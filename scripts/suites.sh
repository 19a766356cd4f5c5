# shellcheck shell=bash
# scripts/suites.sh: the test suites behind `./run test`, and their tally.
# Source it from bash after scripts/cluster.sh and scripts/setup.sh; it
# defines functions only.
#
# Every suite runs in a copy of the tree <src> that the postgres OS user owns,
# prints all of its runner's output, and records each test as passed or failed:
# one pg_regress test, one isolation spec, one pgTAP file, one TAP file or one
# example suite is one test. A test that never ran (build failed, runner died,
# timeout) counts as failed.
#
# Functions:
#   suite_regress <src> <cluster> <test...>     pg_regress (make installcheck)
#   suite_isolation <src> <cluster> <spec...>   pg_isolation_regress (ditto)
#   suite_pgtap <src> <cluster> <file...>       pg_prove, a fresh database each
#   suite_tap <src> <file...>                   prove, as the postgres user
#   suite_pipeline <src> <file...>              test/pipeline/*.sh: the test
#                                               pipeline's own scripts, as root
#   suite_examples <src> <cluster> <dir...>     clients/*/ and examples/*/:
#                                               test.sh or npm test
#   suite_example_dirs <src>                    print the client libraries and
#                                               examples that have a test
#   test_pass <name> / test_fail <name> [why]   record a result (its name
#                                               prefixed with $TEST_PREFIX)
#   test_summary                                failed names, then the closing
#                                               line "N passed, N failed"
#   time_record <name> <start>                  note how long <name> took since
#                                               <start> (a $SECONDS value)
#   time_table                                  the recorded times, longest first
#   suite_conf_load <src>                       set SUITE_CONF to the lines of
#                                               <src>/test/test.conf: the
#                                               settings of every test server
#
# Settings (environment): SUITE_TIMEOUT (seconds, each make installcheck,
# default 1200), FILE_TIMEOUT (seconds, each pgTAP/TAP file or example,
# default 900), SUITE_JOBS (TAP files run at a time, default 3).

: "${SUITE_TIMEOUT:=1200}"
: "${FILE_TIMEOUT:=900}"
: "${SUITE_JOBS:=3}"

TEST_PASSED=()
TEST_FAILED=()
TEST_PREFIX=""  # e.g. "pg17/": which PostgreSQL the tests being run are for
SUITE_RUNNABLE=()
TIME_ROWS=()  # "seconds<TAB>name" per suite, for time_table
SUITE_CONF=() # postgresql.conf lines of every test server (suite_conf_load)

# Set SUITE_CONF from <src>/test/test.conf, leaving out comments and blanks.
suite_conf_load() {
	mapfile -t SUITE_CONF < <(grep -Ev '^[[:space:]]*(#|$)' "$1/test/test.conf")
	((${#SUITE_CONF[@]})) || { echo "suites.sh: no settings in $1/test/test.conf" >&2; return 1; }
}

# Record that <name> (prefixed with $TEST_PREFIX) ran from <start> until now.
time_record() {
	TIME_ROWS+=("$((SECONDS - $2))	$TEST_PREFIX$1")
}

# Print the recorded times, longest first, and their sum: where a run's
# time goes.
time_table() {
	((${#TIME_ROWS[@]})) || return 0
	echo
	echo "== time per suite (seconds, longest first)"
	printf '%s\n' "${TIME_ROWS[@]}" | sort -t $'\t' -k1,1nr |
		awk -F '\t' '{ printf "%6d  %s\n", $1, $2; sum += $1 } END { printf "%6d  (sum of the rows)\n", sum }'
}

# Record test <name> as passed.
test_pass() {
	TEST_PASSED+=("$TEST_PREFIX$1")
	echo "-- PASS $TEST_PREFIX$1"
}

# Record test <name> as failed, with an optional reason.
test_fail() {
	TEST_FAILED+=("$TEST_PREFIX$1${2:+ ($2)}")
	echo "-- FAIL $TEST_PREFIX$1${2:+ ($2)}"
}

# Print the failed tests, then the closing line; return 1 if anything failed.
test_summary() {
	local name
	echo
	echo "== summary"
	for name in "${TEST_FAILED[@]}"; do
		echo "FAILED: $name"
	done
	echo "${#TEST_PASSED[@]} passed, ${#TEST_FAILED[@]} failed"
	((${#TEST_FAILED[@]} == 0))
}

# Run a command (as postgres with --as-postgres) with a time limit, showing its
# output and saving it in <log>.
suite_run() {
	local log=$1 secs=$2 rc=0
	local -a user=()
	shift 2
	if [[ $1 == --as-postgres ]]; then
		user=(as_postgres)
		shift
	fi
	"${user[@]}" timeout -k 30 "$secs" "$@" 2>&1 | tee "$log" || rc=$?
	if ((rc == 124 || rc == 137)); then
		echo "-- timed out after ${secs}s: $*" | tee -a "$log"
	fi
	return "$rc"
}

# Environment for commands run as postgres: PATH with PostgreSQL's bin first.
suite_env() {
	echo "PATH=$PG_BIN:$PATH"
	echo "HOME=$(getent passwd "$PG_OS_USER" | cut -d: -f6)"
	echo "LANG=C.UTF-8"
	echo "NPM_CONFIG_UPDATE_NOTIFIER=false"
}

# Print "name status" for every test pg_regress reported in <log> (status
# "ok" or another word): "test name ... ok" up to PostgreSQL 15, "ok 1 - name
# 12 ms" (TAP) from 16.
suite_pg_regress_statuses() {
	awk '/^(test |     )/ {
			for (i = 2; i < NF; i++) if ($i == "...") { print $(i - 1), $(i + 1); break }
		}
		/^(not )?ok [0-9]+ +[-+] / {
			st = ($1 == "not") ? "failed" : "ok"
			for (i = 2; i < NF; i++) if ($i == "-" || $i == "+") { print $(i + 1), st; break }
		}' "$1"
}

# Record each of <names> from pg_regress output <log>: "ok" passes, else fails.
suite_tally_pg_regress() {
	local log=$1 prefix=$2 name
	shift 2
	local -A status=()
	while read -r name st; do
		status[$name]=$st
	done < <(suite_pg_regress_statuses "$log")
	for name in "$@"; do
		case ${status[$name]:-} in
		ok) test_pass "$prefix/$name" ;;
		"") test_fail "$prefix/$name" "not run" ;;
		*) test_fail "$prefix/$name" ;;
		esac
	done
}

# Set SUITE_RUNNABLE to the tests among <names> that have expected/<name>.out
# (or a _N.out variant) and record the others as failed: pg_regress stops at
# the first test whose expected output is missing, hiding the rest's results.
suite_with_expected() {
	local src=$1 prefix=$2 name
	shift 2
	SUITE_RUNNABLE=()
	for name in "$@"; do
		if [[ -f $src/expected/$name.out ]] ||
			compgen -G "$src/expected/${name}_[0-9].out" >/dev/null; then
			SUITE_RUNNABLE+=("$name")
		else
			test_fail "$prefix/$name" "no expected/$name.out"
		fi
	done
}

# make installcheck for one kind of test in <src>, as postgres, against <cluster>.
suite_installcheck() {
	local src=$1 cluster=$2 log=$3
	shift 3
	local -a env
	mapfile -t env < <(suite_env)
	(cd "$src" && suite_run "$log" "$SUITE_TIMEOUT" --as-postgres env "${env[@]}" \
		PGHOST="$(cluster_host "$cluster")" PGPORT="$(cluster_port "$cluster")" \
		PGUSER=postgres make --no-print-directory PG_CONFIG="$PG_CONFIG" \
		"${SETUP_MAKE_FLAGS[@]}" TAP_TESTS= PROVE_TESTS= installcheck "$@")
}

# pg_regress: every sql/*.sql test of the Makefile's REGRESS list.
suite_regress() {
	local src=$1 cluster=$2 rc=0
	shift 2
	(($#)) || return 0
	echo
	local started=$SECONDS
	echo "== pg_regress: $# tests (make installcheck ISOLATION=)"
	rm -f "$src/regression.diffs"
	suite_with_expected "$src" regress "$@"
	local -a runnable=("${SUITE_RUNNABLE[@]}")
	if ((${#runnable[@]})); then
		suite_installcheck "$src" "$cluster" "$src/.regress.log" ISOLATION= \
			REGRESS="${runnable[*]}" || rc=$?
		suite_tally_pg_regress "$src/.regress.log" regress "${runnable[@]}"
	fi
	if [[ -s $src/regression.diffs ]]; then
		echo "== regression.diffs"
		cat "$src/regression.diffs"
	fi
	if ((rc != 0)); then
		echo "-- make installcheck (pg_regress) exited with status $rc"
	fi
	time_record regress "$started"
}

# Isolation: every specs/*.spec of the Makefile's ISOLATION list.
suite_isolation() {
	local src=$1 cluster=$2 rc=0
	shift 2
	(($#)) || return 0
	echo
	local started=$SECONDS
	echo "== isolation: $# specs (make installcheck REGRESS=)"
	rm -f "$src/output_iso/regression.diffs"
	suite_with_expected "$src" isolation "$@"
	local -a runnable=("${SUITE_RUNNABLE[@]}")
	if ((${#runnable[@]})); then
		suite_installcheck "$src" "$cluster" "$src/.isolation.log" REGRESS= \
			ISOLATION="${runnable[*]}" || rc=$?
		suite_tally_pg_regress "$src/.isolation.log" isolation "${runnable[@]}"
	fi
	if [[ -s $src/output_iso/regression.diffs ]]; then
		echo "== output_iso/regression.diffs"
		cat "$src/output_iso/regression.diffs"
	fi
	if ((rc != 0)); then
		echo "-- make installcheck (isolation) exited with status $rc"
	fi
	time_record isolation "$started"
}

# pgTAP: each test/pgtap/*.sql through pg_prove, in a fresh database with the extension.
suite_pgtap() {
	local src=$1 cluster=$2 file db n=0
	shift 2
	(($#)) || return 0
	echo
	local started=$SECONDS
	echo "== pgTAP: $# files (pg_prove, one fresh database each)"
	for file in "$@"; do
		n=$((n + 1))
		db="pgtap_$n"
		# pgTAP itself is created for the file unless the file creates it.
		local -a exts=(idempotency)
		grep -qiE 'create[[:space:]]+extension.*pgtap' "$src/$file" || exts+=(pgtap)
		if ! cluster_createdb "$cluster" "$db" "${exts[@]}"; then
			test_fail "pgtap/$file" "could not create database $db"
			continue
		fi
		if (cd "$src" && suite_run "$src/.pgtap_$n.log" "$FILE_TIMEOUT" \
			env PATH="$PG_BIN:$PATH" pg_prove --psql-bin "$PG_BIN/psql" \
			-h "$(cluster_host "$cluster")" -p "$(cluster_port "$cluster")" \
			-U postgres -d "$db" --failures --comments "$file"); then
			test_pass "pgtap/$file"
		else
			test_fail "pgtap/$file"
		fi
	done
	time_record pgtap "$started"
}

# TAP: each t/*.pl through prove, as postgres, with PostgreSQL::Test::* set
# up, SUITE_JOBS files at a time.  Each file starts servers of its own (its
# own data and socket directories), and most of a file's time is spent
# waiting for a lease, a sweep or a restart, so files overlap well.  A
# file's output is printed whole when it ends, so outputs never interleave.
suite_tap() {
	local src=$1 file pgxs i n
	shift
	n=$#
	((n)) || return 0
	pgxs="$("$PG_CONFIG" --pkglibdir)/pgxs"
	echo
	echo "== TAP: $n files (prove, as $PG_OS_USER, $SUITE_JOBS at a time)"
	rm -rf "$src/tmp_check" "$src/log" "$src"/.tap_*
	local -a env files=("$@") done=() pids=()
	mapfile -t env < <(suite_env)
	for ((i = 0; i < n; i++)); do
		# Only this pool's own jobs count and are waited for: the shell may
		# run others (the background build of later PostgreSQL versions).
		# wait names every pid of the pool, also those reaped by an earlier
		# wait, of which it would complain "no such job": only its own noise
		# is dropped.
		while (($(suite_running pids) >= SUITE_JOBS)); do
			wait -n "${pids[@]}" 2>/dev/null || true
			suite_tap_report "$src" files done
		done
		file=${files[i]}
		(
			started=$SECONDS
			rc=0
			cd "$src" && as_postgres timeout -k 30 "$FILE_TIMEOUT" env "${env[@]}" \
				PERL5LIB="$pgxs/src/test/perl${PERL5LIB:+:$PERL5LIB}" \
				TESTDIR="$src" PG_REGRESS="$pgxs/src/test/regress/pg_regress" \
				prove --failures "$file" >"$src/.tap_$i.log" 2>&1 || rc=$?
			if ((rc == 124 || rc == 137)); then
				echo "-- timed out after ${FILE_TIMEOUT}s: prove $file" >>"$src/.tap_$i.log"
			fi
			# written whole, then renamed: the pool reads a .rc file as soon
			# as it exists, and must never find it empty
			echo "$rc $((SECONDS - started))" >"$src/.tap_$i.rc.part" &&
				mv "$src/.tap_$i.rc.part" "$src/.tap_$i.rc"
		) &
		pids+=($!)
	done
	wait "${pids[@]}" 2>/dev/null || true
	suite_tap_report "$src" files done
}

# Print how many of the pids in the array named <pids> still run.
suite_running() {
	local -n _pids=$1
	local pid count=0
	for pid in "${_pids[@]}"; do
		kill -0 "$pid" 2>/dev/null && count=$((count + 1))
	done
	echo "$count"
}

# Print and record every TAP file of <files> (an array name) that has ended
# and is not yet in <done> (an array name of indexes already reported).
suite_tap_report() {
	local src=$1 i rc secs file base log
	local -n _files=$2 _done=$3
	for i in "${!_files[@]}"; do
		[[ -f $src/.tap_$i.rc && " ${_done[*]} " != *" $i "* ]] || continue
		_done+=("$i")
		file=${_files[i]}
		read -r rc secs <"$src/.tap_$i.rc"
		echo
		echo "== prove $file"
		cat "$src/.tap_$i.log"
		if ((rc == 0)); then
			test_pass "tap/$file"
		else
			test_fail "tap/$file"
			base=$(basename "$file" .pl)
			# PostgreSQL 17 and later keep the TAP logs in log/, older ones in tmp_check/log/
			for log in "$src/tmp_check/log/regress_log_$base" "$src/log/regress_log_$base"; do
				if [[ -f $log ]]; then
					echo "== last lines of ${log#"$src"/}"
					tail -n 60 "$log"
				fi
			done
		fi
		TIME_ROWS+=("$secs	${TEST_PREFIX}tap/$file")
	done
}

# The pipeline's own tests: each test/pipeline/*.sh, run as root from
# <src> (they check the scripts that set up the test servers, and start none).
suite_pipeline() {
	local src=$1 file started
	shift
	(($#)) || return 0
	echo
	echo "== pipeline: $# scripts"
	for file in "$@"; do
		started=$SECONDS
		if (cd "$src" && suite_run "$src/.pipeline.log" "$FILE_TIMEOUT" "./$file"); then
			test_pass "$file"
		else
			test_fail "$file"
		fi
		time_record "$file" "$started"
	done
}

# Print each examples/<name> (relative to <src>) that has a test entry point.
suite_example_dirs() {
	local src=$1 dir
	for dir in "$src"/clients/*/ "$src"/examples/*/; do
		[[ -d $dir ]] || continue
		dir=${dir%/}
		if [[ -x $dir/test.sh ]] ||
			{ [[ -f $dir/package.json ]] && grep -q '"test"[[:space:]]*:' "$dir/package.json"; }; then
			echo "${dir#"$src"/}"
		fi
	done
}

# Client libraries and examples: per directory, a fresh database; test.sh,
# else npm ci + npm test.  With SUITE_PGBOUNCER_PORT set, the suites also
# get IDEM_PGBOUNCER_PORT: a PgBouncer in transaction pooling mode on that
# port, in the same socket directory as the cluster.
suite_examples() {
	local src=$1 cluster=$2 ex name db
	shift 2
	(($#)) || return 0
	echo
	echo "== examples: $# suites"
	local -a env
	mapfile -t env < <(suite_env)
	for ex in "$@"; do
		local started=$SECONDS
		name=${ex##*/}
		db="example_${name//[^A-Za-z0-9_]/_}"
		echo
		echo "== $ex (database $db)"
		if ! cluster_createdb "$cluster" "$db" idempotency; then
			test_fail "$ex" "could not create database $db"
			continue
		fi
		local -a cmd
		if [[ -x $src/$ex/test.sh ]]; then
			cmd=(./test.sh)
		else
			cmd=(sh -c 'if [ -f package-lock.json ]; then npm ci --no-audit --no-fund;
				else npm install --no-audit --no-fund; fi && npm test')
		fi
		if (cd "$src/$ex" && suite_run "$src/.example_$name.log" "$FILE_TIMEOUT" \
			--as-postgres env "${env[@]}" PGHOST="$(cluster_host "$cluster")" \
			PGPORT="$(cluster_port "$cluster")" PGUSER=postgres PGDATABASE="$db" \
			${SUITE_PGBOUNCER_PORT:+IDEM_PGBOUNCER_PORT="$SUITE_PGBOUNCER_PORT"} \
			"${cmd[@]}"); then
			test_pass "$ex"
		else
			test_fail "$ex"
		fi
		time_record "$ex" "$started"
	done
}
