
# Copyright: the idempotency extension authors.
#
# 005_mixed_load.pl: a mixed concurrent load of claims, finishes, releases
# and sweeps, with the worker sweeping every second, must run without a
# single error, and leave the table and its indexes intact.
#
# pgbench runs 8 clients (simple protocol, every statement autocommit) on
# 2,000 hot keys.  Each transaction claims a random key (lease 20 s,
# retention 3 s; the request is a function of the key, so a claim never
# answers mismatch) and, if it got a token, draws what to do with it: finish
# (70%), release (10%), idem_sweep(50) (10%) or nothing (10%); in the last
# two cases the key stays pending, and claims answer in_progress until its
# lease ends.  So keys are claimed, finished, replayed, released, refused
# as in progress and swept away (past their retention, by the worker and by
# the clients' sweeps), all at once and on the same keys.  Since retention
# is shorter than the lease, a pending key is past its retention when its
# lease ends, and a sweep deletes it rather than resetting it: this load
# does not exercise reset.
#
# Every one of these calls is legal at any moment, so any ERROR is a bug.
# Races between a claim, its finish or release, and a sweep of the same key
# show up here as a duplicate-key error on keys_pkey (23505) from a claim,
# or as 55P03 ("another transaction is changing this key") from a finish or
# release.  Such races are rare: a short run that passes proves little, a
# failing one is always worth reading, and a change to the claim, finish,
# release or sweep paths deserves a long run by hand (below).
#
# Checked:
#  - pgbench exits 0, prints no error and no aborted client, and reports 0
#    failed transactions (in simple protocol mode an ERROR aborts its
#    client: pgbench does not count that as a failed transaction, but it
#    prints the error and exits 2);
#  - the server log has no ERROR, FATAL, PANIC or WARNING line and no
#    failed sweep from the start of the load to the end of the test,
#    neither from the clients (pgbench connects under its own application
#    name, so that log_errors does not take its lines for the test's own)
#    nor from the worker (which logs a failed sweep as a WARNING);
#  - enough work happened: a floor of transactions, and the stats counters
#    show claims, finishes, releases, replays and in_progress answers, no
#    mismatch, at least one claim per transaction and at most one finish or
#    release per claim; once the load is over, the worker deletes keys past
#    their retention (expired > 0, polled for: every finished key is past
#    retention 3 s after the load);
#  - the stored rows: statuses are pending, succeeded or failed; every
#    pending row with a token has a lease_until, no finished row has one;
#    tokens are unique; attempt >= 1; no key is stored twice (read by a
#    sequential scan, not through the primary key);
#  - amcheck: bt_index_check and bt_index_parent_check (heapallindexed) on
#    every index of idempotency.keys, and verify_heapam finds nothing.
#
# Duration: 30 seconds of load by default (the whole file takes about 35
# seconds on an idle machine).  IDEM_MIXED_LOAD_SECONDS sets it (whole
# seconds, at least 10), e.g. for a 10-minute run by hand:
#
#   IDEM_MIXED_LOAD_SECONDS=600 prove -v t/005_mixed_load.pl
#
# with the environment described at the top of t/001_restart.pl.  pgbench
# prints its progress every 10 seconds into the test's log
# (tmp_check/log/regress_log_005_mixed_load).

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use IPC::Run;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $seconds = $ENV{IDEM_MIXED_LOAD_SECONDS} || 30;
die "IDEM_MIXED_LOAD_SECONDS must be a whole number of seconds, at least 10\n"
  unless $seconds =~ /^\d+$/ && $seconds >= 10;

# Even a slow machine does far more than this in 10 seconds; at this many
# transactions on 2,000 keys, replays and in_progress answers are certain
# (each needs a key drawn again within 3 s of its finish, or within 20 s of
# a claim left pending, and hundreds of keys offer that chance).
my $min_transactions = 1000;

