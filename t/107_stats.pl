
# Copyright: the idempotency extension authors.
#
# 107_stats.pl: the idempotency.stats view and idempotency.stats_reset().
#  - preloaded: after stats_reset() the counters move exactly with what
#    happens: claims (takeovers included), takeovers, replays, in_progress,
#    mismatches, finishes, releases, and the worker's expired and reset;
#    last_sweep_at/last_sweep_ms are set by the worker; key counts by status
#    come from the table (keys past retention excluded); counters are per
#    database; stats_reset() zeroes them all.
#  - stats_reset() is not granted to PUBLIC: a plain role gets 42501 (and
#    the counters stay), a role granted EXECUTE may reset; a plain role may
#    read the view.
#  - not preloaded (a second server): the view still answers, with NULL
#    counters and correct key counts; stats_reset() is a harmless no-op for
#    a superuser; no worker runs, idem_sweep() by hand does the work.
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
	"tests the stats counters, which live in the C library's shared memory (NULL in the SQL edition), and the worker's sweeps");

my $node = new_node('stats', port => 55444,
	conf => ["idempotency.sweep_interval = '200ms'"]);

my $counters =
  'claims, takeovers, replays, in_progress, mismatches, finishes, releases, '
  . 'expired, reset';

sub sql
{
	my ($sql, $db, $n) = @_;
	return ($n // $node)->safe_psql($db // 'postgres', $sql);
}

# Claim; returns "outcome|token|attempt" (without the NULL ones).
sub claim_line
{
	my ($args, $db, $n) = @_;
	my $c = claim($n // $node, $db // 'postgres', $args);
	return join('|', grep { defined } @$c{qw(outcome token attempt)});
}

sub outcome
{
	my ($args, $db) = @_;
	return (split /\|/, claim_line($args, $db))[0];
}

sub token
{
	my ($args, $db) = @_;
	my ($o, $t) = split /\|/, claim_line($args, $db);
	die "expected claimed, got $o" unless $o eq 'claimed';
	return $t;
}

sub counters_of
{
	my ($db) = @_;
	return sql("SELECT concat_ws(',', $counters) FROM idempotency.stats "
		  . "WHERE database = current_database()", $db);
}

sql('CREATE EXTENSION idempotency');
sql('CREATE DATABASE other');
sql('CREATE EXTENSION idempotency', 'other');
sql('CREATE ROLE app LOGIN');
sql('CREATE ROLE monitor LOGIN');
for my $db (qw(postgres other))
{
	sql('GRANT USAGE ON SCHEMA idempotency TO app, monitor', $db);
}
sql('GRANT EXECUTE ON FUNCTION idempotency.stats_reset() TO monitor');

# Some activity before the reset, in both databases.
token("'before', lease => '1 hour'");
token("'before', lease => '1 hour'", 'other');

sql('SELECT idempotency.stats_reset()');
is(counters_of('postgres'), '0,0,0,0,0,0,0,0,0', 'after stats_reset(): all zero');
is(counters_of('other'), '0,0,0,0,0,0,0,0,0', 'other database: zero too');

# --- Exact counts ---

my $t;
$t = token("'a', request => '{\"x\": 1}', lease => '1 hour'");          # claims 1
is(outcome("'a', request => '{\"x\": 1}'"), 'in_progress', 'a: in_progress');
is(outcome("'a', request => '{\"x\": 2}'"), 'mismatch', 'a: mismatch while pending');
sql("SELECT idempotency.idem_finish('a', $t, 200, '{\"ok\": true}')");  # finishes 1
is(outcome("'a', request => '{\"x\": 1}'"), 'replay', 'a: replay');
is(outcome("'a', request => '{\"x\": 1}'"), 'replay', 'a: replay again');
is(outcome("'a', request => '{\"x\": 2}'"), 'mismatch', 'a: mismatch when finished');

$t = token("'b', lease => '1 hour'");                                    # claims 2
sql("SELECT idempotency.idem_release('b', $t)");                         # releases 1
is(claim_line("'b', lease => '1 hour'") =~ s/\|\d+\|/|T|/r, 'claimed|T|1',
	'b: claimed again after release, attempt 1');                        # claims 3
$t = sql("SELECT token FROM idempotency.keys WHERE key = 'b'");
sql("SELECT idempotency.idem_finish('b', $t, 503, status => 'failed')"); # finishes 2
is(outcome("'b'"), 'replay', 'b: replay of the failure');               # replays 3

# c: a stale claim the worker resets; the next claim takes it over.
$t = token("'c', lease => '1 second', retention => '1 day'");           # claims 4
ok( $node->poll_query_until(
		'postgres', "SELECT token IS NULL FROM idempotency.keys WHERE key = 'c'"),
	'c: the worker reset the stale claim');                              # reset 1
my ($o, $t2, $att) = split /\|/, claim_line("'c', lease => '1 hour'");   # claims 5, takeovers 1
is("$o|$att", 'claimed|2', 'c: taken over as attempt 2');
sql("SELECT idempotency.idem_finish('c', $t2, 200)");                    # finishes 3

# e1, e2: expired by the worker.  Each is claimed and finished in one
# statement (one transaction), so that the worker cannot reset or expire it
# under its 1 second lease before the finish.
for my $k (qw(e1 e2))
{
	is( sql("SELECT c.outcome FROM idempotency.idem_claim('$k', lease => '1 second', "  # claims 6, 7
			  . "retention => '1 second') AS c "
			  . "WHERE idempotency.idem_finish('$k', c.token, 200) IS NOT NULL"),   # finishes 4, 5
		'claimed', "$k: claimed and finished");
}
ok( $node->poll_query_until(
		'postgres', "SELECT count(*) = 0 FROM idempotency.keys WHERE key LIKE 'e_'"),
	'e1, e2: expired by the worker');                                    # expired 2

# Another scope is another key.
token("'a', scope => 't1', lease => '1 hour'");                          # claims 8

is(counters_of('postgres'), '8,1,3,1,2,5,1,2,1',
	'claims 8, takeovers 1, replays 3, in_progress 1, mismatches 2, '
	  . 'finishes 5, releases 1, expired 2, reset 1');
is( sql("SELECT last_sweep_at IS NOT NULL AND last_sweep_at <= clock_timestamp(), "
		  . "last_sweep_ms >= 0 FROM idempotency.stats "
		  . "WHERE database = current_database()"),
	't|t', 'last_sweep_at and last_sweep_ms are set by the worker');
ok(wait_next_sweep($node, 'postgres'),
	'last_sweep_at moves forward with the next sweep');

# Key counts by status, from the table: before (pending), t1/a (pending),
# a and c succeeded, b failed.
is( sql("SELECT pending, succeeded, failed FROM idempotency.stats "
		  . "WHERE database = current_database()"),
	'2|2|1', 'key counts: 2 pending, 2 succeeded, 1 failed');
is( sql("SELECT count(*) FILTER (WHERE status = 'pending') || '|' || "
		  . "count(*) FILTER (WHERE status = 'succeeded') || '|' || "
		  . "count(*) FILTER (WHERE status = 'failed') FROM idempotency.keys"),
	'2|2|1', '... the same as in the table');

# Counters are per database.
is(counters_of('other'), '0,0,0,0,0,0,0,0,0',
	'other: nothing counted from activity in postgres');
token("'o1', lease => '1 hour'", 'other');
token("'o2', lease => '1 hour'", 'other');
is(outcome("'o1'", 'other'), 'in_progress', 'other: o1 in_progress');
is(counters_of('other'), '2,0,0,1,0,0,0,0,0', 'other: claims 2, in_progress 1');
is( sql("SELECT database, claims, in_progress, pending IS NULL "
		  . "FROM idempotency.stats WHERE database = 'other'"),
	'other|2|1|t',
	'seen from postgres: the other database\'s counters, without key counts');
is( sql("SELECT count(*) FROM idempotency.stats WHERE database = 'postgres'"),
	'1', 'one row for the current database');
is(counters_of('postgres'), '8,1,3,1,2,5,1,2,1',
	'postgres: unchanged by activity in other');

# --- Who may reset ---

is( sqlstate_of($node, 'postgres', 'SELECT idempotency.stats_reset()', user => 'app'),
	'42501', 'stats_reset() as a plain role: 42501');
is( sql("SELECT has_function_privilege('app', 'idempotency.stats_reset()', 'EXECUTE')"),
	'f', 'stats_reset() is not executable by PUBLIC');
is(counters_of('postgres'), '8,1,3,1,2,5,1,2,1', 'the denied reset changed nothing');
is( $node->safe_psql('postgres',
		"SELECT claims, succeeded FROM idempotency.stats "
		  . "WHERE database = current_database()",
		extra_params => [ '-U', 'app' ]),
	'8|2', 'a plain role may read the view');
is( sqlstate_of($node, 'postgres', 'SELECT idempotency.stats_reset()', user => 'monitor'),
	'00000', 'a role granted EXECUTE may reset');
is(counters_of('postgres'), '0,0,0,0,0,0,0,0,0', 'postgres: zero after the reset');
is(counters_of('other'), '0,0,0,0,0,0,0,0,0', 'other: zero too');
is( sql("SELECT pending, succeeded, failed FROM idempotency.stats "
		  . "WHERE database = current_database()"),
	'2|2|1', 'the key counts are not counters: unchanged');

# A database with the extension where nothing has happened yet: the library
# is preloaded, so its counters are 0 since start-up, not NULL (NULL is what
# the view shows without preloading).  Sweeping is off, so that no sweep
# counts anything there first.
stop_sweeping($node);
sql('CREATE DATABASE fresh');
sql('CREATE EXTENSION idempotency', 'fresh');
is( sql("SELECT concat_ws(',', coalesce(claims::text, 'NULL'), "
		  . "coalesce(expired::text, 'NULL'), coalesce(last_sweep_at::text, 'NULL'), "
		  . "pending) FROM idempotency.stats WHERE database = current_database()",
		'fresh'),
	'0,0,NULL,0',
	'preloaded, nothing happened yet: counters 0, no sweep yet');

$node->stop;

# --- Without preloading ---

my $plain = new_node('plain', port => 55445, preload => 0);
sql('CREATE EXTENSION idempotency', 'postgres', $plain);
sql('CREATE ROLE app LOGIN', 'postgres', $plain);
sql('GRANT USAGE ON SCHEMA idempotency TO app', 'postgres', $plain);

for my $k ([ 's1', 'succeeded', '1 day' ], [ 's2', 'succeeded', '1 day' ],
	[ 'f1', 'failed', '1 day' ], [ 'gone', 'succeeded', '1 second' ])
{
	# Claim and finish in one statement: a claim kept for 1 second is
	# absent once that second has passed, however long the client took.
	is( sql("SELECT c.outcome FROM idempotency.idem_claim('$k->[0]', "
			  . "lease => '1 second', retention => '$k->[2]') AS c "
			  . "WHERE idempotency.idem_finish('$k->[0]', c.token, 200, "
			  . "status => '$k->[1]') IS NOT NULL",
			'postgres', $plain),
		'claimed', "plain: $k->[0] claimed");
}
my ($po, $ptok) = split /\|/,
  claim_line("'p1', lease => '1 second', retention => '1 day'", 'postgres', $plain);
is($po, 'claimed', 'plain: p1 claimed with a 1 second lease');
ok( $plain->poll_query_until(
		'postgres',
		"SELECT bool_and(expires_at < clock_timestamp()) FILTER (WHERE key = 'gone') "
		  . "AND bool_and(lease_until < clock_timestamp()) FILTER (WHERE key = 'p1') "
		  . "FROM idempotency.keys"),
	'plain: gone is past retention, p1 past its lease');

is( sql("SELECT concat_ws(',', database, coalesce(claims::text, 'NULL'), "
		  . "coalesce(takeovers::text, 'NULL'), coalesce(replays::text, 'NULL'), "
		  . "coalesce(in_progress::text, 'NULL'), coalesce(mismatches::text, 'NULL'), "
		  . "coalesce(finishes::text, 'NULL'), coalesce(releases::text, 'NULL'), "
		  . "coalesce(expired::text, 'NULL'), coalesce(reset::text, 'NULL'), "
		  . "coalesce(last_sweep_at::text, 'NULL'), coalesce(last_sweep_ms::text, 'NULL'), "
		  . "pending, succeeded, failed) FROM idempotency.stats",
		'postgres', $plain),
	'postgres,NULL,NULL,NULL,NULL,NULL,NULL,NULL,NULL,NULL,NULL,NULL,1,2,1',
	'not preloaded: one row, NULL counters, key counts from the table '
	  . '(the key past retention not counted)');
is(sqlstate_of($plain, 'postgres', 'SELECT idempotency.stats_reset()'),
	'00000', 'not preloaded: stats_reset() as superuser is a no-op');
is(sqlstate_of($plain, 'postgres', 'SELECT idempotency.stats_reset()', user => 'app'),
	'42501', 'not preloaded: stats_reset() as a plain role: 42501');
is( $plain->safe_psql('postgres',
		"SELECT claims IS NULL, succeeded FROM idempotency.stats",
		extra_params => [ '-U', 'app' ]),
	't|2', 'not preloaded: a plain role reads the view');
is( sql("SELECT count(*) FROM pg_stat_activity "
		  . "WHERE backend_type LIKE 'idempotency%'", 'postgres', $plain),
	'0', 'not preloaded: no worker');
is(sql("SELECT count(*) FROM idempotency.keys", 'postgres', $plain),
	'5', 'not preloaded: nothing swept the key past retention');
is(sql("SELECT expired, reset FROM idempotency.idem_sweep()", 'postgres', $plain),
	'1|1', 'not preloaded: idem_sweep() by hand expires one key, resets one');
is( sql("SELECT string_agg(key || ':' || (token IS NULL), ',' ORDER BY key) "
		  . "FROM idempotency.keys", 'postgres', $plain),
	'f1:false,p1:true,s1:false,s2:false', 'not preloaded: gone deleted, p1 reset');
is( sql("SELECT pending, succeeded, failed, claims IS NULL FROM idempotency.stats",
		'postgres', $plain),
	'1|2|1|t', 'not preloaded: the view after the sweep');

$plain->stop;
done_testing();
