
# Copyright: the idempotency extension authors.
#
# 116_worker_session_scan.pl: the worker looks for the keys of ended
# sessions (a scan of keys_owner_session_idx) only when a session that
# owned session-bound claims ended since its last visit, and at its first
# visit after a start.  Quiet visits leave the index alone, which
# pg_stat_user_indexes.idx_scan shows; an owner's disconnect is seen to at
# the next visit, and a key bound to a session from before a restart is
# reset by the first visit after it.
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
	"tests when the background worker scans for the keys of ended sessions; the SQL edition has no worker (it checks owners at the next claim or sweep)");

my $node = new_node('sessionscan', port => 55455,
	conf => ["idempotency.sweep_interval = '100ms'"], extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

# Scans of the session-owner index so far (every sweeper flushes its
# statistics when it exits at the end of its visit).
sub idx_scans
{
	return sql("SELECT idx_scan FROM pg_stat_user_indexes "
		  . "WHERE indexrelname = 'keys_owner_session_idx'");
}

sub wait_sweeps
{
	my ($n, $what) = @_;
	my $ok = 1;
	$ok &&= wait_next_sweep($node, 'postgres') for 1 .. $n;
	ok($ok, $what);
}

# A session-bound claim of $key in a session that then disconnects.
sub claim_and_leave
{
	my ($key) = @_;
	my $owner = $node->background_psql('postgres');
	my $o = $owner->query_safe("SELECT outcome FROM idempotency.idem_claim('$key', "
		  . "lease => '1 hour', session_bound => true)");
	$owner->quit;
	return $o;
}

wait_sweeps(2, 'the worker has made its first visits');
my $before = idx_scans();
wait_sweeps(5, 'five more visits');
is(idx_scans(), $before, 'quiet visits do not scan the session-owner index');

# Short-lived client connections that owned nothing do not count either.
sql('SELECT 1') for 1 .. 5;
wait_sweeps(3, 'three more visits after plain connections came and went');
is(idx_scans(), $before, 'sessions that owned no claim do not make it scan');

is(claim_and_leave('gone'), 'claimed', 'a session-bound claim, then its session ends');
ok( $node->poll_query_until('postgres',
		"SELECT token IS NULL FROM idempotency.keys WHERE key = 'gone'"),
	'the next visit resets the key of the ended session');
my $after_end = idx_scans();
cmp_ok($after_end, '>', $before, 'that visit scanned the session-owner index');
wait_sweeps(5, 'five more visits');
is(idx_scans(), $after_end, 'and the visits after it do not');

# A server restart ends every session: the first visit after it looks.
my $owner = $node->background_psql('postgres');
is( $owner->query_safe("SELECT outcome FROM idempotency.idem_claim('restart', "
		  . "lease => '1 hour', session_bound => true)"),
	'claimed', 'a session-bound claim whose session lives until the restart');
$node->stop('immediate');
$owner->{run}->kill_kill;
$node->start;
ok( $node->poll_query_until('postgres',
		"SELECT token IS NULL FROM idempotency.keys WHERE key = 'restart'"),
	'the first visits after the restart reset it');

$node->stop;
done_testing();