# Statements are not logged (the TAP default logs them all): at thousands a
# second they would fill the disk on a long run and slow the load down.
# Errors are still logged, each with its statement.
my $node = new_node('mixed', port => 55450,
	conf => ["idempotency.sweep_interval = '1s'", 'log_statement = none']);
install_extension($node, 'postgres');
$node->safe_psql('postgres', 'CREATE EXTENSION amcheck');

sub sql { return $node->safe_psql('postgres', $_[0]); }

my $script = <<'EOF';
\set k random(1, 2000)
\set p random(1, 100)
SELECT coalesce(token, 0) AS tok FROM idempotency.idem_claim('am-' || :k, jsonb_build_object('k', :k), lease => '20 seconds', retention => '3 seconds') \gset
\if :tok > 0
\if :p <= 70
SELECT idempotency.idem_finish('am-' || :k, :tok, 200, jsonb_build_object('k', :k, 'ok', true));
\elif :p <= 80
SELECT idempotency.idem_release('am-' || :k, :tok);
\elif :p <= 90
SELECT * FROM idempotency.idem_sweep(50);
\endif
\endif
EOF
my $script_file = PostgreSQL::Test::Utils::tempdir() . '/mixed_load.sql';
append_to_file($script_file, $script);

# --- the load -----------------------------------------------------------------

my $log_offset = -s $node->logfile;

my @cmd = (
	$node->installed_command('pgbench'),
	'--no-vacuum', '--protocol=simple', '--client=8', '--jobs=2',
	"--time=$seconds", '--progress=10', "--file=$script_file",
	'--host=' . $node->host, '--port=' . $node->port, 'postgres');
note "running: @cmd";

my ($stdout, $stderr) = ('', '');
my $ret;
{
	# pgbench's connections must not look like the test's own in the log.
	local $ENV{PGAPPNAME} = 'mixed_load_pgbench';
	# A statement that hangs keeps pgbench from ending: give up well after
	# the load should have ended.
	my $ran = eval {
		IPC::Run::run(\@cmd, '>', \$stdout, '2>', \$stderr,
			IPC::Run::timeout($seconds + 180));
		1;
	};
	$ret = $ran ? $? >> 8 : "none: $@";
}
note "pgbench stdout:\n$stdout";
note "pgbench stderr:\n$stderr";

is($ret, 0, 'pgbench exits 0') or diag("pgbench stderr:\n$stderr");
is(join("\n", grep { /error|abort/i } split /\n/, "$stdout\n$stderr"), '',
	'pgbench prints no error and no aborted client');
like($stdout, qr/^number of failed transactions: 0 /m,
	'pgbench reports 0 failed transactions');
my ($transactions) =
  $stdout =~ /^number of transactions actually processed: (\d+)/m;
$transactions //= 0;
note "$transactions transactions in $seconds s";
cmp_ok($transactions, '>', $min_transactions,
	"over $min_transactions transactions were processed");

# --- what the load did, by the stats counters ---------------------------------

SKIP:
{
	skip 'SQL edition: the stats counters are NULL (they live in the C library\'s shared memory)', 8
	  if sql_edition();
	my ($claims, $replays, $in_progress, $mismatches, $finishes, $releases) =
	  split /\|/, sql(
		"SELECT claims, replays, in_progress, mismatches, finishes, releases "
		  . "FROM idempotency.stats WHERE database = current_database()");
	note "claims $claims, replays $replays, in_progress $in_progress, "
	  . "finishes $finishes, releases $releases";
	cmp_ok($claims,      '>', 0, 'claims answered claimed');
	cmp_ok($finishes,    '>', 0, 'claims were finished');
	cmp_ok($releases,    '>', 0, 'claims were released');
	cmp_ok($replays,     '>', 0, 'claims answered replay');
	cmp_ok($in_progress, '>', 0, 'claims answered in_progress');
	is($mismatches, '0',
		'no claim answered mismatch (a key\'s request never changes)');
	cmp_ok($claims + $replays + $in_progress, '>=', $transactions,
		'every transaction\'s claim is counted');
	cmp_ok($finishes + $releases, '<=', $claims,
		'at most one finish or release per claim');
}

