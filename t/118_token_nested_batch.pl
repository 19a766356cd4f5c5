
# Copyright: the idempotency extension authors.
#
# 118_token_nested_batch.pl: a batch of claims run inside another batch
# leaves the outer batch's tokens as durable as they would be alone.  A
# trigger on idempotency.keys calls idem_claim_many for a key that is
# already finished (a replay: that inner batch draws no token) whenever a
# key named n... is inserted; an outer idem_claim_many of one such key,
# right after a checkpoint, draws the token whose nextval writes the
# sequence record, then its insert runs the inner batch.  With its
# transaction left open (no commit flushes anything), when the outer
# batch has returned its token:
#   - the WAL is flushed up to the sequence page's LSN (the record that
#     covers the token), seen from the same session through pageinspect
#     (skipped where pageinspect is not installed);
#   - after an immediate stop (a crash) and a restart, every token issued
#     is above the token the client saw, and nothing of the open
#     transaction survived.
# The WAL writer must not flush that record on its own meanwhile
# (wal_writer_delay = 10s, wal_writer_flush_after = 0), nor may a commit
# of autovacuum (autovacuum = off).  A batch defers the flush only for
# tokens drawn from nextval: the library is not preloaded here (with it,
# tokens come from a block made durable ahead of need, t/120_token_block.pl).
# Run as described at the top of t/001_restart.pl.  Port 55460 only names
# the socket file.

use strict;
use warnings FATAL => 'all';

use FindBin;
use lib "$FindBin::Bin/lib";
use IdemTest;
use PostgreSQL::Test::Cluster;
use PostgreSQL::Test::Utils;
use Test::More;

my $node = new_node('nested', port => 55460, preload => 0,
	conf => ["wal_writer_delay = '10s'", "wal_writer_flush_after = 0",
		"autovacuum = off", "idempotency.sweep_interval = 0"],
	extension => 1);

sub sql { return $node->safe_psql('postgres', $_[0]); }

if (sql_edition()
	&& sql("SELECT current_setting('server_version_num')::int < 170000") eq 't')
{
	$node->stop;
	plan(skip_all => 'SQL edition: before PostgreSQL 17 its tokens are durable '
		  . 'only once a later WAL flush covers them (sql-edition/README.md)');
}

# The sequence page's LSN, read by pageinspect.
my $pageinspect = sql("SELECT count(*) FROM pg_available_extensions "
	  . "WHERE name = 'pageinspect'") eq '1';
sql('CREATE EXTENSION pageinspect') if $pageinspect;

# The finished key the inner batch replays, then the trigger.  The inner
# batch's outcomes go to a table, so that the test sees what it did.
my $done = finish_key($node, 'postgres', 'done', '1 day');
is($done->{outcome}, 'claimed', 'setup: the key the inner batch replays is claimed');
sql(q{
CREATE TABLE public.inner_batch (outer_key text, key text, outcome text, token bigint);
-- the trigger writes here with the rights of the table's owner
DO $$ BEGIN EXECUTE format('GRANT INSERT ON public.inner_batch TO %s', (SELECT c.relowner::regrole
	FROM pg_class c WHERE c.oid = 'idempotency.keys'::regclass)); END $$;
CREATE FUNCTION public.inner_batch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
	INSERT INTO public.inner_batch
	SELECT NEW.key, c.key, c.outcome, c.token
	FROM idempotency.idem_claim_many(ARRAY['done']) AS c;
	RETURN NULL;
END $$;
CREATE TRIGGER inner_batch AFTER INSERT ON idempotency.keys
	FOR EACH ROW WHEN (NEW.key LIKE 'n%') EXECUTE FUNCTION public.inner_batch();
});

# The outer batch: its nextval, the first after the checkpoint, writes the
# sequence record; the transaction stays open.  The session makes no
# temporary table: with a trigger on the table, the C edition refuses
# claims in a session that has one (55000).
sql('CHECKPOINT');
my $before = sql('SELECT pg_current_wal_insert_lsn()');
my $s = $node->background_psql('postgres');
$s->query_safe('BEGIN');
my $seen = $s->query_safe("SELECT token FROM idempotency.idem_claim_many("
	  . "ARRAY['n1'], scope => 'nested')");
like($seen, qr/^\d+$/, "the outer batch returns a token ($seen)");
is( $s->query_safe("SELECT concat_ws('|', outer_key, key, outcome, "
		  . "coalesce(token::text, 'NULL')) FROM public.inner_batch"),
	'n1|done|replay|NULL',
	'the inner batch ran inside the outer one and replayed (no token drawn)');

SKIP:
{
	skip 'pageinspect is not available', 2 unless $pageinspect;
	my ($page, $wrote, $flushed) = split /\|/,
	  $s->query_safe("SELECT p, p > '$before'::pg_lsn, pg_current_wal_flush_lsn() >= p "
		  . "FROM (SELECT (page_header(get_raw_page('idempotency.token_seq', 0))).lsn "
		  . "AS p) AS s");
	is($wrote, 't', "the outer batch's token wrote a sequence record (page LSN $page)");
	is($flushed, 't',
		'the WAL is flushed up to that record when the outer batch has returned');
}

# The crash, the transaction still open.
$node->stop('immediate');
$s->{run}->kill_kill;
$node->start;

my $after = sql("SELECT min(token) FROM idempotency.idem_claim_many("
	  . "ARRAY['after-1', 'after-2'], scope => 'nested')");
my $single = claim($node, 'postgres', "'after-3', scope => 'nested'");
is($single->{outcome}, 'claimed', 'after the crash: a single claim is claimed');
cmp_ok($after, '>', $seen,
	'after the crash: the tokens of a batch are above the token the client saw');
cmp_ok($single->{token}, '>', $seen,
	'after the crash: the token of a single claim is above the token the client saw');
is(sql("SELECT string_agg(key, ',' ORDER BY key) FROM idempotency.keys "
		. "WHERE scope = 'nested'"),
	'after-1,after-2,after-3', 'after the crash: nothing of the open transaction survived');
is(sql('SELECT count(*) FROM public.inner_batch'), '0',
	'after the crash: nor anything its inner batch wrote');
like(stored_row($node, 'postgres', '', 'done'), qr/^succeeded\|$done->{token}\|1\|/,
	'after the crash: the replayed key is stored as it was');

$node->stop;
done_testing();
