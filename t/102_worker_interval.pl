
# Copyright: the idempotency extension authors.
#
# 102_worker_interval.pl: idempotency.sweep_interval is a sighup setting the
# worker rereads on reload.  A server started with a one-hour interval does
# not sweep a key past its retention until the interval is shortened with
# pg_reload_conf(); sweep_interval = 0 stops sweeping (a key past its
# retention stays, and no sweep is recorded, over many of the former
# intervals); setting it back resumes sweeping.  sweep_batch is reread too:
# a backlog larger than a batch is swept completely.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).
# Negative checks ("nothing is swept while it is off") leave the worker a
# few seconds, many times its interval, to do the wrong thing; positive ones
# poll.  No assertion depends on timing.

use strict;
use warnings FATAL => 'all';

use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;
use Time::HiRes qw(usleep);

my $node = PostgreSQL::Test::Cluster->new('interval', port => 55445);
$node->init;
$node->append_conf('postgresql.conf', <<'EOF');
shared_preload_libraries = 'idempotency'
idempotency.sweep_interval = '1h'
EOF
$node->start;

sub sql
{
	my ($sql) = @_;
	return $node->safe_psql('postgres', $sql);
}

sub sqlstate_of
{
	my ($cmd) = @_;
	my ($ret, $out, $err) =
	  $node->psql('postgres', "\\set VERBOSITY verbose\n$cmd;");
	return '00000' if $ret == 0 && $err !~ /ERROR/;
	return $1 if $err =~ /ERROR:\s+([0-9A-Z]{5}):/;
	return "no SQLSTATE (ret $ret): $err";
}

# Claim (with a short lease) and finish a key kept for $retention.
sub finished_key
{
	my ($key, $retention) = @_;
	my ($o, $t) = split /\|/,
	  sql("SELECT outcome, token FROM idempotency.idem_claim('$key', "
		  . "lease => '1 second', retention => '$retention')");
	is($o, 'claimed', "$key claimed");
	sql("SELECT idempotency.idem_finish('$key', $t, 200, '{\"key\": \"$key\"}')");
}

sub wait_past_retention
{
	my ($key) = @_;
	ok( $node->poll_query_until(
			'postgres',
			"SELECT expires_at < clock_timestamp() FROM idempotency.keys "
			  . "WHERE key = '$key'"),
		"$key is past its retention");
}

sub key_count
{
	my ($key) = @_;
	return sql("SELECT count(*) FROM idempotency.keys WHERE key = '$key'");
}

sub last_sweep
{
	return sql("SELECT coalesce(last_sweep_at::text, 'never') "
		  . "FROM idempotency.stats WHERE database = 'postgres'");
}

sub set_interval
{
	my ($value) = @_;
	sql("ALTER SYSTEM SET idempotency.sweep_interval = '$value'");
	sql('SELECT pg_reload_conf()');
	ok( $node->poll_query_until('postgres',
			'SHOW idempotency.sweep_interval', $value),
		"sweep_interval is now $value");
}

# --- The setting itself ---

is( sql("SELECT boot_val, unit, context FROM pg_settings "
		  . "WHERE name = 'idempotency.sweep_interval'"),
	'60000|ms|sighup',
	'sweep_interval: default 60000 ms, sighup');
is(sql('SHOW idempotency.sweep_interval'), '1h', 'the server runs with 1h');
is( sqlstate_of("SET idempotency.sweep_interval = '1s'"),
	'55P02', 'sweep_interval cannot be SET in a session');
is( sqlstate_of("ALTER SYSTEM SET idempotency.sweep_interval = '-1'"),
	'22023', 'a negative sweep_interval is refused');

sql('CREATE EXTENSION idempotency');
is( sql("SELECT count(*) FROM pg_stat_activity "
		  . "WHERE backend_type = 'idempotency launcher'"),
	'1', 'the launcher runs');

# --- One hour between rounds: nothing is swept for now ---

