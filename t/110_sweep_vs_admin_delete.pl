
# Copyright: the idempotency extension authors.
#
# 110_sweep_vs_admin_delete.pl: the sweep never waits on another
# transaction's row, so it cannot deadlock with one.
#
# An administrator's bulk DELETE on idempotency.keys takes each row's lock
# as it goes and waits for rows the sweep has deleted but not yet
# committed.  If the sweep in turn waited for a row the DELETE had locked
# after the sweep re-read it, the two would deadlock.  Here idem_sweep batches and bulk DELETEs race over the same
# expired rows, in the same order, round after round; every statement must
# succeed (no 40P01 on either side), and between them every row is gone.
# A second part runs the same race against the background worker.
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
use Time::HiRes qw(usleep);

my $node = new_node('sweepadmin', port => 55449,
	conf => ["idempotency.sweep_interval = 0", "deadlock_timeout = '50ms'"],
	extension => 1);

my $rounds = 10;
my $nkeys  = 20000;

sub sql { return $node->safe_psql('postgres', $_[0]); }

# $n expired keys in $scope, all with the same sweep_at, inserted in one
# statement: the sweep's index order is then the table's physical order,
# which is the order a bulk DELETE's seq scan visits them in.
sub fill_expired
{
	my ($scope, $n) = @_;
	sql(qq{
		INSERT INTO idempotency.keys (scope, key, status, token, attempt, fingerprint,
			response_code, response_body, created_at, finished_at, lease_until,
			expires_at, retention, sweep_at)
		SELECT '$scope', i::text, 'succeeded', i, 1, NULL, 200, '{}'::jsonb,
			   now() - interval '2 hours', now() - interval '2 hours', NULL,
			   now() - interval '1 hour', interval '1 hour', now() - interval '1 hour'
		  FROM generate_series(1, $n) i});
	sql('ANALYZE idempotency.keys');
}

# Send $statement to a background psql session and return once the session
# has started it (it echoes "started" first), with what the session printed
# so far; finish_statement takes that.  query_until returns all the output
# read so far and then drops it: on a busy machine the statement can end
# before "started" is read, and its "finished" is then read along with it,
# so waiting for "finished" with another query_until would never end.
sub start_statement
{
	my ($session, $statement) = @_;
	return $session->query_until(qr/started\n/,
		"\\echo started\n$statement;\n\\echo finished\n");
}

# Return once the statement that start_statement sent has ended.
sub finish_statement
{
	my ($session, $seen) = @_;
	$session->query_until(qr/finished\n/, '') unless $seen =~ /finished\n/;
}

# A procedure that sweeps in committed batches until nothing is left,
# like the worker, returning how many keys it expired.
sql(q{
	CREATE PROCEDURE sweep_all(INOUT swept bigint DEFAULT 0)
	LANGUAGE plpgsql AS $$
	DECLARE
		e bigint;
		r bigint;
	BEGIN
		LOOP
			SELECT s.expired, s.reset INTO e, r FROM idempotency.idem_sweep(200) s;
			swept := swept + e;
			COMMIT;
			EXIT WHEN e < 200 AND r < 200;
		END LOOP;
	END $$});

# --- idem_sweep against a bulk DELETE ---

for my $round (1 .. $rounds)
{
	fill_expired("r$round", $nkeys);
	my $sweeper = $node->background_psql('postgres', on_error_stop => 0);
	my $admin   = $node->background_psql('postgres', on_error_stop => 0);

	# start both; the DELETE a moment after the sweep, so they meet
	my $swept = start_statement($sweeper, 'CALL sweep_all()');
	my $deleted = start_statement($admin,
		"DELETE FROM idempotency.keys WHERE scope = 'r$round'");
	finish_statement($sweeper, $swept);
	finish_statement($admin, $deleted);
	my $err = $sweeper->{stderr} . $admin->{stderr};
	$sweeper->quit;
	$admin->quit;

	unlike($err, qr/deadlock|ERROR/, "round $round: neither the sweep nor the DELETE failed");
	is(sql("SELECT count(*) FROM idempotency.keys WHERE scope = 'r$round'"),
		'0', "round $round: every expired key is gone");
}
is(sql("SELECT count(*) FROM idempotency.keys"), '0', 'the table is empty');

# --- the background worker against a bulk DELETE ---

SKIP:
{
	skip 'SQL edition: no background worker (its sweeps are the idem_sweep calls above)',
	  2 * $rounds
	  if sql_edition();
	for my $round (1 .. $rounds)
	{
		fill_expired("w$round", $nkeys);
		my $admin = $node->background_psql('postgres', on_error_stop => 0);
		alter_system($node, 'idempotency.sweep_interval', '100ms');
		# let the worker get going on the keys, then delete them under it
		usleep(150_000 + 20_000 * $round);
		finish_statement($admin, start_statement($admin,
			"DELETE FROM idempotency.keys WHERE scope = 'w$round'"));
		my $err = $admin->{stderr};
		$admin->quit;
		stop_sweeping($node);

		unlike($err, qr/deadlock|ERROR/, "worker round $round: the DELETE did not fail");
		is(sql("SELECT count(*) FROM idempotency.keys WHERE scope = 'w$round'"),
			'0', "worker round $round: every expired key is gone");
	}
}
is(log_errors($node, pattern => qr/deadlock|sweep of database .* failed/), '',
	'the server log has no deadlock and no failed sweep');

$node->stop;
done_testing();