# --- the stored rows ----------------------------------------------------------

is(sql("SELECT count(*) FROM idempotency.keys "
		. "WHERE status NOT IN ('pending', 'succeeded', 'failed')"),
	'0', 'every row is pending, succeeded or failed');
is(sql("SELECT count(*) FROM idempotency.keys "
		. "WHERE status = 'pending' AND token IS NOT NULL AND lease_until IS NULL"),
	'0', 'every pending row with a token has a lease_until');
is(sql("SELECT count(*) FROM idempotency.keys "
		. "WHERE status IN ('succeeded', 'failed') AND lease_until IS NOT NULL"),
	'0', 'no finished row has a lease_until');
is(sql("SELECT count(*) = count(DISTINCT token) FROM idempotency.keys "
		. "WHERE token IS NOT NULL"),
	't', 'tokens are unique');
is(sql("SELECT count(*) FROM idempotency.keys WHERE attempt < 1"),
	'0', 'every attempt is at least 1');
is(sql("SET enable_indexscan = off; SET enable_indexonlyscan = off; "
		. "SET enable_bitmapscan = off; "
		. "SELECT count(*) = count(DISTINCT (scope, key)) FROM idempotency.keys"),
	't', 'no key is stored twice (by a sequential scan)');

# --- sweeps after the load (the worker's, or the application's) -----------------

if (sql_edition())
{
	# No worker and no counters: the application's sweep, called here as
	# the clients called it during the load, deletes the keys that went past
	# their retention since.
	ok( $node->poll_query_until('postgres',
			"SELECT expired > 0 FROM idempotency.idem_sweep()"),
		'keys past their retention were deleted by sweeps (expired > 0)');
}
else
{
	ok( $node->poll_query_until('postgres',
			"SELECT expired > 0 FROM idempotency.stats "
			  . "WHERE database = current_database()"),
		'keys past their retention were deleted by sweeps (expired > 0)');
	note 'expired ' . sql("SELECT expired FROM idempotency.stats "
		  . "WHERE database = current_database()");
}

# --- amcheck ------------------------------------------------------------------

my $indexes = "SELECT c.oid, c.relname FROM pg_index i "
  . "JOIN pg_class c ON c.oid = i.indexrelid "
  . "WHERE i.indrelid = 'idempotency.keys'::regclass";
cmp_ok(sql("SELECT count(*) FROM ($indexes) s"), '>=', 2,
	'idempotency.keys has its indexes to check (primary key, sweep_at)');
for my $check ('bt_index_check', 'bt_index_parent_check')
{
	my ($state, $out, $err) = sql_result($node, 'postgres',
		"SELECT s.relname, $check(index => s.oid, heapallindexed => true) "
		  . "FROM ($indexes) s");
	is($state, '00000',
		"$check (heapallindexed) on every index of idempotency.keys")
	  or diag($err);
}
my ($state, $out, $err) = sql_result($node, 'postgres',
	"SELECT * FROM verify_heapam('idempotency.keys')");
is($state, '00000', 'verify_heapam on idempotency.keys runs') or diag($err);
is($out, '', 'verify_heapam finds nothing wrong in idempotency.keys');

# --- the server log -----------------------------------------------------------

# A failed sweep of the worker is logged as a WARNING (the sweeper's whole
# error) and a launcher line ending in "failed: ...".
is(log_errors($node, offset => $log_offset,
		pattern => qr/\b(?:ERROR|FATAL|PANIC|WARNING)\b|idempotency sweep of database .* failed/),
	'', 'no ERROR, FATAL, PANIC or WARNING, and no failed sweep, in the server log since the load began');

$node->stop;

done_testing();