# The launcher's first round ran at start-up, before this key existed.
finished_key('k-hour', '1 second');
wait_past_retention('k-hour');
# ('never', unless the first round came after CREATE EXTENSION.)
my $first = last_sweep();
sleep(3);
is(key_count('k-hour'), '1', 'with a 1h interval the key is still there');
is(last_sweep(), $first, 'and no further sweep of postgres is recorded');

# --- Shortened with a reload: the launcher wakes up and sweeps ---

set_interval('200ms');
ok( $node->poll_query_until(
		'postgres', "SELECT count(*) = 0 FROM idempotency.keys"),
	'after reload to 200ms the key is swept');
isnt(last_sweep(), $first, 'a new sweep is recorded');

# And it keeps sweeping at the new interval.
finished_key('k-short', '1 second');
ok( $node->poll_query_until(
		'postgres', "SELECT count(*) = 0 FROM idempotency.keys"),
	'the next key past retention is swept too');

# --- Zero: sweeping stops ---

set_interval('0');
# Let a round that was under way when the signal came end.
sleep(1);
my $stopped_at = last_sweep();
finished_key('k-off', '1 second');
wait_past_retention('k-off');
# 3 seconds: fifteen of the former intervals.
sleep(3);
is(key_count('k-off'), '1', 'with sweep_interval = 0 the key stays');
is(last_sweep(), $stopped_at, 'and no sweep happens at all');
is( sql("SELECT count(*) FROM pg_stat_activity "
		  . "WHERE backend_type IN ('idempotency launcher', 'idempotency sweeper')"),
	'1', 'the launcher is still there, and no sweeper');
# A reset pending key is no different.
my ($o, $t) = split /\|/,
  sql("SELECT outcome, token FROM idempotency.idem_claim('p-off', "
	  . "lease => '1 second', retention => '1 day')");
is($o, 'claimed', 'p-off claimed with a 1 second lease');
ok( $node->poll_query_until(
		'postgres',
		"SELECT lease_until < clock_timestamp() FROM idempotency.keys "
		  . "WHERE key = 'p-off'"),
	'the lease of p-off ended');
sleep(2);
is( sql("SELECT token FROM idempotency.keys WHERE key = 'p-off'"),
	$t, 'with sweeping off the stale pending key keeps its token');

# --- Back on: both are swept ---

set_interval('200ms');
ok( $node->poll_query_until(
		'postgres',
		"SELECT count(*) FILTER (WHERE key = 'k-off') = 0 "
		  . "AND bool_and(token IS NULL) FILTER (WHERE key = 'p-off') "
		  . "FROM idempotency.keys"),
	'sweep_interval back to 200ms: k-off expired and p-off reset');
isnt(last_sweep(), $stopped_at, 'a new sweep is recorded');

# --- sweep_batch is reread as well: a backlog of several batches ---

sql("ALTER SYSTEM SET idempotency.sweep_batch = 7");
sql('SELECT pg_reload_conf()');
ok($node->poll_query_until('postgres', 'SHOW idempotency.sweep_batch', '7'),
	'sweep_batch is now 7');
is( sql("SELECT count(*) FROM ("
		  . "SELECT idempotency.idem_finish('b-' || i, c.token, 200) "
		  . "FROM generate_series(1, 50) AS i, "
		  . "LATERAL idempotency.idem_claim('b-' || i, "
		  . "lease => '1 second', retention => '1 second') AS c) AS f"),
	'50', '50 keys claimed and finished in one statement');
sql('SELECT idempotency.stats_reset()');
ok( $node->poll_query_until(
		'postgres',
		"SELECT count(*) = 0 FROM idempotency.keys WHERE key LIKE 'b-%'"),
	'all 50 keys are swept, in batches of 7');
is( sql("SELECT expired FROM idempotency.stats WHERE database = 'postgres'"),
	'50', 'the stats count exactly 50 expired keys');
is(sql("SELECT count(*) FROM idempotency.keys"), '1',
	'only p-off remains');

# Nothing failed along the way.
my @bad = grep { !/102_worker_interval\.pl/ }
  grep { /ERROR|FATAL|PANIC|failed/ } split /\n/, slurp_file($node->logfile);
is(join("\n", @bad), '', 'no error or failure in the log but the test\'s own');

$node->stop;
done_testing();
