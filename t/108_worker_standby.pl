
# Copyright: the idempotency extension authors.
#
# 108_worker_standby.pl: the worker and streaming replication.
#  - the primary's sweeps replicate: a key the primary's worker expires
#    disappears on the standby;
#  - a hot standby (preloaded too) sweeps nothing while in recovery: with
#    the primary's sweeping off, a key past retention stays on the standby;
#    no sweeper runs there and its log stays free of errors; the stats view
#    and idem_lookup answer there, idem_claim raises 25006;
#  - once promoted, the former standby's worker sweeps that key.
#
# Run it like the other TAP tests (see the top of t/001_restart.pl).

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

skip_sql_edition(
	"tests the background worker on a primary, a hot standby and after promotion; the SQL edition has no worker (202_standby_failover covers its replicas)");

my $primary = new_node('primary', port => 55446, init => [ allows_streaming => 1 ],
	conf => ["idempotency.sweep_interval = '200ms'"], extension => 1);

# Keys present before the backup: one kept, one expiring soon.
finish_key($primary, 'postgres', 'kept', '1 day', q{'{"key": "kept"}'});

my $standby = new_standby($primary, 'standby', port => 55447);

sub on_standby
{
	my ($sql) = @_;
	return $standby->safe_psql('postgres', $sql);
}

is(on_standby('SELECT pg_is_in_recovery()'), 't', 'the standby is in recovery');

# --- The primary's sweeps replicate ---

# Sweeping is off until the key is seen on the standby: with its 1 second
# retention the worker could otherwise expire it before it got there.
stop_sweeping($primary);
finish_key($primary, 'postgres', 'swept-on-primary', '1 second',
	q{'{"key": "swept-on-primary"}'});
$primary->wait_for_catchup($standby);
is( on_standby("SELECT count(*) FROM idempotency.keys WHERE key = 'swept-on-primary'"),
	'1', 'the key reached the standby');
alter_system($primary, 'idempotency.sweep_interval', '200ms');
ok( $primary->poll_query_until(
		'postgres',
		"SELECT count(*) = 0 FROM idempotency.keys WHERE key = 'swept-on-primary'"),
	'the primary\'s worker expires it');
# The sweeper commits asynchronously (a lost sweep is redone), so its DELETE
# can be visible here before its WAL is written (and the primary's write
# position, which wait_for_catchup waits for, has not moved yet).  A
# checkpoint flushes all WAL before it.
$primary->safe_psql('postgres', 'CHECKPOINT');
$primary->wait_for_catchup($standby);
is( on_standby("SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys"),
	'kept', 'the deletion replicated: only kept remains on the standby');

# --- The standby sweeps nothing in recovery ---

stop_sweeping($primary);
finish_key($primary, 'postgres', 'held', '1 second', q{'{"key": "held"}'});
my ($o, $t) = split /\|/,
  $primary->safe_psql('postgres',
	"SELECT outcome, token FROM idempotency.idem_claim('stale', "
	  . "lease => '1 second', retention => '1 day')");
is($o, 'claimed', 'stale claimed on the primary with a 1 second lease');
$primary->wait_for_catchup($standby);
ok( $standby->poll_query_until(
		'postgres',
		"SELECT bool_and(expires_at < clock_timestamp()) FILTER (WHERE key = 'held') "
		  . "AND bool_and(lease_until < clock_timestamp()) FILTER (WHERE key = 'stale') "
		  . "FROM idempotency.keys"),
	'on the standby: held is past retention, stale past its lease');
sleep(2);
is( on_standby("SELECT string_agg(key || ':' || coalesce(token::text, '-'), ',' "
		  . "ORDER BY key) FROM idempotency.keys WHERE key IN ('held', 'stale')"),
	"held:" . $primary->safe_psql('postgres',
		"SELECT token FROM idempotency.keys WHERE key = 'held'")
	  . ",stale:$t",
	'in recovery nothing is swept: held stays, stale keeps its token');
is( on_standby("SELECT count(*) FROM pg_stat_activity "
		  . "WHERE backend_type = 'idempotency sweeper'"),
	'0', 'no sweeper runs on the standby');

# What works on a standby.
is(on_standby("SELECT status, response_code FROM idempotency.idem_lookup('kept')"),
	'succeeded|200', 'idem_lookup works on the standby');
is(on_standby("SELECT count(*) FROM idempotency.idem_lookup('held')"),
	'0', 'idem_lookup: a key past retention is absent');
is( on_standby("SELECT pending, succeeded, failed FROM idempotency.stats "
		  . "WHERE database = current_database()"),
	'1|1|0', 'the stats view works on the standby (held not counted)');
my ($st, $out, $err) =
  sql_result($standby, 'postgres', "SELECT * FROM idempotency.idem_claim('x')");
like($err, qr/ERROR:\s+25006/, 'idem_claim on the standby: 25006');
($st, $out, $err) =
  sql_result($standby, 'postgres', "SELECT * FROM idempotency.idem_sweep()");
like($err, qr/ERROR:\s+25006/, 'idem_sweep on the standby: 25006');

is(log_errors($standby), '', 'the standby\'s log has no error from the worker');

# --- Promoted: the worker sweeps ---

$primary->stop;
$standby->promote;
ok( $standby->poll_query_until('postgres', 'SELECT NOT pg_is_in_recovery()'),
	'the standby is promoted');
ok( $standby->poll_query_until(
		'postgres',
		"SELECT count(*) FILTER (WHERE key = 'held') = 0 "
		  . "AND bool_and(token IS NULL) FILTER (WHERE key = 'stale') "
		  . "FROM idempotency.keys"),
	'after promotion the worker expires held and resets stale');
is( on_standby("SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys"),
	'kept,stale', 'kept and stale remain');
is( on_standby("SELECT expired, reset, last_sweep_at IS NOT NULL FROM idempotency.stats "
		  . "WHERE database = current_database()"),
	'1|1|t', 'the promoted server\'s stats: 1 expired, 1 reset');
($o, $t, my $a) = split /\|/, on_standby(
	"SELECT outcome, token, attempt FROM idempotency.idem_claim('stale')");
is("$o|$a", 'claimed|2', 'the next claim of stale takes over as attempt 2');

$standby->stop;
done_testing();
