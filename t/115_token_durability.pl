
# Copyright: the idempotency extension authors.
#
# 115_token_durability.pl: no fencing token reaches a client before the
# sequence record that covers it is flushed, whichever backend wrote that
# record.  Twice: on a server without the library preloaded, where each
# token is a nextval and the sequence logs its position 32 values ahead,
# leaving the flush to commit; and on one with it preloaded, where tokens
# come from a block that a refill reserves ahead (tiny blocks here,
# idempotency.test_token_block = 4, so that the claims below refill them
# many times).  A batch of claims draws its first token after a checkpoint
# (without preloading, its nextval writes that record) and stops half-way,
# its transaction open.  Other sessions then take tokens, by single claims
# and by batches, and keep their transactions open, so no commit flushes
# anything.  After an immediate stop (a crash) every token a client saw
# must be below every token issued after the restart.
#
# Needs a test build (make IDEM_TEST_PAUSES=1): the batch stops at the
# pause point "claim-many-element" while this test holds
# pg_advisory_lock(7655) (in the SQL edition, a trigger on the insert of
# its second key waits for that lock; it has no library to preload and
# runs once).  Run as described at the top of t/001_restart.pl.  Ports
# 55454 and 55457 only name the socket files.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use List::Util qw(max min);
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node;

sub sql { return $node->safe_psql('postgres', $_[0]); }

for my $preload (sql_edition() ? (0) : (0, 1))
{
	my $what = $preload ? 'preloaded' : 'not preloaded';

	# The WAL writer must not flush the record on its own before the crash.
	$node = new_node($preload ? 'blocks' : 'tokens', port => $preload ? 55457 : 55454,
		preload => $preload,
		conf => ["wal_writer_delay = '10s'", "wal_writer_flush_after = 0",
			"idempotency.sweep_interval = 0",
			$preload ? ("idempotency.test_token_block = 4") : ()],
		extension => 1);

	# The SQL edition has no pause points: there a trigger stops the batch at
	# the insert of its second key, on the same lock, after its first element
	# drew its token.  It waits without the claim's own lock_timeout.
	if (sql_edition())
	{
		sql(q{
	CREATE FUNCTION public.stop_batch() RETURNS trigger LANGUAGE plpgsql
	SET lock_timeout = 0 AS $$
	BEGIN
		IF NEW.key LIKE 'b%-2' THEN
			PERFORM pg_catalog.pg_advisory_lock(7655);
			PERFORM pg_catalog.pg_advisory_unlock(7655);
		END IF;
		RETURN NEW;
	END $$;
	CREATE TRIGGER stop_batch BEFORE INSERT ON idempotency.keys
		FOR EACH ROW EXECUTE FUNCTION public.stop_batch();
	});
	}

	for my $round (1 .. 3)
	{
		my @seen;
		my $hold = $node->background_psql('postgres');
		$hold->query_safe('SELECT pg_advisory_lock(7655)');

		# The batch: its first nextval after the checkpoint writes the record.
		sql('CHECKPOINT');
		my $batch = $node->background_psql('postgres');
		$batch->query_safe("SET application_name = 'batch'");
		$batch->query_safe("SET idempotency.test_pause = 'claim-many-element'")
		  unless sql_edition();
		$batch->query_until(qr/started/,
			"\\echo started\nBEGIN;\nSELECT max(token) FROM idempotency.idem_claim_many("
			  . "ARRAY['b$round-1', 'b$round-2'], scope => 'durable');\n");
		ok( $node->poll_query_until(
				'postgres',
				"SELECT wait_event_type = 'Lock' FROM pg_stat_activity "
				  . "WHERE application_name = 'batch'"),
			"$what, round $round: the batch stops after its first element");

		# Single claims and batches of others, each in an open transaction.
		my @open;
		for my $i (1 .. 3)
		{
			my $s = $node->background_psql('postgres');
			$s->query_safe('BEGIN');
			push @seen,
			  $s->query_safe("SELECT token FROM idempotency.idem_claim("
				  . "'s$round-$i', scope => 'durable')");
			push @seen,
			  split /\n/,
			  $s->query_safe("SELECT token FROM idempotency.idem_claim_many("
				  . "ARRAY['m$round-$i-1', 'm$round-$i-2'], scope => 'durable') "
				  . "ORDER BY ord");
			push @open, $s;
		}
		is(scalar(grep { /^\d+$/ } @seen), 9, "$what, round $round: 9 tokens seen by clients");

		# The crash.
		$node->stop('immediate');
		$_->{run}->kill_kill for (@open, $batch, $hold);
		$node->start;

		my $after = sql("SELECT max(token) FROM idempotency.idem_claim_many("
			  . "ARRAY['after$round-1', 'after$round-2'], scope => 'durable')");
		my $single = sql("SELECT token FROM idempotency.idem_claim("
			  . "'after$round-3', scope => 'durable')");
		my $first_after = min(
			sql("SELECT min(token) FROM idempotency.keys WHERE key LIKE 'after$round-%'"));
		cmp_ok($first_after, '>', max(@seen),
			"$what, round $round: every token issued after the crash ($first_after..) "
			  . "is above every token a client saw (.." . max(@seen) . ")");
		is(sql("SELECT count(*) FROM idempotency.keys WHERE scope = 'durable' "
				. "AND key NOT LIKE 'after%'"),
			'0', "$what, round $round: nothing of the open transactions survived");
	}

	$node->stop;
}

done_testing();
