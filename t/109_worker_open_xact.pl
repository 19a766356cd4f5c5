
# Copyright: the idempotency extension authors.
#
# 109_worker_open_xact.pl: the worker next to open transactions.
#  - A transaction claims (re-creates) a key whose committed row is past its
#    retention and keeps the transaction open: the worker neither deletes
#    that key nor waits for it; it sweeps other keys meanwhile, and after
#    COMMIT the key holds exactly what that transaction finished.
#  - A row locked FOR UPDATE by another transaction is skipped (not waited
#    for) and swept once the lock is gone.
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
	"tests the background worker next to open transactions; the SQL edition has no worker");

my $node = new_node('openxact', port => 55448,
	conf => ["idempotency.sweep_interval = '200ms'"]);

sub sql { return $node->safe_psql('postgres', $_[0]); }

# Sweeping on (every 200 ms) or off.
sub sweeping
{
	my ($on) = @_;
	if ($on) { alter_system($node, 'idempotency.sweep_interval', '200ms'); }
	else     { stop_sweeping($node); }
}

# A committed, finished key that is past its retention a second from now.
sub expiring_key
{
	my ($key, $retention) = @_;
	return finish_key($node, 'postgres', $key, $retention)->{token};
}

# Wait for $n more sweeps of this database.
sub wait_sweeps
{
	my ($n) = @_;
	for my $i (1 .. $n)
	{
		ok(wait_next_sweep($node, 'postgres'), "another sweep ($i of $n)");
	}
}

sql('CREATE EXTENSION idempotency');

# --- A claim in an open transaction on a key past its retention ---

sweeping(0);
my $old = expiring_key('tk', '1 second');
ok(wait_past_retention($node, 'postgres', 'tk'), 'tk is past its retention');
expiring_key('other', '3 seconds');

my $s = $node->background_psql('postgres');
$s->query_safe('BEGIN');
my ($o, $tok, $att) = split /\|/,
  $s->query_safe(
	"SELECT outcome, token, attempt FROM idempotency.idem_claim('tk', "
	  . "request => '{\"new\": true}', lease => '1 hour', retention => '1 second')");
is($o, 'claimed', 'tk: claimed again in an open transaction (it was past retention)');
cmp_ok($tok, '>', $old, 'tk: with a new token');

sql('SELECT idempotency.stats_reset()');
sweeping(1);
ok( $node->poll_query_until(
		'postgres', "SELECT count(*) = 0 FROM idempotency.keys WHERE key = 'other'"),
	'the worker sweeps other keys while tk is held (it does not wait on tk)');
wait_sweeps(2);
is( sql("SELECT status, token FROM idempotency.keys WHERE key = 'tk'"),
	"succeeded|$old", 'others still see the committed tk, not deleted');

$s->query_safe(
	"SELECT idempotency.idem_finish('tk', $tok, 201, '{\"done\": 1}', "
	  . "retention => '1 day')");
$s->query_safe('COMMIT');
is( sql("SELECT status, token, attempt, response_code, response_body, "
		  . "encode(fingerprint, 'hex') = encode(sha256('{\"new\": true}'::bytea), 'hex') "
		  . "FROM idempotency.keys WHERE key = 'tk'"),
	"succeeded|$tok|$att|201|{\"done\": 1}|t",
	'tk after COMMIT: exactly what the open transaction finished');
wait_sweeps(2);
is(sql("SELECT count(*) FROM idempotency.keys WHERE key = 'tk'"),
	'1', 'tk is kept (retention 1 day)');
is( sql("SELECT expired FROM idempotency.stats WHERE database = current_database()"),
	'1', 'the worker expired exactly one key (other)');

# --- A row locked FOR UPDATE ---

sweeping(0);
expiring_key('locked', '1 second');
ok(wait_past_retention($node, 'postgres', 'locked'), 'locked is past its retention');
expiring_key('other2', '3 seconds');
$s->query_safe('BEGIN');
is( $s->query_safe(
		"SELECT status FROM idempotency.keys WHERE key = 'locked' FOR UPDATE"),
	'succeeded', 'locked: row locked FOR UPDATE by an open transaction');
sweeping(1);
ok( $node->poll_query_until(
		'postgres', "SELECT count(*) = 0 FROM idempotency.keys WHERE key = 'other2'"),
	'the worker sweeps other2 while locked is locked');
wait_sweeps(2);
is(sql("SELECT count(*) FROM idempotency.keys WHERE key = 'locked'"),
	'1', 'locked: skipped while the lock is held');
is( sql("SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'idempotency sweeper' "
		  . "AND wait_event_type = 'Lock'"),
	'0', 'no sweeper waits on a lock');
$s->query_safe('COMMIT');
ok( $node->poll_query_until(
		'postgres', "SELECT count(*) = 0 FROM idempotency.keys WHERE key = 'locked'"),
	'locked: swept once the lock is gone');
$s->quit;

is(sql("SELECT string_agg(key, ',') FROM idempotency.keys"), 'tk',
	'only tk remains');
is(log_errors($node), '', 'no error or failure in the log');

$node->stop;
done_testing();
