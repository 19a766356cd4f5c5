
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

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_sql_edition(
	"tests the background worker's sweep_interval and sweep_batch on reload; the SQL edition has no worker");
use Time::HiRes qw(usleep);

my $node = new_node('interval', port => 55445,
	conf => ["idempotency.sweep_interval = '1h'"]);

sub sql { return $node->safe_psql('postgres', $_[0]); }

# Claim (with a short lease) and finish a key kept for $retention.
sub finished_key
{
	my ($key, $retention) = @_;
	my $c = finish_key($node, 'postgres', $key, $retention, qq{'{"key": "$key"}'});
	is($c->{outcome}, 'claimed', "$key claimed");
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
	alter_system($node, 'idempotency.sweep_interval', $value);
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
is( sqlstate_of($node, 'postgres', "SET idempotency.sweep_interval = '1s'"),
	'55P02', 'sweep_interval cannot be SET in a session');
is( sqlstate_of($node, 'postgres', "ALTER SYSTEM SET idempotency.sweep_interval = '-1'"),
	'22023', 'a negative sweep_interval is refused');

sql('CREATE EXTENSION idempotency');
is( sql("SELECT count(*) FROM pg_stat_activity "
		  . "WHERE backend_type = 'idempotency launcher'"),
	'1', 'the launcher runs');

# --- One hour between rounds: nothing is swept for now ---

# The launcher makes its first round at start-up and then naps for the
# hour (wait event Extension, which it never shows during a round).  Once
# it naps, the key below cannot be swept before the next round, an hour
# from now.
ok( $node->poll_query_until(
		'postgres',
		"SELECT count(*) FILTER (WHERE backend_type = 'idempotency launcher' "
		  . "AND wait_event = 'Extension') = 1 "
		  . "AND count(*) FILTER (WHERE backend_type = 'idempotency sweeper') = 0 "
		  . "FROM pg_stat_activity"),
	'the launcher has made its first round and naps');
finished_key('k-hour', '1 second');
ok(wait_past_retention($node, 'postgres', 'k-hour'), 'k-hour is past its retention');
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

# stop_sweeping returns once a round that was under way when the signal
# came has ended and no new one can start.
stop_sweeping($node);
is(sql('SHOW idempotency.sweep_interval'), '0', 'sweep_interval is now 0');
my $stopped_at = last_sweep();
finished_key('k-off', '1 second');
ok(wait_past_retention($node, 'postgres', 'k-off'), 'k-off is past its retention');
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

alter_system($node, 'idempotency.sweep_batch', 7);
ok($node->poll_query_until('postgres', 'SHOW idempotency.sweep_batch', '7'),
	'sweep_batch is now 7');
# The stats are reset before the keys exist: the worker may sweep them as
# soon as they are past retention, a second after they are made.
sql('SELECT idempotency.stats_reset()');
is(expiring_keys($node, 'postgres', 'b', 50),
	'50', '50 keys claimed and finished in one statement');
ok( $node->poll_query_until(
		'postgres',
		"SELECT count(*) = 0 FROM idempotency.keys WHERE key LIKE 'b-%'"),
	'all 50 keys are swept, in batches of 7');
is( sql("SELECT expired FROM idempotency.stats WHERE database = 'postgres'"),
	'50', 'the stats count exactly 50 expired keys');
is(sql("SELECT count(*) FROM idempotency.keys"), '1',
	'only p-off remains');

# Nothing failed along the way.
is(log_errors($node), '', 'no error or failure in the log but the test\'s own');

$node->stop;
done_testing();
